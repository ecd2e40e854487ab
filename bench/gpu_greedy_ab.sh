#!/usr/bin/env bash
# Resident greedy decode (and the 512-token prefill before it) of two builds on a lent GPU
# (the `device` tool), as `serve` runs it (no logits kept: each token's greedy choice comes
# from the executor), A/B in one run: gpu_profile_ab.sh without its profiled rounds, OLD
# as the ids' reference and first in every round. 3-layer `synth --preset qwen3-30b-a3b`
# vaults in bf16 and Q4_K_M, the VRAM tier holding every expert, a 512-token prompt and
# 256 tokens, three interleaved runs per build, then whether the two builds' token ids
# are identical. One run is thrown away before the pairs.
#
#   [QUANTS="bf16 q4_k_m q8_0 ..."] [ROUNDS=3] bash bench/gpu_greedy_ab.sh NEW OLD
#
# NEW and OLD are release `smoe-pipeline` binaries (stripped is fine), labelled `new` and
# `old` in the output. QUANTS picks the vaults (default bf16 and q4_k_m; any `synth
# --quant` value; gpu_env.sh's q30_quant names them).
set -euo pipefail
[ $# -eq 2 ] || { sed -n 2,14p "$0" >&2; exit 2; }
# gpu_profile_ab.sh labels builds by file name: copies under the names new and old.
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
cp "$1" "$d/new"
cp "$2" "$d/old"
QUANTS=${QUANTS:-bf16 q4_k_m} ROUNDS=${ROUNDS:-3} PROFILE=0 bash "$(dirname "$0")/gpu_profile_ab.sh" "$d/old" "$d/new"
