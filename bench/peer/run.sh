#!/usr/bin/env bash
# Side-by-side harness against llama.cpp (issue 16, item 3). One trained-profile
# qwen3-30b-a3b synth checkpoint (HF format) is converted
#   - by llama.cpp (convert_hf_to_gguf.py via bench/peer/convert_hf.py) to a BF16 GGUF,
#     and by llama-quantize to Q4_K_M;
#   - by us (`convert --hf`) to a bf16 vault and a `--quant q4_k_m` vault;
# then bench/peer/measure.py runs both engines cold, with and without a memory cap at 1/4
# of the model, and writes bench/results/peer-DATE.txt and .csv.
#
# Usage: bench/peer/run.sh [--layers N] [--keep] [measure.py options: --allow-busy,
#        --readahead 128,8192, --prompts 64,512, --caps none,quarter, --max-load X ...]
# Needs root (drop_caches, cgroups, readahead) and bench/peer/build_llama.sh first.
# Artifacts go to $WORK (default /tmp/peer) and are reused when present; removed at the
# end unless --keep.
set -euo pipefail
cd "$(dirname "$0")/../.."

LLAMA_DIR=${LLAMA_DIR:-/work/llama}
WORK=${WORK:-/tmp/peer}
LAYERS=4
KEEP=0
PASS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --layers) LAYERS="$2"; shift 2 ;;
        --keep) KEEP=1; shift ;;
        *) PASS+=("$1"); shift ;;
    esac
done
DATE=$(date +%F)

export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1} CARGO_INCREMENTAL=0
cargo build --release --bin smoe-pipeline -p smoe-pipeline
BIN=${CARGO_TARGET_DIR:-target}/release/smoe-pipeline
COMPLETION=$LLAMA_DIR/build/bin/llama-completion
[[ -x $COMPLETION ]] || { echo "no $COMPLETION: run bench/peer/build_llama.sh" >&2; exit 1; }

mkdir -p "$WORK"
run() { echo "+ $*" >&2; "$@"; }
if [[ ! -f $WORK/bf16.gguf || ! -f $WORK/bf16.vault/manifest.json || ! -f $WORK/q4_k_m.vault/manifest.json ]]; then
    run $BIN synth --format hf --routing trained --preset qwen3-30b-a3b --layers "$LAYERS" \
        --tokenizer assets/demo --out "$WORK/hf" --force
    run python3 bench/peer/convert_hf.py "$LLAMA_DIR/llama.cpp" "$WORK/hf" --outtype bf16 \
        --outfile "$WORK/bf16.gguf"
    run $BIN convert --hf "$WORK/hf" --out "$WORK/bf16.vault" --force
    run $BIN convert --hf "$WORK/hf" --quant q4_k_m --out "$WORK/q4_k_m.vault" --force
    rm -rf "$WORK/hf"
fi
[[ -f $WORK/q4_k_m.gguf ]] ||
    run "$LLAMA_DIR/build/bin/llama-quantize" "$WORK/bf16.gguf" "$WORK/q4_k_m.gguf" Q4_K_M "$(nproc)" \
        > "$WORK/llama-quantize.log" 2>&1

VERSION=$("$COMPLETION" --version 2>&1 | grep -m1 version || true)
NOTE="smoe-pipeline $(git rev-parse --short HEAD); llama.cpp $(basename "$(readlink -f "$LLAMA_DIR/llama.cpp/../..")") ${VERSION}; model: synth --format hf --routing trained --preset qwen3-30b-a3b --layers $LAYERS --tokenizer assets/demo"
run python3 bench/peer/measure.py --bin "$BIN" --llama "$COMPLETION" \
    --tokenizer assets/demo/tokenizer.json \
    --pair bf16 "$WORK/bf16.vault" "$WORK/bf16.gguf" \
    --pair q4_k_m "$WORK/q4_k_m.vault" "$WORK/q4_k_m.gguf" \
    --note "$NOTE" --out "bench/results/peer-$DATE.txt" --csv "bench/results/peer-$DATE.csv" "${PASS[@]}"
[[ $KEEP == 1 ]] || rm -rf "$WORK"
