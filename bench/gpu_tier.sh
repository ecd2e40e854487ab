#!/usr/bin/env bash
# The Vulkan executor on a lent GPU (the `device` tool): where a layer step's time goes
# (`generate --profile`), on a 3-layer `synth --preset qwen3-30b-a3b` vault with every
# expert resident in the ring.
#
#   bash bench/gpu_tier.sh BIN [VAULT] [PROMPT_TOKENS] [DECODE_TOKENS]
#
# BIN is a release `smoe-pipeline` (stripped is fine). Without VAULT the script writes
# the synth vault to /tmp/q30. Loader: like bench/vulkan_gpu.sh, it unpacks .gl/*.deb
# when present. Output (tables and JSON) goes to stdout and, when set, to $OUT.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,11p "$0" >&2; exit 2; }
bin=$(realpath "$1")
vault=${2:-/tmp/q30}
prompt=${3:-512}
decode=${4:-64}
out=${OUT:-/tmp/gpu_tier_out}
mkdir -p "$out"
export XDG_RUNTIME_DIR=/tmp
if compgen -G ".gl/*.deb" >/dev/null; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
if ! "$bin" devices >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
"$bin" devices | tee "$out/devices.txt"
dev=$("$bin" devices --json | python3 -c "import json,sys; d=json.load(sys.stdin); print(next((x['index'] for x in d if x['usable'] and 'discrete' in x['kind']), 0))")
[ -d "$vault" ] || "$bin" synth --preset qwen3-30b-a3b --layers 3 --out "$vault" | tail -1
vocab=$(python3 -c "import json; print(json.load(open('$vault/manifest.json'))['model']['vocab_size'])")
ids=$(python3 -c "print(','.join(str((i*7919+13)%$vocab) for i in range($prompt)))")

# One greedy run: prefill PROMPT_TOKENS in one chunk, decode DECODE_TOKENS, every expert
# resident (the ring holds them all); prints tok/s and the profile, keeps the JSON.
run() {
  local name=$1
  shift
  "$bin" generate --vault "$vault" --prompt-ids "$ids" --max-tokens "$decode" --ignore-eos --json \
    --backend vulkan --device "$dev" --chunk-size "$prompt" --max-context $((prompt + decode + 8)) \
    --ring-bytes 64GiB "$@" >"$out/$name.json" 2>"$out/$name.err" || { cat "$out/$name.err" >&2; exit 1; }
  python3 - "$out/$name.json" "$vault" "$name" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))["stats"]
m = json.load(open(sys.argv[2] + "/manifest.json"))
cfg = m["model"]
# Bytes one decode step reads: every resident tensor but the embedding table (one row of
# it), and top-k experts per MoE layer.
res = sum(t["len"] for t in m["resident"]["tensors"] if t["name"] != "model.embed_tokens.weight")
emb = next(t for t in m["resident"]["tensors"] if t["name"] == "model.embed_tokens.weight")
res += emb["len"] // cfg["vocab_size"]
moe_layers = len(m["experts"]["layers"])
per_token = res + moe_layers * cfg["num_experts_per_tok"] * s["bytes_per_expert"]
hbm = 4.8e12
d = s["decode_tok_s"]
print(f"{sys.argv[3]}: prefill {s['prefill_tok_s']:.1f} tok/s, decode {d:.2f} tok/s; "
      f"{per_token/1e6:.1f} MB/token -> {d*per_token/1e9:.1f} GB/s, "
      f"{100*d*per_token/hbm:.2f}% of the HBM-bound {hbm/per_token:.0f} tok/s")
EOF
  cat "$out/$name.err" | grep -v "^$" || true
}

run profile --profile --warmup
