#!/usr/bin/env bash
# Our expert quantiser against llama.cpp's `llama-quantize` on the same weights (issue 12,
# item 3: every tensor's RMSE at most 1.02x llama.cpp's). One trained-profile
# qwen3-30b-a3b synth checkpoint (HF format) goes
#   - through llama.cpp: convert_hf_to_gguf.py --outtype bf16, then llama-quantize to
#     Q8_0, Q4_K, Q5_K, Q6_K (--pure: one type per tensor) and Q4_K_M, Q5_K_M (mixed),
#     each imported with `smoe-pipeline convert --gguf` (blocks kept byte for byte);
#   - through ours: `convert --hf` (bf16: the source) and `convert --hf --quant` q8_0,
#     q6_k, q4_k_m, q5_k_m;
# then `quant_rmse` compares every expert tensor stored in the same format by both.
#
# Usage: bench/peer/quant_rmse.sh [--layers N] [--out RESULT_FILE] [--keep]
# Needs bench/peer/build_llama.sh first. Scratch in $WORK (default /tmp/peer-rmse),
# removed at the end unless --keep.
set -euo pipefail
cd "$(dirname "$0")/../.."

LLAMA_DIR=${LLAMA_DIR:-/work/llama}
WORK=${WORK:-/tmp/peer-rmse}
LAYERS=2
OUT=bench/results/quant-rmse-$(date +%F).txt
KEEP=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --layers) LAYERS="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --keep) KEEP=1; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

export CARGO_BUILD_JOBS=1 CARGO_INCREMENTAL=0
cargo build --release --bin smoe-pipeline -p smoe-pipeline
cargo build --release -p smoe-bench --bin quant_rmse
BIN=target/release/smoe-pipeline
QUANTIZE=$LLAMA_DIR/build/bin/llama-quantize
[[ -x $QUANTIZE ]] || { echo "no $QUANTIZE: run bench/peer/build_llama.sh" >&2; exit 1; }
THREADS=$(nproc)

mkdir -p "$WORK"
run() { echo "+ $*" >&2; "$@"; }

# Each step is skipped when its output is there (a re-run reuses them).
have() { [[ -e $1 ]]; }
need_hf=0
for v in bf16.gguf src.vault/manifest.json ours-{q8_0,q6_k,q4_k_m,q5_k_m}.vault/manifest.json; do
    have "$WORK/$v" || need_hf=1
done
[[ $need_hf == 0 ]] || have "$WORK/hf/config.json" ||
    run $BIN synth --format hf --routing trained --preset qwen3-30b-a3b --layers "$LAYERS" \
        --tokenizer assets/demo --out "$WORK/hf" --force
have "$WORK/bf16.gguf" ||
    run python3 bench/peer/convert_hf.py "$LLAMA_DIR/llama.cpp" "$WORK/hf" --outtype bf16 \
        --outfile "$WORK/bf16.gguf"
have "$WORK/src.vault/manifest.json" || run $BIN convert --hf "$WORK/hf" --out "$WORK/src.vault" --force
for q in q8_0 q6_k q4_k_m q5_k_m; do
    have "$WORK/ours-$q.vault/manifest.json" ||
        run $BIN convert --hf "$WORK/hf" --quant $q --out "$WORK/ours-$q.vault" --force
done
# llama.cpp's quantisations, each imported as a vault, the GGUF removed after.
for t in Q8_0 Q4_K Q5_K Q6_K Q4_K_M Q5_K_M; do
    have "$WORK/llama-$t.vault/manifest.json" && continue
    pure=(--pure)
    [[ $t == *_M ]] && pure=()
    run "$QUANTIZE" "${pure[@]}" "$WORK/bf16.gguf" "$WORK/llama-$t.gguf" "$t" "$THREADS" \
        > "$WORK/llama-quantize-$t.log" 2>&1
    run $BIN convert --gguf "$WORK/llama-$t.gguf" --out "$WORK/llama-$t.vault" --force
    rm -f "$WORK/llama-$t.gguf"
done

set +e
{
    echo "# quant_rmse $(date -u +%FT%TZ): bench/peer/quant_rmse.sh --layers $LAYERS"
    echo "# checkpoint: smoe-pipeline synth --format hf --routing trained --preset qwen3-30b-a3b --layers $LAYERS --tokenizer assets/demo"
    echo "# llama.cpp: $(basename "$(readlink -f "$LLAMA_DIR/llama.cpp/../..")") ($("$LLAMA_DIR/build/bin/llama-completion" --version 2>&1 | grep -m1 version || true)), no importance matrix"
    echo "# pairs: ours q8_0/q6_k vs llama --pure Q8_0/Q6_K; ours q4_k_m vs llama --pure Q4_K and Q4_K_M;"
    echo "#        ours q5_k_m vs llama --pure Q5_K and Q5_K_M (tensors in different formats are listed, not compared)"
    target/release/quant_rmse "$WORK/src.vault" \
        q8_0 "$WORK/ours-q8_0.vault" "$WORK/llama-Q8_0.vault" \
        q6_k "$WORK/ours-q6_k.vault" "$WORK/llama-Q6_K.vault" \
        q4_k_m-vs-pure-Q4_K "$WORK/ours-q4_k_m.vault" "$WORK/llama-Q4_K.vault" \
        q4_k_m "$WORK/ours-q4_k_m.vault" "$WORK/llama-Q4_K_M.vault" \
        q5_k_m-vs-pure-Q5_K "$WORK/ours-q5_k_m.vault" "$WORK/llama-Q5_K.vault" \
        q5_k_m "$WORK/ours-q5_k_m.vault" "$WORK/llama-Q5_K_M.vault"
} 2>&1 | tee "$OUT"
rc=${PIPESTATUS[0]}
set -e
[[ $KEEP == 1 ]] || rm -rf "$WORK"
echo "wrote $OUT"
exit "$rc"
