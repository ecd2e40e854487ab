"""A real Prometheus scrapes `smoe-pipeline serve`; after some traffic, every PromQL
expression of the Grafana dashboard must return data.

usage: test_prometheus.py BASE_URL PROMETHEUS_URL DASHBOARD_JSON
"""

import json
import math
import sys
import threading
import time
import urllib.parse

import openai

from common import http, metrics, run, wait_until

BASE, PROM, DASHBOARD = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=60)
MODEL = client.models.list().data[0].id


def query(expr):
    url = PROM + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    status, _, body = http("GET", url)
    assert status == 200 and body["status"] == "success", (expr, status, body)
    return body["data"]["result"]


def expressions():
    with open(DASHBOARD) as f:
        dash = json.load(f)
    for panel in dash["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"].replace("$__rate_interval", "1m")


def test_prometheus_scrapes_the_daemon():
    wait_until("Prometheus to be ready", lambda: http("GET", PROM + "/-/ready")[0] == 200, limit=60, step=0.5)
    wait_until("the daemon target to be up",
               lambda: [r for r in query("up") if r["value"][1] == "1"], limit=60, step=0.5)


def test_traffic():
    msgs = [{"role": "user", "content": "Hello world"}]
    for i in range(6):
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, seed=i, temperature=0.8)
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, stream=False)
        list(client.completions.create(model=MODEL, prompt=[3, 4, 5], max_tokens=8, stream=True))
    # A second turn (prefix reuse) and a refused request (status 400).
    client.chat.completions.create(model=MODEL, messages=msgs + [{"role": "assistant", "content": "Hi"},
                                                                  {"role": "user", "content": "More"}],
                                   max_tokens=8)
    try:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=-1)
    except openai.BadRequestError:
        pass
    # Concurrent requests, so queue gauges move.
    threads = [threading.Thread(target=lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=32))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    m = metrics(BASE)
    assert m["smoe_ring_evictions_total"] > 0 and m["smoe_read_bytes_total"] > 0, m
    # The engine publishes the ring's levels by itself: every one of the 6 slots shows in
    # a state, the experts of the last token retained (ready or consumed), nothing queued.
    states = ["empty", "loading", "ready", "consumed"]

    def settled():
        m = metrics(BASE)
        slots = {s: m[f'smoe_ring_slots{{state="{s}"}}'] for s in states}
        queued = [m[f'smoe_io_queue_depth{{queue="{q}"}}'] for q in ["demand", "speculative"]]
        return sum(slots.values()) == 6 and slots["ready"] + slots["consumed"] > 0 and queued == [0, 0]

    wait_until("the ring gauges to show the ring", settled, limit=10, step=0.2)
    # Let Prometheus scrape the counters after the traffic.
    time.sleep(4)


def test_every_dashboard_expression_returns_data():
    empty, nan_only = [], []
    checked = 0
    for title, expr in expressions():
        checked += 1
        result = query(expr)
        if not result:
            empty.append((title, expr))
            continue
        values = [float(r["value"][1]) for r in result]
        if all(math.isnan(v) for v in values):
            nan_only.append((title, expr))
        else:
            print(f"    {title}: {expr[:70]}... = {[round(v, 6) for v in values][:4]}")
    assert checked >= 20, checked
    assert not empty, f"expressions without data: {empty}"
    assert not nan_only, f"expressions with only NaN: {nan_only}"


def test_dashboard_and_provisioning_agree():
    with open(DASHBOARD) as f:
        dash = json.load(f)
    uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p["targets"]}
    prov = open(DASHBOARD.replace("dashboards/smoe-pipeline.json", "provisioning/datasources/smoe.yml")).read()
    assert uids == {"smoe-prometheus"} and "uid: smoe-prometheus" in prov, uids


run([(name, fn) for name, fn in list(globals().items()) if name.startswith("test_")])
