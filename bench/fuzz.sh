#!/usr/bin/env bash
# Fuzzes every parser of untrusted bytes (`smoe_pipeline::parsers`, targets in fuzz/) with
# cargo-fuzz (libFuzzer), each target for a fixed time at low priority, and prints one
# line per target: executions, corpus size, coverage, crashes. Not run in CI (CI runs the
# bounded property test tests/fuzz_parsers.rs).
#
#   bench/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default: 300 s, every target)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`); on a stable toolchain it runs with
# RUSTC_BOOTSTRAP=1 for the nightly flags cargo-fuzz passes. Built without a sanitizer
# (the parsers are safe Rust; what is looked for is panics, overflows — debug assertions
# are on — hangs over 10 s and allocations over 2 GiB), into target/fuzz. The corpus
# grows in fuzz/corpus/TARGET (seeded from the test fixtures), crashes land in
# fuzz/artifacts/TARGET; logs in target/fuzz/logs. Reproduce a crash with
#   (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run -s none -a --target-dir ../target/fuzz TARGET artifacts/TARGET/crash-...)
set -euo pipefail
secs=${1:-300}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(manifest config_toml request_body safetensors gguf)
root=$(cd "$(dirname "$0")/.." && pwd)
export RUSTC_BOOTSTRAP=1 CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1} CARGO_INCREMENTAL=0
tdir=$root/target/fuzz
fuzz=(-s none -a --target-dir "$tdir")
cd "$root/fuzz"
mkdir -p "$tdir/logs"
nice -n 10 cargo fuzz build "${fuzz[@]}" >&2

# Seeds: valid inputs of each parser.
seed() { mkdir -p "seeds/$1" && for f in "${@:2}"; do cp "$f" "seeds/$1/$(basename "$(dirname "$f")")-$(basename "$f")"; done; }
rm -rf seeds
fx=$root/tests/fixtures
seed manifest "$fx/manifest/moe_all.json"
seed config_toml "$root/smoe.toml"
seed gguf "$fx/gguf/tiny.gguf" "$fx/gguf_q8_0/model.gguf" "$fx/gguf_q4_k_m/model.gguf"
mkdir -p seeds/request_body seeds/safetensors
m=smoe-demo-tiny-random
printf '\001{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true,"stop":["x"],"temperature":0.5,"top_k":3}' $m >seeds/request_body/chat
printf '\000{"model":"%s","prompt":"Once upon","max_tokens":4,"seed":1,"top_p":0.9,"repetition_penalty":1.1}' $m >seeds/request_body/text
printf '\000{"model":"%s","prompt":[1,2,3],"max_tokens":2,"stream_options":{"include_usage":true},"stream":true}' $m >seeds/request_body/ids
python3 - seeds/safetensors/small <<'EOF'
import json, struct, sys
tensors = [("a.weight", "F32", [2, 3], 24), ("b.weight", "BF16", [4], 8), ("c", "F16", [1, 2], 4)]
header, data = {"__metadata__": {"format": "pt"}}, b""
for name, dtype, shape, n in tensors:
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + n]}
    data += bytes(range(n))
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
open(sys.argv[1], "wb").write(struct.pack("<Q", len(h)) + h + data)
EOF

printf '%-13s %8s %12s %10s %8s %8s %10s %8s\n' target seconds executions exec/s corpus cov features crashes
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  log=$tdir/logs/$t.log
  # A crash stops the run (exit status 1..); its input is in artifacts/$t.
  nice -n 10 cargo fuzz run "${fuzz[@]}" "$t" "corpus/$t" "seeds/$t" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=1048576 -print_final_stats=1 \
    >"$log" 2>&1 || true
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corpus=$(find "corpus/$t" -type f | wc -l)
  crashes=$(find "artifacts/$t" -type f 2>/dev/null | wc -l)
  printf '%-13s %8s %12s %10s %8s %8s %10s %8s\n' "$t" "$secs" "${execs:-?}" "${rate:-?}" "$corpus" "${cov:-?}" "${ft:-?}" "$crashes"
  if [ "$crashes" -gt 0 ]; then
    find "artifacts/$t" -type f | sed 's/^/    /'
    grep -m1 -E 'panicked at|ERROR: libFuzzer' "$log" | sed 's/^/    /' || true
  fi
done
