#!/usr/bin/env bash
# Start-up time against ring size: two smoe-pipeline builds in the same run, alternating.
# Each round starts `serve` on VAULT with RING_BYTES of ring, times launch → /health answering
# (the daemon is ready), reads the process's pinned and resident memory then, and times one
# 1-token completion (the first request pays the page faults the start-up no longer does).
#
#   bench/startup_ring.sh A_BIN B_BIN VAULT RING_BYTES [ROUNDS] [PORT]
#
# Example (results/startup-ring-2026-11-30.txt):
#   bench/startup_ring.sh /tmp/smoe-old target/release/smoe-pipeline /tmp/q30.vault 4GiB 3
set -euo pipefail
[ $# -ge 4 ] || { sed -n 2,10p "$0" >&2; exit 2; }
a=$1 b=$2 vault=$3 ring=$4 rounds=${5:-3} port=${6:-18931}
url="http://127.0.0.1:$port"
echo "# vault $vault, ring $ring, io_uring, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
if curl -sf "$url/health" >/dev/null 2>&1; then echo "something already answers on $url" >&2; exit 1; fi
trap 'kill "${pid:-}" 2>/dev/null || true' EXIT
for round in $(seq "$rounds"); do
  for side in "A:$a" "B:$b"; do
    bin=${side#*:}
    t0=$(date +%s.%N)
    "$bin" serve --vault "$vault" --ring-bytes "$ring" --io io-uring --listen "127.0.0.1:$port" \
      --log-level warn >/tmp/startup_ring.log 2>&1 &
    pid=$!
    until curl -sf "$url/health" >/dev/null 2>&1; do
      kill -0 "$pid" 2>/dev/null || { echo "serve exited:"; cat /tmp/startup_ring.log; exit 1; }
      sleep 0.02
    done
    t1=$(date +%s.%N)
    pinned=$(awk '/VmPin/{print $2}' "/proc/$pid/status")
    rss=$(awk '/VmRSS/{print $2}' "/proc/$pid/status")
    model=$(curl -sf "$url/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    curl -sf "$url/v1/completions" -H 'content-type: application/json' \
      -d "{\"model\":\"$model\",\"prompt\":\"Hello\",\"max_tokens\":1}" >/dev/null
    t2=$(date +%s.%N)
    pinned_after=$(awk '/VmPin/{print $2}' "/proc/$pid/status")
    kill "$pid"; wait "$pid" 2>/dev/null || true
    python3 -c "print('round $round ${side%%:*} ready_s=%.2f first_request_s=%.2f pinned_MiB=%.0f rss_MiB=%.0f pinned_after_request_MiB=%.0f' % ($t1-$t0, $t2-$t1, ${pinned:-0}/1024, ${rss:-0}/1024, ${pinned_after:-0}/1024))"
  done
done
