#!/usr/bin/env bash
# The Vulkan backend on a lent GPU machine (the `device` tool), in two steps.
#
#   bench/vulkan_gpu.sh pack DIR   (here) build the test binaries, the `vulkan` bench and
#                                  the release `smoe-pipeline`, strip and xz them into DIR
#                                  with this script (~15 MB: the tracked tree and DIR must
#                                  stay under the device tool's 64 MiB)
#   bash DIR/vulkan_gpu.sh run [quick]
#                                  (there) unpack the Vulkan loader from .gl/*.deb (see
#                                  the device README), run the kernel-identity and
#                                  fixture tests, verify, the bit-identity diagnosis, the
#                                  kernel statistics and benchmarks and the end-to-end
#                                  table; logs go to $OUT. `quick` runs the fixture tests
#                                  once instead of three times and skips the end-to-end
#                                  table
#
# The test binaries look for fixtures and the binary under the path of the checkout they
# were built in, so `run` recreates that path (the fixtures come from the copy of the
# checkout the device tool sends).
set -euo pipefail
case "${1:-}" in
pack)
  dir=$(realpath -m "$2")
  cd "$(dirname "$0")/.."
  cargo build --release --bin smoe-pipeline
  cargo build --release -p smoe-bench --bin vulkan
  mkdir -p "$dir"
  rm -f "$dir"/*.xz
  # A stripped, xz-compressed copy of binary $2 as $dir/$1.xz.
  pack_bin() { strip -o "$dir/$1" "$2" && xz -T0 "$dir/$1"; }
  cargo test --no-run --test vulkan_kernels --test vulkan_forward --message-format json 2>/dev/null |
    python3 -c 'import json,sys
for l in sys.stdin:
    try:
        j = json.loads(l)
    except ValueError:
        continue
    # Test targets only: the integration tests also build the (debug) smoe-pipeline.
    if j.get("reason") == "compiler-artifact" and j.get("executable") and "test" in j["target"]["kind"]:
        print(j["target"]["name"], j["executable"])' |
    while read -r name exe; do pack_bin "$name" "$exe"; done
  pack_bin smoe-pipeline target/release/smoe-pipeline
  pack_bin vulkan target/release/vulkan
  cp bench/vulkan_gpu.sh "$dir/"
  pwd > "$dir/checkout_path"
  du -sh "$dir"
  ;;
run)
  set +e
  G=$(realpath "$(dirname "$0")")
  for z in "$G"/*.xz; do xz -dc "$z" >"${z%.xz}" && chmod +x "${z%.xz}"; done
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  export XDG_RUNTIME_DIR=/tmp RUST_BACKTRACE=1
  src=$(cat "$G/checkout_path")
  mkdir -p "$src/target/debug" "$src/tests"
  [ "$(realpath tests)" = "$(realpath -m "$src/tests")" ] || cp -r tests/fixtures "$src/tests/"
  cp "$G/smoe-pipeline" "$src/target/debug/smoe-pipeline"
  if ! "$G/smoe-pipeline" devices >/dev/null 2>&1; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  fi
  "$G/smoe-pipeline" devices | tee "$OUT/devices.txt"
  D=$("$G/smoe-pipeline" devices --json | python3 -c "import json,sys; d=json.load(sys.stdin); print(next((x['index'] for x in d if x['usable'] and 'discrete' in x['kind']), 0))")
  # CI set: a test binary that finds no device fails instead of skipping
  # (tests/vulkan/mod.rs), so a missing loader cannot pass for a green run.
  export SMOE_VULKAN_DEVICE=$D CI=1
  cd "$src"
  timeout 60 "$G/vulkan_kernels" --test-threads 1 2>&1 | tee "$OUT/tests.log" | grep -E "test |result"
  reps=3; [ "${2:-}" = quick ] && reps=1
  for i in $(seq "$reps"); do
    timeout 60 "$G/vulkan_forward" --test-threads 1 --nocapture 2>&1 | tee -a "$OUT/tests.log" |
      grep -E "max \||test result|panicked|left|right"
  done
  for f in bf16_sharded dense0_gqa moe_all; do
    "$G/smoe-pipeline" convert --hf "tests/fixtures/$f" --out "/tmp/$f.vault" --force >/dev/null 2>&1
    echo "== diag $f"; timeout 60 "$G/vulkan" diag "/tmp/$f.vault" "$D" 2>&1 | tee -a "$OUT/diag.txt"
    echo "== verify $f"
    timeout 120 "$G/smoe-pipeline" verify --vault "/tmp/$f.vault" --backend vulkan --device "$D" 2>&1 | tail -3 | tee -a "$OUT/verify.txt"
  done
  timeout 60 "$G/vulkan" stats "$D" 32,2,2,2 2>&1 | tee "$OUT/stats.txt"
  timeout 240 "$G/vulkan" kernels "$D" 2>&1 | tee "$OUT/bench_kernels.txt"
  [ "${2:-}" = quick ] && exit 0
  timeout 60 "$G/smoe-pipeline" synth --preset qwen3-30b-a3b --layers 3 --out /tmp/q30 2>&1 | tail -1
  echo "== diag q30 (3 layers)"; timeout 120 "$G/vulkan" diag /tmp/q30 "$D" 2>&1 | tee -a "$OUT/diag.txt"
  timeout 90 "$G/vulkan" e2e /tmp/q30 256 32 64 128 "$D" resident 2>&1 | tee "$OUT/e2e.txt"
  for p in staged zero-copy; do
    timeout 60 "$G/vulkan" e2e /tmp/q30 256 32 64 128 "$D" resident $p 2>&1 | grep vulkan | tee -a "$OUT/e2e.txt"
  done
  for p in staged-prefill zero-copy; do
    timeout 60 "$G/vulkan" e2e /tmp/q30 512 8 256 128 "$D" resident $p 2>&1 | grep -E "vault|vulkan" | tee -a "$OUT/e2e.txt"
  done
  timeout 80 "$G/vulkan" e2e /tmp/q30 64 16 64 128 "$D" streamed 2>&1 | tee -a "$OUT/e2e.txt"
  ;;
*)
  echo "usage: $0 pack DIR | $0 run [quick]" >&2
  exit 2
  ;;
esac
