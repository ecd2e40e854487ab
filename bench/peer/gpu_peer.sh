#!/usr/bin/env bash
# llama.cpp (CUDA) beside smoe-pipeline (Vulkan) on a lent GPU machine (the `device` tool),
# resident, on the same weights, in two steps:
#
#   bench/peer/gpu_peer.sh pack DIR   (here) the llama-cpp-python sdist's vendored llama.cpp
#                                     (downloaded by build_llama.sh into $LLAMA_DIR, default
#                                     /work/llama) without its docs, models, tests and
#                                     non-CUDA backends, the release `smoe-pipeline`, and
#                                     this script, xz-compressed into DIR (~10 MB)
#   bash DIR/gpu_peer.sh run          (there, from the checkout) build llama-bench and
#                                     llama-quantize for CUDA (sm_90, ~4.5 min on 16
#                                     cores) while `synth --format hf --preset qwen3-30b-a3b
#                                     --layers 3 --tokenizer assets/demo` is written and
#                                     converted by llama.cpp's convert_hf_to_gguf.py to a
#                                     BF16 GGUF and by llama-quantize to Q4_K_M; then
#                                     `llama-bench -ngl 99 -fa 1 -p 512 -n 256 -d 0,512`
#                                     on both GGUFs, and our `generate` on the same
#                                     weights (`convert --gguf` of llama.cpp's Q4_K_M file,
#                                     `convert --hf` of the checkpoint), resident with the
#                                     VRAM tier holding every expert, a 512-token prompt and
#                                     256 greedy tokens, three runs each. Logs go to $OUT.
#
# The device needs CUDA (nvcc), CMake, Ninja and a Python with torch, transformers and
# numpy (the lent H200 has them); llama.cpp's own gguf-py comes with its source.
set -euo pipefail
case "${1:-}" in
pack)
  dir=$(realpath -m "$2")
  here=$(cd "$(dirname "$0")/../.." && pwd)
  src=$(ls -d "${LLAMA_DIR:-/work/llama}"/src/llama_cpp_python-*/vendor/llama.cpp | sort -V | tail -1)
  mkdir -p "$dir"
  tmp=$(mktemp -d)
  cp -a "$src" "$tmp/llama.cpp"
  (cd "$tmp/llama.cpp" && rm -rf .git docs models/*.gguf* media benches examples/* pocs skills tools/ui \
    tools/server/public* && for b in cann hexagon metal musa opencl openvino sycl virtgpu vulkan webgpu \
    zdnn zendnn et hip blas rpc; do rm -rf "ggml/src/ggml-$b"; done)
  tar -C "$tmp" -cf - llama.cpp | xz -T0 -6 >"$dir/llama.tar.xz"
  rm -rf "$tmp"
  (cd "$here" && cargo build --release --bin smoe-pipeline)
  strip -o "$dir/smoe-pipeline" "$here/target/release/smoe-pipeline"
  rm -f "$dir/smoe-pipeline.xz"
  xz -T0 "$dir/smoe-pipeline"
  cp "$0" "$dir/"
  du -sh "$dir"
  ;;
run)
  G=$(realpath "$(dirname "$0")")
  out=${OUT:-/tmp/gpu_peer_out}
  W=/tmp/gpu_peer
  mkdir -p "$W" "$out"
  T0=$(date +%s)
  say() { echo "[$(($(date +%s) - T0)) s] $*"; }
  [ -d "$W/llama.cpp" ] || tar -C "$W" -xJf "$G/llama.tar.xz"
  LL=$W/llama.cpp
  if [ ! -x "$W/cuda/bin/llama-bench" ]; then
    (cmake -S "$LL" -B "$W/cuda" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
      -DBUILD_SHARED_LIBS=OFF >"$out/cuda-configure.log" 2>&1 &&
      cmake --build "$W/cuda" -j "$(nproc)" --target llama-bench llama-quantize >"$out/cuda-build.log" 2>&1) &
    build=$!
  fi
  xz -dc "$G/smoe-pipeline.xz" >"$G/smoe-pipeline"
  chmod +x "$G/smoe-pipeline"
  bin=$G/smoe-pipeline
  . bench/gpu_env.sh
  gpu_env "$bin"
  [ -f "$W/hf/config.json" ] || { say synth; "$bin" synth --format hf --preset qwen3-30b-a3b --layers 3 \
    --tokenizer assets/demo --out "$W/hf" | tail -1; }
  [ -f "$W/bf16.gguf" ] || { say "llama.cpp convert"; python3 bench/peer/convert_hf.py "$LL" "$W/hf" \
    --outtype bf16 --outfile "$W/bf16.gguf" >"$out/convert.log" 2>&1; }
  [ -d "$W/vb" ] || "$bin" convert --hf "$W/hf" --out "$W/vb" | tail -1
  if [ -n "${build:-}" ]; then
    say "waiting for the CUDA build"
    wait "$build" || { tail -20 "$out/cuda-configure.log" "$out/cuda-build.log"; exit 1; }
  fi
  [ -f "$W/q4_k_m.gguf" ] || "$W/cuda/bin/llama-quantize" "$W/bf16.gguf" "$W/q4_k_m.gguf" Q4_K_M "$(nproc)" \
    >"$out/quantize.log" 2>&1
  [ -d "$W/vq" ] || "$bin" convert --gguf "$W/q4_k_m.gguf" --out "$W/vq" | tail -1
  say "llama-bench"
  for m in q4_k_m bf16; do
    "$W/cuda/bin/llama-bench" -m "$W/$m.gguf" -ngl 99 -fa 1 -p 512 -n 256 -d 0,512 -r 3 -o md 2>&1 |
      grep '^|' | tee -a "$out/llama-bench.md"
  done
  say "smoe-pipeline"
  for v in vq vb; do
    ln -sfn "$W/$v" "/tmp/peer-$v"
    resident_q30 "$bin" "peer-$v"
    for run in 1 2 3; do
      "$bin" generate "${flags[@]}" --json >"$out/$v-$run.json" 2>"$out/$v-$run.err"
      python3 -c "import json; s=json.load(open('$out/$v-$run.json'))['stats']; print('$v run $run: decode', round(s['decode_tok_s'], 1), 'tok/s, prefill', round(s['prefill_tok_s']), 'tok/s')"
    done
  done
  say done
  ;;
*)
  sed -n 2,24p "$0" >&2
  exit 2
  ;;
esac
