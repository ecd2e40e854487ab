# Sourced by the GPU bench scripts: the Vulkan loader on a lent GPU machine (the `device`
# tool's README): unpacks .gl/*.deb when present, and points the loader at the NVIDIA ICD
# when smoe-pipeline BIN ($1) finds no device without it. .gl needs the glvnd libraries
# beside the loader (`apt-get download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1
# libglx0 libgles2`): with libvulkan1 alone the NVIDIA ICD fails to load ("Could not get
# 'vkCreateInstance' ... for ICD libGLX_nvidia.so.0") and no device is found.
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

# The vault of quant $1 (any `synth --quant` value) for resident_q30: sets v to its name
# (bf16: q30, q4_k_m: q30q, another: q30-QUANT; PRESET-lLAYERS-QUANT where $PRESET or
# $LAYERS is set) and q to its synth flags.
q30_quant() {
  case $1 in
  bf16) v=q30 q=() ;;
  q4_k_m) v=q30q q=(--quant q4_k_m) ;;
  *) v=q30-$1 q=(--quant "$1") ;;
  esac
  [ -z "${PRESET:-}${LAYERS:-}" ] || v=${PRESET:-qwen3-30b-a3b}-l${LAYERS:-3}-$1
}

# Resident decode on a q30 synth (gpu_decode_ab.sh, gpu_greedy_ab.sh): `resident_q30 BIN
# NAME [SYNTH ARGS]` writes `synth --preset $PRESET --out /tmp/NAME SYNTH ARGS` ($PRESET
# defaults to qwen3-30b-a3b; any `synth --preset`, hybrids included) when
# /tmp/NAME is missing and sets `flags` to generate's flags for it: Vulkan device 0, the
# VRAM tier holding every expert, a 512-token prompt in one chunk, $TOKENS (default 256)
# tokens past EOS.
resident_q30() {
  local bin=$1 name=$2
  shift 2
  [ -d "/tmp/$name" ] || "$bin" synth --preset "${PRESET:-qwen3-30b-a3b}" --out "/tmp/$name" "$@" | tail -1
  local ids all
  ids=$(python3 -c "print(','.join(str((i*7919+13)%151936) for i in range(512)))")
  # Every expert of every MoE layer at its layer's blob stride.
  all=$(python3 -c "
import json; m = json.load(open('/tmp/$name/manifest.json'))
print(sum(l['layout']['blob_stride'] for l in m['experts']['layers']) * m['model']['num_experts'])")
  flags=(--vault "/tmp/$name" --max-tokens "${TOKENS:-256}" --ignore-eos --backend vulkan --device 0 --chunk-size 512
    --max-context 1200 --ring-bytes 64GiB --vram-bytes "$all" --warmup --prompt-ids "$ids")
}
