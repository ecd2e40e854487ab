#!/usr/bin/env bash
# Resident greedy decode of several builds on a lent GPU (the `device` tool), profiled and
# unprofiled, interleaved in one run: the per-token figure that moves least between runs is
# the profile's device-busy time (about ±1% run to run, where tok/s moves ±3%).
# 3-layer `synth --preset qwen3-30b-a3b` vaults (PRESET and LAYERS pick another preset and
# depth, e.g. PRESET=qwen3-next-80b-a3b LAYERS=4; gpu_env.sh's resident_q30: the VRAM tier
# holding every expert, a 512-token prompt, 256 greedy tokens), one run thrown away first,
# then ROUNDS rounds of every build profiled (`generate --profile`: the decode phase's
# summary and device-busy lines), then ROUNDS rounds unprofiled (decode tok/s), then
# whether each build's token ids equal the first build's.
#
#   [QUANTS="q4_k_m bf16"] [ROUNDS=2] [TOKENS=256] [PROFILE=0] [LOGITS=N] [PRESET=P] [LAYERS=N] \
#     bash bench/gpu_profile_ab.sh BIN...
#
# BIN are release `smoe-pipeline` binaries (stripped is fine) with distinct file names,
# which label them; the first is the reference for the ids. QUANTS picks the vaults (any
# `synth --quant` value; gpu_env.sh's q30_quant names them), TOKENS the tokens decoded;
# PROFILE=0 leaves out the profiled rounds (gpu_greedy_ab.sh); LOGITS=N also compares each
# build's logits of N greedy tokens with the first build's, byte for byte. Each run's JSON and
# stderr (the whole profile) go to $OUT (default /tmp/gpu_profile_ab) as
# VAULT-BUILD[-plain].{json,err}. Where `nvidia-smi` is present, the SM clock is logged
# every 10 ms ($OUT/clocks.csv) and each line ends with its range over the run's last
# 0.5 s, where the decode ends: the clock falls to a few hundred MHz while a long vault
# load idles the GPU, and a build that does little work may decode before it is back.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,24p "$0" >&2; exit 2; }
bins=()
for b in "$@"; do bins+=("$(realpath "$b")"); done
# Runs are filed under the builds' file names.
[ "$(printf '%s\n' "${bins[@]##*/}" | sort | uniq -d)" = "" ] || {
  echo "gpu_profile_ab.sh: the builds need distinct file names" >&2
  exit 2
}
out=${OUT:-/tmp/gpu_profile_ab}
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
gpu_env "${bins[0]}"
clocks=""
if command -v nvidia-smi >/dev/null; then
  # Line-buffered, so a run's samples are in the file when it ends.
  stdbuf -oL nvidia-smi --query-gpu=timestamp,clocks.sm --format=csv,noheader -lms 10 >"$out/clocks.csv" &
  clocks=$!
  trap 'kill $clocks 2>/dev/null' EXIT
fi
# One run of build $1 on vault $2 ($3: -plain for an unprofiled run); sets `sm` to the SM
# clock's range over the run's last 0.5 s (empty without nvidia-smi).
run() {
  local bin=$1 v=$2 kind=$3 name
  name=$v-$(basename "$bin")$kind
  local extra=()
  [ -z "$kind" ] && extra=(--profile)
  "$bin" generate "${flags[@]}" "${extra[@]}" >"$out/$name.json" 2>"$out/$name.err" || {
    tail -3 "$out/$name.err" >&2
    exit 1
  }
  sm=""
  [ -n "$clocks" ] || return 0
  sleep 0.05
  # The log's last 200 samples (2 s at 10 ms) hold the window; the rest is not read again.
  sm=$(tail -n 200 "$out/clocks.csv" | python3 -c "
import datetime, sys
end = datetime.datetime.now()
mhz = []
for line in sys.stdin:
    t, _, c = line.partition(', ')
    try:
        at = datetime.datetime.strptime(t.strip(), '%Y/%m/%d %H:%M:%S.%f')
        if 0.05 <= (end - at).total_seconds() <= 0.55:
            mhz.append(int(c.split()[0]))
    except ValueError:
        pass
print(f', SM clock over the last 0.5 s {min(mhz)}-{max(mhz)} MHz' if mhz else '')") || sm=""
}
for quant in ${QUANTS:-q4_k_m bf16}; do
  q30_quant "$quant"
  resident_q30 "${bins[0]}" $v --layers "${LAYERS:-3}" "${q[@]}"
  flags+=(--json)
  "${bins[0]}" generate "${flags[@]}" >/dev/null 2>&1 || true
  for round in $(seq "${ROUNDS:-2}"); do
    [ "${PROFILE:-1}" = 0 ] && break
    for bin in "${bins[@]}"; do
      run "$bin" $v ""
      # The decode phase's summary and its device-busy line (the prefill's comes first).
      echo "$v $(basename "$bin") profiled, round $round: $(awk '/^Decode/ { d = 1; printf "%s ", $0 } d && /^device busy/ { printf "%s", $0; exit }' "$out/$v-$(basename "$bin").err")$sm"
    done
  done
  for round in $(seq "${ROUNDS:-2}"); do
    for bin in "${bins[@]}"; do
      run "$bin" $v -plain
      python3 -c "import json, sys; s = json.load(open(sys.argv[1]))['stats']; print(sys.argv[2], 'decode', round(s['decode_tok_s'], 1), 'tok/s, prefill', round(s['prefill_tok_s']), 'tok/s' + sys.argv[3])" \
        "$out/$v-$(basename "$bin")-plain.json" "$v $(basename "$bin") unprofiled, round $round:" "$sm"
    done
  done
  for bin in "${bins[@]:1}"; do
    python3 -c "
import json, sys
a, b = (json.load(open(p))['token_ids'] for p in sys.argv[1:3])
print(sys.argv[3], 'identical' if a == b else 'differ', len(a))" \
      "$out/$v-$(basename "${bins[0]}")-plain.json" "$out/$v-$(basename "$bin")-plain.json" \
      "$v ids $(basename "$bin") vs $(basename "${bins[0]}"):"
  done
  [ "${LOGITS:-0}" = 0 ] && continue
  # Every build's logits of LOGITS greedy tokens, byte for byte against the first's.
  TOKENS=$LOGITS resident_q30 "${bins[0]}" $v
  for bin in "${bins[@]}"; do
    "$bin" generate "${flags[@]}" --logits-out "$out/$v-$(basename "$bin").logits" >/dev/null 2>"$out/$v-$(basename "$bin")-logits.err" || {
      tail -3 "$out/$v-$(basename "$bin")-logits.err" >&2
      exit 1
    }
  done
  for bin in "${bins[@]:1}"; do
    a=$out/$v-$(basename "${bins[0]}").logits b=$out/$v-$(basename "$bin").logits
    if cmp -s "$a" "$b"; then same=identical; else same=differ; fi
    echo "$v logits of $LOGITS tokens $(basename "$bin") vs $(basename "${bins[0]}"): $same ($(stat -c %s "$b") bytes)"
  done
done
