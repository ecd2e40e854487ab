#!/usr/bin/env bash
# Lookahead in layer-major prefill streamed from disk: while a chunk's layer computes,
# the next MoE layer's experts are read ahead into idle ring slots (`--lookahead N`), so
# the disk keeps working between two layers' reads (issue 14, item 4). Runs `generate
# --json` with lookahead off and on, interleaved (off, on, off, on, ...; each run a fresh
# process with a cold ring), on a `synth` vault with the ring at 1/4 of the expert bytes.
#
#   bash bench/lookahead_prefill.sh BIN [PRESET] [LAYERS] [PROMPT_TOKENS] [CHUNK] [ROUNDS] [LOOKAHEAD]
#
# Defaults: qwen3-30b-a3b, 8 layers (bf16: 9.7 GB of experts, so the 1/4 ring holds two
# layers' experts and has room beside a layer's union), 1024 prompt tokens (two chunks of
# 512), 2 rounds, lookahead 128 (a whole layer of Qwen3's 128 experts; idle slots bound
# it). Writes the vault to /tmp/lookahead-PRESET-LAYERS when missing ($ROUTING, default
# uniform, is passed to synth). Expert reads use O_DIRECT (the page cache holds none of
# them; `io` is printed). Per run: prefill tok/s, the streamer's busy share of the TTFT
# (time with at least one expert read in flight / TTFT), bytes read in prefill, lookahead
# bytes read / used / wasted and reads withdrawn unread; then the medians, and whether
# every run generated the same ids. As a cross-check of the busy share, the block
# device's io_ticks (/sys/class/block/DEV/stat, field 10: ms with I/O in flight, from any
# process: builds running beside the benchmark count too) around each run, over its TTFT.
# $OUT gets the JSON of every run.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,23p "$0" >&2; exit 2; }
bin=$(realpath "$1")
preset=${2:-qwen3-30b-a3b}
layers=${3:-8}
prompt=${4:-1024}
chunk=${5:-512}
rounds=${6:-2}
lookahead=${7:-128}
decode=4
out=${OUT:-/tmp/lookahead_prefill_out}
mkdir -p "$out"
vault=/tmp/lookahead-$preset-$layers
[ -d "$vault" ] || "$bin" synth --preset "$preset" --layers "$layers" --routing "${ROUTING:-uniform}" \
  --out "$vault" | tail -1
ring=$(python3 -c "
import json; m = json.load(open('$vault/manifest.json'))
print(sum(len(l['blobs']) * l['layout']['blob_stride'] for l in m['experts']['layers']) // 4)")
vocab=$(python3 -c "import json; print(json.load(open('$vault/manifest.json'))['model']['vocab_size'])")
ids=$(python3 -c "print(','.join(str((i*7919+13)%$vocab) for i in range($prompt)))")
dev=$(lsblk -no PKNAME "$(df --output=source "$vault" | tail -1)" 2>/dev/null | head -1)
[ -n "$dev" ] || dev=$(basename "$(df --output=source "$vault" | tail -1)")
ticks() { awk '{print $10}' "/sys/class/block/$dev/stat" 2>/dev/null || echo 0; }
echo "disk $dev; $preset --layers $layers, ring $((ring >> 20)) MiB (1/4 of the expert bytes), flags: ${EXTRA:-none (cpu backend)}, prompt $prompt," \
  "chunk $chunk, decode $decode, lookahead $lookahead, $rounds rounds (off/on interleaved), $(nproc) cores"
runs=()
for r in $(seq 1 "$rounds"); do
  for la in 0 "$lookahead"; do
    f="$out/r$r-la$la"
    t0=$(ticks)
    "$bin" generate --vault "$vault" --prompt-ids "$ids" --max-tokens "$decode" --ignore-eos --json \
      --prefill layer-major --chunk-size "$chunk" --max-context $((prompt + decode + 8)) \
      --ring-bytes "$ring" --lookahead "$la" ${EXTRA:-} >"$f.json" 2>"$f.err" || { cat "$f.err" >&2; exit 1; }
    echo $(($(ticks) - t0)) >"$f.ticks"
    runs+=("$f.json")
  done
done
python3 - "${runs[@]}" <<'PY'
import json, statistics, sys
rows = []
for path in sys.argv[1:]:
    o = json.load(open(path))
    s, io = o["stats"], o["stats"]["prefill_io"]
    ticks = int(open(path[:-5] + ".ticks").read())
    rows.append((s["lookahead"], s, io, o["token_ids"]))
    print(f"{path.rsplit('/', 1)[-1]:>16}: lookahead {s['lookahead']:>3}  prefill {s['prefill_tok_s']:7.1f} tok/s  "
          f"ttft {s['ttft_ms'] / 1e3:6.2f} s  disk busy {io['read_busy_share'] * 100:5.1f}% of it "
          f"({io['read_busy_ms'] / 1e3:.2f} s; device io_ticks {ticks / s['ttft_ms'] * 100:5.1f}%)  read {io['bytes_read'] / 1e9:5.2f} GB  "
          f"lookahead read {io['lookahead_bytes'] / 1e9:5.2f} GB, used {io['lookahead_used_bytes'] / 1e9:5.2f} GB, "
          f"wasted {io['lookahead_wasted_bytes'] / 1e9:5.2f} GB, withdrawn unread {io['lookahead_cancelled']}  "
          f"io {s['io']}")
for la in sorted({r[0] for r in rows}):
    sel = [r for r in rows if r[0] == la]
    med = lambda f: statistics.median(f(r) for r in sel)
    print(f"median, lookahead {la:>3}: prefill {med(lambda r: r[1]['prefill_tok_s']):.1f} tok/s, "
          f"disk busy {med(lambda r: r[2]['read_busy_share']) * 100:.1f}% of TTFT, "
          f"read {med(lambda r: r[2]['bytes_read']) / 1e9:.2f} GB, "
          f"lookahead used {med(lambda r: r[2]['lookahead_used_bytes']) / 1e9:.2f} GB / "
          f"wasted {med(lambda r: r[2]['lookahead_wasted_bytes']) / 1e9:.2f} GB")
same = all(r[3] == rows[0][3] for r in rows)
print(f"generated ids identical across all runs: {same}")
PY
