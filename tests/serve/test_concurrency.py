"""Concurrency, cancellation and memory checks of `smoe-pipeline serve`.

usage: test_concurrency.py BASE_URL DAEMON_PID MAX_QUEUE
"""

import sys
import threading
import time

import openai

from common import health, metrics, run, wait_until

BASE, PID, MAX_QUEUE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)
MODEL = client.models.list().data[0].id
CLIENTS = 8


def rss_mib():
    with open(f"/proc/{PID}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def burst(n, max_tokens):
    """n clients at once; returns (completed, refused, retry_after values)."""
    start = threading.Barrier(n)
    results = [None] * n

    def one(i):
        start.wait()
        try:
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"client {i} says hello"}],
                max_tokens=max_tokens, temperature=0.7, seed=i, extra_body={"ignore_eos": True})
            results[i] = ("ok", r.usage.completion_tokens)
        except openai.RateLimitError as e:
            results[i] = ("429", e.response.headers.get("retry-after"))
        except Exception as e:  # noqa: BLE001 - recorded and failed below
            results[i] = ("error", repr(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a client hung"
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors
    done = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "429"]
    assert all(tokens == max_tokens for _, tokens in done), done
    return done, refused


def test_n_clients_complete_or_get_429():
    done, refused = burst(CLIENTS, 600)
    print(f"    {len(done)} completed, {len(refused)} got 429 (max_queue {MAX_QUEUE})")
    assert len(done) + len(refused) == CLIENTS
    # One runs and MAX_QUEUE wait; the rest arrive while the first is still running.
    assert len(done) >= 1 and len(refused) >= 1, (len(done), len(refused))
    assert all(r is not None and int(r) >= 1 for _, r in refused), refused
    wait_until("an idle scheduler", lambda: health(BASE)[1]["running"] == 0 and health(BASE)[1]["queued"] == 0)


def test_client_disconnect_cancels_generation():
    before = metrics(BASE)["smoe_decode_tokens_total"]
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4000, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    wait_until("the cancelled job to stop", lambda: health(BASE)[1]["running"] == 0)
    generated = metrics(BASE)["smoe_decode_tokens_total"] - before
    print(f"    generated {generated:.0f} of 4000 tokens before the disconnect stopped it")
    assert generated < 2000, generated
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_memory_stays_bounded():
    burst(CLIENTS, 64)
    warm = rss_mib()
    for _ in range(3):
        burst(CLIENTS, 64)
    grown = rss_mib() - warm
    print(f"    RSS {warm:.0f} MiB after the first burst, {grown:+.1f} MiB after three more")
    assert grown < 48, grown


run([(name, fn) for name, fn in list(globals().items()) if name.startswith("test_")])
