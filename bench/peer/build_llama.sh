#!/usr/bin/env bash
# Build llama.cpp (CPU only, Release) from the llama-cpp-python sdist on PyPI into $LLAMA_DIR
# (default /work/llama, outside the repo), single job and niced so the host stays usable.
# Prints the binaries it built and the vendored llama.cpp version.
#
# Usage: bench/peer/build_llama.sh [--jobs N]
set -euo pipefail

LLAMA_DIR=${LLAMA_DIR:-/work/llama}
JOBS=1
while [[ $# -gt 0 ]]; do
    case "$1" in
        --jobs) JOBS="$2"; shift 2 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

mkdir -p "$LLAMA_DIR/dl"
cd "$LLAMA_DIR"

command -v cmake >/dev/null || { echo "cmake is missing: apt-get install -y cmake" >&2; exit 1; }
if ! ls dl/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    # Only llama-cpp-python from source: with `--no-binary :all:` pip also builds the sdist's
    # build requirements from source to prepare its metadata (cmake itself, ~20 min).
    pip download --no-binary llama-cpp-python --no-deps -d dl llama-cpp-python
fi
SDIST=$(ls dl/llama_cpp_python-*.tar.gz | sort -V | tail -1)
SRC_ROOT="$LLAMA_DIR/src/$(basename "$SDIST" .tar.gz)"
if [[ ! -d "$SRC_ROOT" ]]; then
    mkdir -p "$LLAMA_DIR/src"
    tar -xzf "$SDIST" -C "$LLAMA_DIR/src"
fi
SRC="$SRC_ROOT/vendor/llama.cpp"
[[ -f "$SRC/CMakeLists.txt" ]] || { echo "no vendored llama.cpp under $SRC" >&2; exit 1; }
ln -sfn "$SRC" "$LLAMA_DIR/llama.cpp"

nice -n 19 cmake -S "$SRC" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
# Those the configured tree knows (llama-cli needs LLAMA_BUILD_SERVER in newer trees,
# where llama-completion is the plain prompt-in, tokens-out tool).
KNOWN=$(cmake --build "$LLAMA_DIR/build" --target help)
TARGETS=()
for t in llama-quantize llama-completion llama-cli llama-bench; do
    grep -qw -- "$t" <<<"$KNOWN" && TARGETS+=("$t")
done
nice -n 19 cmake --build "$LLAMA_DIR/build" --config Release -j "$JOBS" --target "${TARGETS[@]}"

echo "== sdist: $(basename "$SDIST")"
echo "== llama.cpp version:"
"$LLAMA_DIR/build/bin/${TARGETS[1]:-llama-quantize}" --version 2>&1 | tail -2 || true
echo "== binaries:"
for t in "${TARGETS[@]}"; do ls -l "$LLAMA_DIR/build/bin/$t" 2>/dev/null || echo "missing: $t"; done
