#!/usr/bin/env bash
# A hybrid (gated DeltaNet + gated attention + shared expert) model streamed from disk:
# layer-major prefill against token-serial replay in the same run, then decode, with the
# ring at 1/4 of the expert bytes (issue 13's measurement).
#
#   bash bench/hybrid_stream.sh BIN [PRESET] [LAYERS] [QUANT] [PROMPT_TOKENS] [DECODE] [BACKEND]
#
# Defaults: qwen3.5-397b-a17b, 4 layers (3 DeltaNet + 1 attention), q4_k_m (8 bf16 layers
# of the 397B are 103 GB), 512 prompt tokens, 16 decode tokens, cpu. Writes the vault to
# /tmp/hybrid-PRESET-LAYERS-QUANT when missing. Prints prefill tok/s (layer-major and
# serial, and their ratio), decode tok/s and the bytes read per token; $OUT gets the JSON.
# MODES="layer-major" skips token-serial replay (at thousands of prompt tokens it reads
# the ring's misses once per token: hours on a slow disk). $EXTRA is added to every
# generate (e.g. "--vram-bytes 0": on a GPU the VRAM tier would otherwise keep every
# expert prefill touched, and decode would no longer stream).
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,11p "$0" >&2; exit 2; }
bin=$(realpath "$1")
preset=${2:-qwen3.5-397b-a17b}
layers=${3:-4}
quant=${4:-q4_k_m}
prompt=${5:-512}
decode=${6:-16}
backend=${7:-cpu}
out=${OUT:-/tmp/hybrid_stream_out}
mkdir -p "$out"
vault=/tmp/hybrid-$preset-$layers-$quant
qflag=()
[ "$quant" = bf16 ] || qflag=(--quant "$quant")
[ -d "$vault" ] || "$bin" synth --preset "$preset" --layers "$layers" "${qflag[@]}" --out "$vault" | tail -1
ring=$(python3 -c "
import json; m = json.load(open('$vault/manifest.json'))
print(sum(len(l['blobs']) * l['layout']['blob_stride'] for l in m['experts']['layers']) // 4)")
vocab=$(python3 -c "import json; print(json.load(open('$vault/manifest.json'))['model']['vocab_size'])")
ids=$(python3 -c "print(','.join(str((i*7919+13)%$vocab) for i in range($prompt)))")
echo "$preset --layers $layers ($quant), ring $((ring >> 20)) MiB (1/4 of the expert bytes), backend $backend, prompt $prompt, decode $decode"
modes=${MODES:-layer-major serial}
for mode in $modes; do
  "$bin" generate --vault "$vault" --prompt-ids "$ids" --max-tokens "$decode" --ignore-eos --json \
    --backend "$backend" --prefill "$mode" --chunk-size "$prompt" --max-context $((prompt + decode + 8)) \
    --ring-bytes "$ring" ${EXTRA:-} >"$out/$mode.json" 2>"$out/$mode.err" || { cat "$out/$mode.err" >&2; exit 1; }
done
python3 - "$out" $modes <<'PY'
import json, sys
r = {m: json.load(open(f"{sys.argv[1]}/{m}.json")) for m in sys.argv[2:]}
for m, o in r.items():
    s = o["stats"]
    per_tok = s["decode_bytes_read"] / max(s["decode_tokens"], 1) / 1e6
    print(f"{m}: prefill {s['prefill_tok_s']:.2f} tok/s ({s['prefill_bytes_read'] / 1e9:.1f} GB read), "
          f"decode {s['decode_tok_s']:.2f} tok/s, {per_tok:.1f} MB read per decoded token")
if len(r) == 2:
    lm, se = (r[m]["stats"]["prefill_tok_s"] for m in ("layer-major", "serial"))
    same = r["layer-major"]["token_ids"] == r["serial"]["token_ids"]
    print(f"layer-major / serial prefill: {lm / se:.2f}x; generated ids identical: {same}")
PY
