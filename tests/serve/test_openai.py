"""End-to-end checks of `smoe-pipeline serve` with the real `openai` client.

usage: test_openai.py BASE_URL API_KEY
"""

import sys

import openai

from common import health, http, metrics, run

BASE, KEY = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=60)
MODEL = client.models.list().data[0].id
CONTEXT = client.models.retrieve(MODEL).model_extra["max_model_len"]
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
GREEDY = {"model": MODEL, "temperature": 0}


def chat(messages, **kw):
    return client.chat.completions.create(messages=messages, **{**GREEDY, **kw})


def complete(prompt, **kw):
    return client.completions.create(prompt=prompt, **{**GREEDY, **kw})


def still_serving():
    status, body = health(BASE)
    assert status == 200 and body["status"] == "ok", (status, body)
    r = complete("Hello", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_models():
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids
    assert CONTEXT > 0


def test_chat_non_streaming():
    r = chat([{"role": "user", "content": "Hello world"}], max_tokens=12)
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    u = r.usage
    assert u.prompt_tokens > 0 and 1 <= u.completion_tokens <= 12, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming():
    msgs = [{"role": "user", "content": "Tell me about experts"}]
    whole = chat(msgs, max_tokens=16, extra_body={"ignore_eos": True})
    chunks = list(chat(msgs, max_tokens=16, stream=True, stream_options={"include_usage": True},
                       extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == whole.choices[0].message.content, (text, whole.choices[0].message.content)
    assert finishes == ["length"], finishes
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_completions_text_ids_and_stream():
    r = complete("Hello world", max_tokens=8, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    ids = complete([5, 17, 42, 99, 7], max_tokens=4)
    assert ids.usage.prompt_tokens == 5, ids.usage
    streamed = "".join(ch.choices[0].text for ch in complete("Hello world", max_tokens=8, stream=True,
                                                             extra_body={"ignore_eos": True}))
    assert streamed == r.choices[0].text, (streamed, r.choices[0].text)


def test_two_turn_conversation_reuses_turn_one():
    turn1 = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Hello world, tell me a story about routers"}]
    r1 = chat(turn1, max_tokens=16)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
    before = metrics(BASE)
    r2 = chat(turn2, max_tokens=8)
    after = metrics(BASE)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    prefilled = after["smoe_prefill_tokens_total"] - before["smoe_prefill_tokens_total"]
    print(f"    turn 1: {r1.usage.prompt_tokens} prompt tokens; turn 2: {r2.usage.prompt_tokens} prompt tokens, "
          f"{cached} cached, {prefilled:.0f} prefilled")
    assert cached >= r1.usage.prompt_tokens, (cached, r1.usage.prompt_tokens)
    assert prefilled == r2.usage.prompt_tokens - cached, (prefilled, r2.usage.prompt_tokens, cached)
    assert after["smoe_cached_prompt_tokens_total"] - before["smoe_cached_prompt_tokens_total"] == cached


def test_stop_strings():
    base = complete("Once upon a time", max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    middle = len(base) // 2
    stop = base[middle:middle + 2]
    assert len(stop) == 2 and stop.strip(), repr(base)
    expected = base[:base.index(stop)]
    for stops in (stop, ["never-generated-zzz", stop]):
        r = complete("Once upon a time", max_tokens=24, stop=stops, extra_body={"ignore_eos": True})
        assert r.choices[0].text == expected, (r.choices[0].text, expected, stops)
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens < 24
    chunks = list(complete("Once upon a time", max_tokens=24, stop=[stop], stream=True,
                           extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def expect_status(status, call, *needles):
    try:
        call()
    except openai.APIStatusError as e:
        assert e.status_code == status, (e.status_code, e.message)
        body = e.response.json()
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
        for n in needles:
            assert n in e.message, (n, e.message)
        still_serving()
        return
    raise AssertionError(f"expected HTTP {status}")


def test_bad_requests_are_4xx_json_and_the_daemon_keeps_serving():
    status, _, body = http("POST", BASE + "/v1/chat/completions", b'{"model": "x", "messages": [', AUTH)
    assert status == 400 and "not valid JSON" in body["error"]["message"], (status, body)
    still_serving()
    status, _, body = http("POST", BASE + "/v1/completions", b"", AUTH)
    assert status == 400 and body["error"]["message"], (status, body)
    hello = [{"role": "user", "content": "hi"}]
    expect_status(404, lambda: client.chat.completions.create(model="no-such-model", messages=hello), "no-such-model")
    expect_status(400, lambda: chat(hello, max_tokens=-5), "max_tokens")
    expect_status(400, lambda: complete([7] * (CONTEXT + 1), max_tokens=1), "context length")
    expect_status(400, lambda: chat([{"role": "user", "content": "word " * (CONTEXT + 10)}]), "context length")
    expect_status(400, lambda: complete("hi", max_tokens=CONTEXT + 5), "max_tokens")
    expect_status(400, lambda: chat(hello, presence_penalty=0.5), "presence_penalty", "repetition_penalty")
    expect_status(400, lambda: chat(hello, frequency_penalty=1.0), "frequency_penalty")
    expect_status(400, lambda: chat(hello, n=2), "n = 1")
    expect_status(400, lambda: chat(hello, temperature=-1), "temperature")
    expect_status(400, lambda: chat(hello, top_p=0), "top_p")
    expect_status(400, lambda: chat(hello, extra_body={"min_p": 0.1}), "min_p")
    expect_status(400, lambda: chat([]), "messages")
    expect_status(400, lambda: chat([{"role": "wizard", "content": "x"}]), "wizard")
    expect_status(400, lambda: complete([100000]), "vocabulary")
    expect_status(400, lambda: complete([]), "empty")
    expect_status(400, lambda: chat(hello, logprobs=True), "log probabilities")
    status, _, body = http("GET", BASE + "/v1/chat/completions", headers=AUTH)
    assert status == 405 and body["error"]["message"], (status, body)
    status, _, body = http("GET", BASE + "/v1/nothing", headers=AUTH)
    assert status == 404 and body["error"]["message"], (status, body)
    still_serving()


def test_api_key():
    wrong = openai.OpenAI(base_url=BASE + "/v1", api_key="wrong-key", max_retries=0, timeout=30)
    try:
        wrong.models.list()
        raise AssertionError("a wrong key was accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401
    status, _, body = http("GET", BASE + "/v1/models")
    assert status == 401 and "Bearer" in body["error"]["message"], (status, body)
    assert health(BASE)[0] == 200
    assert "smoe_requests_total" in http("GET", BASE + "/metrics")[2]


def test_request_metrics_count_statuses():
    m = metrics(BASE)
    assert m['smoe_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m['smoe_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
    assert m["smoe_ttft_seconds_count"] >= 1 and m["smoe_token_latency_seconds_count"] >= 1


def test_vault_format_metrics():
    m = metrics(BASE)
    tensors = {k: v for k, v in m.items() if k.startswith("smoe_vault_tensors{")}
    experts = sum(v for k, v in tensors.items() if 'kind="experts"' in k)
    assert experts > 0 and experts % 3 == 0, tensors  # three matrices per expert
    assert m['smoe_vault_tensors{dtype="f32",kind="resident"}'] > 0, tensors  # norms
    assert all(m[k.replace("tensors", "bytes", 1)] > 0 for k in tensors), m
    assert 0 < m["smoe_expert_bytes"] <= m["smoe_ring_slot_bytes"], m


run([(name, fn) for name, fn in list(globals().items()) if name.startswith("test_")])
