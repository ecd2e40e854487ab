#!/usr/bin/env python3
"""Soak driver for `smoe-pipeline serve` (run by bench/soak.sh, which starts the daemon).

N client threads send random requests for a fixed time: valid ones (chat and completions,
text and token-id prompts, streaming and not), invalid ones (bad JSON, bad parameters,
an unknown model, oversize bodies, prompts over the context), and disconnect at random
(right after sending, i.e. while queued, and mid-stream). Meanwhile one expert blob of the
vault is corrupted for a few seconds at a time (its checksum fails when the daemon reads
it) and restored. Afterwards it checks that every request that was not abandoned on
purpose got an HTTP response or a clean error (JSON error bodies, streams that end in
`data: [DONE]`), that valid requests failed only while the blob was corrupt (+2 s), that
the queue, in-flight and read-queue gauges of /metrics return to zero, that the daemon's
RSS stayed within the bound, and that /health still answers.
Prints the counts; exits 1 when an assertion fails.
"""

import argparse
import collections
import http.client
import json
import os
import random
import re
import socket
import sys
import threading
import time

LOCK = threading.Lock()
COUNTS = collections.Counter()
FAILURES = []
# (start, end) of each time the blob was corrupt, and of each valid request that failed.
WINDOWS = []
FAILED = []
# How long after a fault window a failure still counts as the fault's (requests in flight).
GRACE = 2.0
START = 0.0


def count(key, failure=None):
    with LOCK:
        COUNTS[key] += 1
        if failure is not None and len(FAILURES) < 50:
            FAILURES.append(f"{key}: {failure}")


def connect(args, timeout=120):
    return http.client.HTTPConnection(args.host, args.port, timeout=timeout)


def get(args, path):
    c = connect(args, timeout=30)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        c.close()


def metrics(args):
    """Gauges and counters of /metrics: {name{labels}: value}."""
    _, text = get(args, "/metrics")
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Kind:
    """What a request is, and what answers are clean for it."""

    VALID = "valid"  # 200, or 429/503 (busy), or 500 (the read fault) with a JSON error
    INVALID = "invalid"  # a 4xx with an OpenAI-style JSON error


def valid_body(model, rng):
    chat = rng.random() < 0.5
    body = {"model": model, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.7, 1.0])}
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 1000)
    if chat:
        words = " ".join(rng.choice(["hello", "tell", "me", "a", "story", "about", "rust"]) for _ in range(rng.randint(1, 30)))
        body["messages"] = [{"role": "user", "content": words}]
    elif rng.random() < 0.5:
        body["prompt"] = "Once upon a time " * rng.randint(1, 20)
    else:
        body["prompt"] = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def invalid_body(model, rng, max_body):
    path, body = valid_body(model, rng)
    choice = rng.randrange(9)
    if choice == 0:
        return path, json.dumps(body)[: rng.randint(1, 20)].encode(), "bad json"
    if choice == 1:
        body["temperature"] = -1
    elif choice == 2:
        body["top_k"] = -5
    elif choice == 3:
        body["frobnicate"] = True
    elif choice == 4:
        body["model"] = "no-such-model"
    elif choice == 5:
        body["n"] = 3
    elif choice == 6:
        body["max_tokens"] = 10**7
    elif choice == 7:
        return path, b'{"model": "' + b"x" * (max_body + 1024) + b'"}', "oversize"
    else:
        body["prompt"] = [10**9]
        body.pop("messages", None)
        path = "/v1/completions"
    return path, json.dumps(body).encode(), f"bad param {choice}"


LOCAL_PATH = re.compile(r"(^|[\s'\"(])/(tmp|home|root|work|var|usr|etc|dev)/")


def is_error_json(text):
    """An OpenAI-style error object whose message names no server file."""
    try:
        e = json.loads(text)["error"]
        return isinstance(e.get("message"), str) and not LOCAL_PATH.search(e["message"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def read_stream(r, abandon_after):
    """Reads SSE events; returns ('done'|'error'|'abandoned'|'cut'|'badjson', the error event
    or the number of events)."""
    events = 0
    buf = b""
    while True:
        line = r.readline()
        if not line:
            return "cut", events
        buf += line
        if line.startswith(b"data: "):
            data = line[6:].strip()
            if data == b"[DONE]":
                return "done", events
            events += 1
            try:
                ev = json.loads(data)
            except ValueError:
                return "badjson", events
            if "error" in ev:
                # The stream must still end with [DONE].
                rest = r.read().decode("utf-8", "replace")
                clean = "[DONE]" in rest and is_error_json(json.dumps(ev))
                return ("error" if clean else "cut"), ev
            if abandon_after is not None and events >= abandon_after:
                return "abandoned", events


def one_request(args, model, rng):
    t0 = time.time()
    kind = rng.random()
    if kind < 0.08:
        status, text = get(args, rng.choice(["/health", "/v1/models"]))
        count("get ok" if status == 200 else "get bad", None if status == 200 else f"{status} {text[:200]}")
        return
    if kind < 0.38:
        path, raw, what = invalid_body(model, rng, args.max_body)
        expect = Kind.INVALID
    else:
        path, body = valid_body(model, rng)
        stream = rng.random() < 0.5
        if stream:
            body["stream"] = True
        raw, what, expect = json.dumps(body).encode(), ("stream" if stream else "whole"), Kind.VALID
    stream = b'"stream": true' in raw
    disconnect = rng.random()
    c = connect(args)
    try:
        try:
            c.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError) as e:
            # The daemon may answer an oversize body early and close.
            if what == "oversize":
                count("oversize closed early")
                return
            count("send failed", f"{what}: {e!r}")
            return
        if expect == Kind.VALID and disconnect < 0.12:
            # Gone while queued (or prefilling): close before the answer.
            time.sleep(rng.random() * 0.2)
            count("disconnect queued")
            return
        r = c.getresponse()
        if expect == Kind.INVALID:
            text = r.read().decode("utf-8", "replace")
            ok = 400 <= r.status < 500 and is_error_json(text)
            count(f"invalid -> {r.status}" if ok else "invalid unclean", None if ok else f"{what}: {r.status} {text[:200]}")
            return
        if r.status == 429:
            r.read()
            count("valid -> 429")
            # Back off as a client honouring Retry-After would (shortened, to keep load up).
            time.sleep(rng.uniform(0.05, 0.5))
            return
        if r.status != 200:
            text = r.read().decode("utf-8", "replace")
            ok = r.status in (429, 500, 503) and is_error_json(text)
            count(f"valid -> {r.status}" if ok else "valid unclean", None if ok else f"{what}: {r.status} {text[:200]}")
            if r.status == 500:
                with LOCK:
                    FAILED.append((t0, time.time(), text[:200]))
            return
        if stream:
            abandon = rng.randint(1, 4) if disconnect < 0.25 else None
            end, ev = read_stream(r, abandon)
            if end == "abandoned":
                count("disconnect mid-stream")
            elif end in ("done", "error"):
                count(f"stream {end}")
                if end == "error":
                    with LOCK:
                        FAILED.append((t0, time.time(), f"stream error event {json.dumps(ev)[:200]}"))
            else:
                count("stream unclean", f"{what}: {end}")
        else:
            text = r.read().decode("utf-8", "replace")
            try:
                json.loads(text)["choices"][0]
                count("whole ok")
            except (ValueError, KeyError, IndexError, TypeError):
                count("whole unclean", text[:200])
    except (socket.timeout, TimeoutError) as e:
        count("no answer (timeout)", f"{what}: {e!r}")
    except (ConnectionError, http.client.HTTPException) as e:
        count("no answer (connection)", f"{what}: {e!r}")
    finally:
        c.close()


def client(args, model, seed, deadline):
    rng = random.Random(seed)
    while time.time() < deadline:
        one_request(args, model, rng)


def fault_injector(args, deadline, stop):
    """Corrupts one byte of the chosen blob for `fault_on` s every `fault_every` s."""
    with open(args.fault_file, "r+b") as f:
        f.seek(args.fault_offset)
        good = f.read(1)
        bad = bytes([good[0] ^ 0x5A])
        while time.time() < deadline and not stop.is_set():
            stop.wait(args.fault_every - args.fault_on)
            if stop.is_set() or time.time() >= deadline:
                break
            # The window opens before the write (reads may see the byte from then on).
            start = time.time()
            f.seek(args.fault_offset)
            f.write(bad)
            f.flush()
            os.fsync(f.fileno())
            count("fault windows")
            stop.wait(args.fault_on)
            f.seek(args.fault_offset)
            f.write(good)
            f.flush()
            os.fsync(f.fileno())
            with LOCK:
                WINDOWS.append((start, time.time()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--pid", type=int, required=True, help="the daemon's pid (for RSS)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--max-body", type=int, required=True, help="the daemon's max_body_bytes")
    ap.add_argument("--rss-growth-mib", type=float, default=256, help="RSS may grow this much over its start")
    ap.add_argument("--fault-file", required=True)
    ap.add_argument("--fault-offset", type=int, required=True)
    ap.add_argument("--fault-every", type=float, default=30)
    ap.add_argument("--fault-on", type=float, default=5)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    model = json.loads(get(args, "/v1/models")[1])["data"][0]["id"]
    start_rss = rss_kib(args.pid)
    bound_mib = start_rss / 1024 + args.rss_growth_mib
    global START
    START = time.time()
    deadline = START + args.seconds
    stop = threading.Event()
    threads = [threading.Thread(target=client, args=(args, model, args.seed * 1000 + i, deadline)) for i in range(args.clients)]
    threads.append(threading.Thread(target=fault_injector, args=(args, deadline, stop)))
    for t in threads:
        t.start()
    peak = start_rss
    while any(t.is_alive() for t in threads[:-1]):
        peak = max(peak, rss_kib(args.pid))
        time.sleep(1)
    stop.set()
    for t in threads:
        t.join()

    # Quiescence: every gauge of work in progress back to zero.
    gauges = re.compile(r"^(smoe_queue_length|smoe_active_requests|smoe_io_queue_depth|smoe_ring_slots\{state=\"loading\"\})")
    busy = {}
    for _ in range(60):
        m = metrics(args)
        busy = {k: v for k, v in m.items() if gauges.match(k) and v != 0}
        if not busy:
            break
        time.sleep(1)
    end_rss = rss_kib(args.pid)
    peak = max(peak, end_rss)
    health = get(args, "/health")[0]
    m = metrics(args)

    total = sum(v for k, v in COUNTS.items() if k != "fault windows")
    outside = [f for f in FAILED if not any(f[0] <= we + GRACE and f[1] >= ws for ws, we in WINDOWS)]
    unclean = {k: v for k, v in COUNTS.items() if "unclean" in k or "no answer" in k or k in ("send failed", "get bad")}
    print(f"clients {args.clients}, {args.seconds:.0f} s, {total} requests")
    for k in sorted(COUNTS):
        print(f"  {k:28s} {COUNTS[k]}")
    print(f"read errors (smoe_read_errors_total): {m.get('smoe_read_errors_total', 0):.0f}")
    print(f"tokens: prefill {m.get('smoe_prefill_tokens_total', 0):.0f}, decode {m.get('smoe_decode_tokens_total', 0):.0f}")
    reqs = {k: v for k, v in m.items() if k.startswith("smoe_requests_total")}
    for k in sorted(reqs):
        print(f"  {k} {reqs[k]:.0f}")
    print(f"RSS: start {start_rss / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB, end {end_rss / 1024:.0f} MiB (bound {bound_mib:.0f} MiB)")
    print(f"failed valid requests: {len(FAILED)}, of which outside the fault windows (+{GRACE:.0f} s): {len(outside)}")
    print(f"gauges after the run: {'all zero' if not busy else busy}; /health {health}")
    ok = True
    for what, bad in [
        ("requests without a response or a clean error", unclean),
        ("gauges not back to zero", busy),
        ("RSS over the bound", peak / 1024 > bound_mib),
        ("/health not 200 after the run", health != 200),
        ("no read fault was hit", m.get("smoe_read_errors_total", 0) == 0),
        ("valid requests failed outside the fault windows", [
            (f"{f[0] - max((we for _, we in WINDOWS if we <= f[0]), default=START):.1f} s after a window or the start", f[2])
            for f in outside[:5]
        ]),
    ]:
        if bad:
            ok = False
            print(f"FAIL: {what}: {bad}")
    for f in FAILURES:
        print("  ", f)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
