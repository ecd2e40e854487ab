# Sourced by the GPU bench scripts: the Vulkan loader on a lent GPU machine (the `device`
# tool's README): unpacks .gl/*.deb when present, and points the loader at the NVIDIA ICD
# when smoe-pipeline BIN ($1) finds no device without it.
gpu_env() {
  export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
  if compgen -G ".gl/*.deb" >/dev/null; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
  fi
  if ! "$1" devices >/dev/null 2>&1; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  fi
}
