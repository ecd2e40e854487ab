#!/usr/bin/env bash
# Soak test of `smoe-pipeline serve`: starts the daemon on the built-in demo model (made
# in a private cache directory) with an 8-slot ring, so that experts stream from disk all
# the time, and runs bench/soak.py against it: CLIENTS clients sending random valid and
# invalid requests (bad JSON, bad parameters, oversize bodies, streaming and not) and
# disconnecting at random (while queued and mid-stream), while one expert blob of the
# vault is corrupted for 5 s of every 30 s (its checksum fails when read). Asserts that
# every request got a response or a clean error, that the queue / in-flight / read-queue
# gauges return to zero, that RSS grew by at most 256 MiB, that the log has no panic,
# and that the daemon then shuts down cleanly on SIGTERM (its log is kept in
# target/soak-serve.log).
#
#   bench/soak.sh [SECONDS] [CLIENTS]          (default: 600 s, 16 clients)
#
# The binary is $SMOE_BIN, default target/debug/smoe-pipeline (built here: debug
# assertions catch arithmetic overflows too). Prints the counts; exit status 1 on failure.
set -euo pipefail
secs=${1:-600}
clients=${2:-16}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${SMOE_BIN:-$root/target/debug/smoe-pipeline}
if [ -z "${SMOE_BIN:-}" ]; then
  (cd "$root" && CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1} cargo build --bin smoe-pipeline >&2)
fi
tmp=$(mktemp -d /tmp/smoe-soak.XXXXXX)
port=$((20000 + RANDOM % 20000))
log=$tmp/serve.log
cat >"$tmp/soak.toml" <<EOF
listen = "127.0.0.1:$port"
log_level = "info"
max_context = 512
ring_slots = 8
max_sessions = 4
max_queue = 8
max_body_bytes = "64KiB"
header_read_timeout = 10.0
body_read_timeout = 10.0
idle_timeout = 10.0

[sampling]
max_tokens = 32
EOF
pid=
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  cp "$log" "$root/target/soak-serve.log" 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
XDG_CACHE_HOME=$tmp/cache nice -n 5 "$bin" serve --config "$tmp/soak.toml" >"$log" 2>&1 &
pid=$!
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
  kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; exit 1; }
  sleep 1
done
vault=$(ls -d "$tmp"/cache/smoe-pipeline/demo/vault-*)
# The blob to corrupt: expert 3 of the second MoE layer, a byte in its first 4 KiB.
read -r file offset < <(python3 -c "
import json, sys
m = json.load(open('$vault/manifest.json'))
layer = m['experts']['layers'][1]
print('$vault/' + layer['file'], layer['blobs'][3]['offset'] + 1000)")
echo "daemon pid $pid on port $port, vault $vault; corrupting $file at byte $offset" >&2

status=0
python3 "$root/bench/soak.py" --port "$port" --pid "$pid" --clients "$clients" --seconds "$secs" \
  --max-body 65536 --fault-file "$file" --fault-offset "$offset" || status=1

if grep -n "panicked" "$log"; then
  echo "FAIL: the daemon log has a panic" && status=1
else
  echo "daemon log: no panic ($(grep -c 'ERROR' "$log" || true) ERROR lines, $(wc -l <"$log") lines)"
fi
kill -TERM "$pid"
t0=$(date +%s)
if wait "$pid"; then
  echo "SIGTERM: clean exit in $(($(date +%s) - t0)) s"
else
  echo "FAIL: the daemon exited with status $? on SIGTERM" && status=1
fi
pid=
exit $status
