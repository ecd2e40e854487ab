#!/usr/bin/env bash
# Resident decode of two builds on a lent GPU (the `device` tool), A/B in one run: on
# 3-layer `synth --preset qwen3-30b-a3b` vaults in bf16 and Q4_K_M and a 12-layer bf16
# one, the VRAM tier holding every expert (so decode steps are routed on the device),
# a 512-token prompt and 256 greedy tokens, each build twice, interleaved; whether the
# two builds' logits are byte-identical (and their largest difference where not); then
# NEW's phase and per-kernel profile (`generate --profile`) of the 3-layer vaults.
#
#   bash bench/gpu_decode_ab.sh NEW OLD
#
# NEW and OLD are release `smoe-pipeline` binaries (stripped is fine). The vaults go to
# /tmp/q30, /tmp/q30q and /tmp/q30l12 (kept while the machine stays warm). Output goes to
# stdout and, when set, the profiles to $OUT.
set -euo pipefail
[ $# -eq 2 ] || { sed -n 2,13p "$0" >&2; exit 2; }
new=$(realpath "$1")
old=$(realpath "$2")
out=${OUT:-/tmp/gpu_decode_ab}
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
gpu_env "$new"
for v in q30 q30q q30l12; do
  case $v in
  q30) resident_q30 "$new" q30 --layers 3 ;;
  q30q) resident_q30 "$new" q30q --layers 3 --quant q4_k_m ;;
  q30l12) resident_q30 "$new" q30l12 --layers 12 ;;
  esac
  for run in 1 2; do
    for b in old new; do
      bin=$old; [ $b = new ] && bin=$new
      "$bin" generate "${flags[@]}" --json --logits-out "/tmp/$v-$b.logits" >"/tmp/$v-$b.json" 2>"/tmp/$v-$b.err" \
        || { tail -3 "/tmp/$v-$b.err" >&2; exit 1; }
      python3 -c "import json; s=json.load(open('/tmp/$v-$b.json'))['stats']; print('$v $b run $run: prefill', round(s['prefill_tok_s']), 'tok/s, decode', round(s['decode_tok_s'], 1), 'tok/s')"
    done
  done
  python3 - "/tmp/$v-old.logits" "/tmp/$v-new.logits" "$v" <<'PY'
import array, json, struct, sys
def load(p):
    b = open(p, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    s, e = json.loads(b[8:8 + n])['logits']['data_offsets']
    a = array.array('f'); a.frombytes(b[8 + n + s:8 + n + e]); return a
a, b = load(sys.argv[1]), load(sys.argv[2])
d = max(abs(x - y) for x, y in zip(a, b)) if len(a) == len(b) else float('inf')
print(f"{sys.argv[3]}: logits " + ("byte-identical" if a == b else f"differ, max |old - new| {d:.3g}"))
PY
  [ $v = q30l12 ] && continue
  "$new" generate "${flags[@]}" --profile 2>&1 >/dev/null | grep -v "INFO\|WARN" >"$out/$v-profile.txt"
  sed -n '/^Decode/,$p' "$out/$v-profile.txt"
done
