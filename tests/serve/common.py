"""Helpers for the serve tests: raw HTTP, metrics parsing, a tiny test runner."""

import json
import sys
import time
import traceback
import urllib.error
import urllib.request


def http(method, url, body=None, headers=None, timeout=30):
    """Sends one request; returns (status, headers, parsed JSON or text)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, dict(e.headers), e.read()
    text = raw.decode()
    try:
        return status, hdrs, json.loads(text)
    except ValueError:
        return status, hdrs, text


def metrics(base):
    """The daemon's /metrics as {'name{labels}': value}."""
    status, _, text = http("GET", base + "/metrics")
    assert status == 200, status
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def health(base):
    """GET /health as (status, body)."""
    status, _, body = http("GET", base + "/health")
    return status, body


def wait_until(what, predicate, limit=10.0, step=0.05):
    """Polls `predicate` until true; fails after `limit` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {limit}s waiting for {what}")


def run(tests):
    """Runs (name, fn) pairs in order; exits 1 if any failed."""
    failed = 0
    for name, fn in tests:
        t = time.monotonic()
        try:
            fn()
            print(f"ok   {name} ({time.monotonic() - t:.2f}s)")
        except Exception:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAIL {name}")
            traceback.print_exc()
        sys.stdout.flush()
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
