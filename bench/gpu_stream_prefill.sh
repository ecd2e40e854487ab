#!/usr/bin/env bash
# Prefill with the experts streamed from disk on a GPU (issue 14, item 4): how busy the
# disk is while a layer-major prefill runs on the Vulkan backend with a ring of 1/4 of the
# expert bytes.
#
#   bash bench/gpu_stream_prefill.sh BIN [VAULT] [PROMPT_TOKENS] [CHUNK]
#
# Writes `synth --preset qwen3-30b-a3b --layers 3` to VAULT (default /tmp/q30) when missing.
# Runs `generate --max-tokens 1` twice per backend (the first run fills the driver's shader
# cache and is not reported), and samples the block device's io_ticks
# (/sys/class/block/DEV/stat, field 10: milliseconds with I/O in flight) around the second:
# the disk's busy share is Δio_ticks / wall. Expert blobs are read with O_DIRECT, so the
# page cache does not hide the disk. Loader: unpacks .gl/*.deb when present (see
# bench/vulkan_gpu.sh). Output to stdout and, when set, $OUT.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,14p "$0" >&2; exit 2; }
bin=$(realpath "$1")
vault=${2:-/tmp/q30}
prompt=${3:-512}
chunk=${4:-512}
out=${OUT:-/tmp/gpu_stream_out}
mkdir -p "$out"
. "$(dirname "$0")/gpu_env.sh"
gpu_env "$bin"
[ -d "$vault" ] || "$bin" synth --preset qwen3-30b-a3b --layers 3 --out "$vault" | tail -1
dev=$(lsblk -no PKNAME "$(df --output=source "$vault" | tail -1)" 2>/dev/null | head -1)
[ -n "$dev" ] || dev=$(basename "$(df --output=source "$vault" | tail -1)")
[ -r "/sys/class/block/$dev/stat" ] || { echo "no /sys/class/block/$dev/stat" >&2; exit 1; }
ring=$(python3 -c "
import json; m = json.load(open('$vault/manifest.json'))
print(sum(len(l['blobs']) * l['layout']['blob_stride'] for l in m['experts']['layers']) // 4)")
vocab=$(python3 -c "import json; print(json.load(open('$vault/manifest.json'))['model']['vocab_size'])")
ids=$(python3 -c "print(','.join(str((i*7919+13)%$vocab) for i in range($prompt)))")
ticks() { awk '{print $10}' "/sys/class/block/$dev/stat"; }
echo "disk $dev, ring $((ring >> 20)) MiB (1/4 of the expert bytes), prompt $prompt, chunk $chunk" | tee "$out/stream.txt"
for backend in vulkan cpu; do
  gen() {
    "$bin" generate --vault "$vault" --prompt-ids "$ids" --max-tokens 1 --json --backend "$backend" \
      --chunk-size "$chunk" --max-context $((prompt + 8)) --ring-bytes "$ring" "$@"
  }
  gen >/dev/null 2>&1
  t0=$(ticks); s0=$(date +%s.%N)
  gen >"$out/$backend.json" 2>"$out/$backend.err"
  s1=$(date +%s.%N); t1=$(ticks)
  python3 - "$out/$backend.json" "$backend" "$t0" "$t1" "$s0" "$s1" <<'PY' | tee -a "$out/stream.txt"
import json, sys
s = json.load(open(sys.argv[1]))["stats"]
t0, t1, s0, s1 = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
wall = s1 - s0
mb = s["prefill_bytes_read"] / 1e6
ttft = s["ttft_ms"] / 1e3
print(f"{sys.argv[2]}: prefill {s['prefill_tok_s']:.1f} tok/s (ttft {ttft:.2f} s), {mb:.0f} MB read "
      f"({mb / ttft:.0f} MB/s over the prefill), disk busy {t1 - t0} ms of the {wall:.2f} s process "
      f"({100 * (t1 - t0) / 1e3 / wall:.0f}%; {100 * (t1 - t0) / 1e3 / ttft:.0f}% of the prefill's time to "
      f"first token, where the blob reads happen)")
PY
done
