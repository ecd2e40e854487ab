#!/usr/bin/env bash
# Quantised experts against bf16 when streaming is the bound: the same synthetic model
# (`synth --preset qwen3-30b-a3b --routing trained`, seed 0) as a bf16 vault and a
# q4_k_m vault, the ring given the same bytes for both (¼ of the bf16 vault's expert
# bytes), alternating `generate --json` runs: prefill of PROMPT tokens (layer-major,
# default chunk) and greedy decode of DECODE tokens, bytes read per decoded token.
#
#   bench/quant_stream.sh BIN VAULT_DIR [LAYERS] [PROMPT] [DECODE] [ROUNDS] [SCHEME] [BACKEND]
#
# VAULT_DIR keeps the two vaults between runs (made on first use: ~1.2 GB per layer bf16).
# Example (results/quant-stream-2026-11-30.txt):
#   bench/quant_stream.sh target/release/smoe-pipeline /work/benchdata 8 512 32 3
set -euo pipefail
[ $# -ge 2 ] || { sed -n 2,13p "$0" >&2; exit 2; }
bin=$1 dir=$2 layers=${3:-8} prompt=${4:-512} decode=${5:-32} rounds=${6:-3} scheme=${7:-q4_k_m} backend=${8:-cpu}
bf16=$dir/q30-l$layers-trained-bf16.vault quant=$dir/q30-l$layers-trained-$scheme.vault
for v in "$bf16:" "$quant:--quant $scheme"; do
  path=${v%%:*}
  [ -f "$path/manifest.json" ] ||
    "$bin" synth --out "$path" --preset qwen3-30b-a3b --layers "$layers" --seed 0 \
      --routing trained ${v#*:} >&2
done
# The ring: a quarter of the bf16 vault's expert bytes, the same bytes for both vaults.
ring=$(du -sb "$bf16/experts" | cut -f1)
ring=$((ring / 4))
rev=$(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo "?")
echo "# $(date -u +%FT%TZ) $rev ring_bytes=$ring layers=$layers prompt=$prompt decode=$decode scheme=$scheme backend=$backend nproc=$(nproc) load=$(cut -d' ' -f1 /proc/loadavg)"
ids=$(python3 -c "print(','.join(str((i*7919)%150000+1) for i in range($prompt)))")
for round in $(seq "$rounds"); do
  for side in "bf16:$bf16" "$scheme:$quant"; do
    "$bin" generate --vault "${side#*:}" --prompt-ids "$ids" --max-tokens "$decode" \
      --ignore-eos --ring-bytes "$ring" --backend "$backend" --json 2>/dev/null | python3 -c "
import json, sys
s = json.load(sys.stdin)['stats']
n = max(s['decode_tokens'], 1)
print('round=$round', '${side%%:*}', 'ring_slots=%d' % s['ring_slots'],
      'bytes_per_expert=%d' % s['bytes_per_expert'],
      'prefill_tok_s=%.2f' % s['prefill_tok_s'], 'ttft_ms=%.0f' % s['ttft_ms'],
      'prefill_MB=%.1f' % (s['prefill_bytes_read'] / 1e6),
      'decode_tok_s=%.3f' % s['decode_tok_s'],
      'decode_MB_per_token=%.2f' % (s['decode_bytes_read'] / n / 1e6),
      'decode_hits=%d' % s['ring_hits'])"
  done
done
