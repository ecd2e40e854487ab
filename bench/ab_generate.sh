#!/usr/bin/env bash
# Two smoe-pipeline builds against each other in the same run (the machines are noisy):
# alternating `generate --json` runs on one vault, printing prefill tok/s, decode tok/s
# and TTFT per run.
#
#   bench/ab_generate.sh A_BIN B_BIN VAULT RING_SLOTS PROMPT_TOKENS DECODE_TOKENS [ROUNDS]
#
# Example (routing inside the executor vs the router stage, results/router-ab-*.txt):
#   git worktree add /tmp/old 7c0a46a && (cd /tmp/old && cargo build --release)
#   bench/ab_generate.sh /tmp/old/target/release/smoe-pipeline target/release/smoe-pipeline \
#     /work/benchdata/q30-l4.vault 512 256 64
set -euo pipefail
[ $# -ge 6 ] || { sed -n 2,11p "$0" >&2; exit 2; }
a=$1 b=$2 vault=$3 slots=$4 prompt=$5 decode=$6 rounds=${7:-3}
ids=$(python3 -c "print(','.join(str((i*7919)%150000+1) for i in range($prompt)))")
for _ in $(seq "$rounds"); do
  for side in "A:$a" "B:$b"; do
    "${side#*:}" generate --vault "$vault" --prompt-ids "$ids" --max-tokens "$decode" --ignore-eos \
      --ring-slots "$slots" --json 2>/dev/null | python3 -c "
import json, sys
s = json.load(sys.stdin)['stats']
print('${side%%:*}', 'prefill_tok_s=%.1f' % s['prefill_tok_s'], 'decode_tok_s=%.2f' % s['decode_tok_s'], 'ttft_ms=%.0f' % s['ttft_ms'])"
  done
done
