#!/usr/bin/env bash
# Resident greedy decode (and the 512-token prefill before it) of two builds on a lent GPU
# (the `device` tool), as `serve` runs it (no logits kept: each token's greedy choice comes
# from the executor), A/B in one run:
# 3-layer `synth --preset qwen3-30b-a3b` vaults in bf16 and Q4_K_M, the VRAM tier holding
# every expert, a 512-token prompt and 256 tokens, three interleaved runs per build, then
# whether the two builds' token ids are identical. One run is thrown away before the pairs.
#
#   [QUANTS="bf16 q4_k_m q8_0 ..."] bash bench/gpu_greedy_ab.sh NEW OLD
#
# NEW and OLD are release `smoe-pipeline` binaries (stripped is fine). QUANTS picks the
# vaults (default bf16 and q4_k_m; any `synth --quant` value). They go to /tmp/q30 (bf16),
# /tmp/q30q (q4_k_m) and /tmp/q30-QUANT (kept while the machine stays warm; the same as
# gpu_decode_ab.sh's).
set -euo pipefail
[ $# -eq 2 ] || { sed -n 2,14p "$0" >&2; exit 2; }
new=$(realpath "$1")
old=$(realpath "$2")
. "$(dirname "$0")/gpu_env.sh"
gpu_env "$new"
for quant in ${QUANTS:-bf16 q4_k_m}; do
  q30_quant "$quant"
  resident_q30 "$new" $v --layers 3 "${q[@]}"
  flags+=(--json)
  # One run thrown away first: in both of session 38's bf16 A/Bs the first run after the
  # vault was written (always OLD's) was ~7% slower than every other (1,395 against
  # ~1,500 tok/s), which biased the means against OLD.
  "$old" generate "${flags[@]}" >/dev/null 2>&1 || true
  for run in 1 2 3; do
    for b in old new; do
      bin=$old; [ $b = new ] && bin=$new
      "$bin" generate "${flags[@]}" >"/tmp/$v-$b.json" 2>"/tmp/$v-$b.err" || { tail -3 "/tmp/$v-$b.err" >&2; exit 1; }
      python3 -c "import json; s=json.load(open('/tmp/$v-$b.json'))['stats']; print('$v $b run $run: decode', round(s['decode_tok_s'], 1), 'tok/s, prefill', round(s['prefill_tok_s']), 'tok/s')"
    done
  done
  python3 -c "
import json; a = json.load(open('/tmp/$v-old.json'))['token_ids']; b = json.load(open('/tmp/$v-new.json'))['token_ids']
print('$v: ids', 'identical' if a == b else 'differ', len(a))"
done
