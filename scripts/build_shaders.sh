#!/usr/bin/env bash
# Recompiles the checked-in SPIR-V (shaders/spv/) from the GLSL sources with glslc,
# exactly as actors/build.rs and tests/vulkan_spirv.rs do.
set -euo pipefail
command -v glslc >/dev/null || {
  echo "error: glslc (the GLSL compiler) is not installed; on Debian or Ubuntu: apt-get install glslc" >&2
  exit 1
}
cd "$(dirname "$0")/../shaders"
grep -v '^#' shaders.txt | while read -r name src defs; do
  [ -n "$name" ] || continue
  # shellcheck disable=SC2086
  glslc --target-env=vulkan1.2 -O $defs "$src" -o "spv/$name.spv"
done
echo "rebuilt $(ls spv | wc -l) SPIR-V modules in shaders/spv/"
