"""The OpenAI-compatible API of a real Ray Serve app (one Generator replica), over real HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest

from conftest import KEYS, deploy

APP = "api"


@pytest.fixture(scope="module")
def base(serve_port, app_args):
    from ray import serve

    url = deploy(APP, serve_port, app_args, {"user_config": {"drafts": {"code": "v1", "general": "v1", "dialog": "v2"}}})
    yield url
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEYS["acme"], max_retries=0, timeout=60)


def _post(base: str, path: str, body, key: str = KEYS["acme"], **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}{path}", content=content, timeout=60,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}, **kw)


def _health(base: str) -> dict:
    return httpx.get(f"{base}/health", timeout=10).json()


# ----- the happy paths through the official client ------------------------------------------

def test_models_lists_the_target(client, tiny_target):
    models = client.models.list()
    assert [m.id for m in models.data] == [tiny_target.name]


def test_chat_non_stream(client):
    out = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "write a python function"}],
                                         max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert out.usage.completion_tokens <= 12 and out.usage.prompt_tokens > 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    info = out.model_extra["flashspec"]
    assert info["domain"] == "code" and info["draft_version"] == "v1" and 0 < info["router_confidence"] <= 1
    assert info["stats"]["drafted"] > 0


def test_chat_stream_matches_non_stream_and_ends_with_done(client, base):
    messages = [{"role": "user", "content": "hey, how was your weekend?"}]
    chunks = list(client.chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices[0].finish_reason == "length"
    full = client.chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0)
    assert text == full.choices[0].message.content
    raw = _post(base, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3


def test_completion_stream_and_not(client):
    out = client.completions.create(model="x", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.usage.completion_tokens == 8
    streamed = client.completions.create(model="x", prompt="The capital of France is", max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_greedy_output_equals_engine_generate(client, tiny_target):
    from tiny import build_draft

    from engine.generate import generate
    from engine.loading import load_model
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from services.prompts import chat_prompt_ids, completion_prompt_ids

    loaded = load_model(str(tiny_target), max_seq_len=256)
    engine = DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=2, max_seq_len=256)
    engine.add_draft("dialog", build_draft(loaded.model, "dialog", "v2"))
    prompt = "def fibonacci(n):"
    want = generate(engine, [completion_prompt_ids(loaded.tokenizer, prompt)], SamplingParams(max_new_tokens=24),
                    draft="dialog")[0]
    got = client.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=0, extra_body={"domain": "dialog"})
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.token_ids)
    assert got.model_extra["flashspec"]["draft_version"] == "v2"
    messages = [{"role": "user", "content": "tell me about the weather"}]
    want = generate(engine, [chat_prompt_ids(loaded.tokenizer, messages)], SamplingParams(max_new_tokens=16))[0]
    got = client.chat.completions.create(model="x", messages=messages, max_tokens=16, temperature=0,
                                         extra_body={"speculation": False})
    assert got.choices[0].message.content == want.text
    assert got.model_extra["flashspec"]["speculation"] is False and got.model_extra["flashspec"]["stats"] is None


def test_seeded_sampling_repeats(client):
    kw = dict(model="x", prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert a == client.completions.create(seed=7, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (8, 9, 10)}
    assert others - {a}


def test_n_choices_are_the_seeds_in_turn_and_stream_as_they_come(client, base):
    messages = [{"role": "user", "content": "tell me a story"}]
    singles = [client.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=1.0, seed=s)
               for s in (7, 8, 9)]
    reply = client.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [r.choices[0].message.content for r in singles]
    assert reply.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)
    extra = reply.model_extra["flashspec"]
    assert extra["stats"] == extra["stats_by_choice"][0] and len(extra["stats_by_choice"]) == 3

    stream = client.chat.completions.create(model="x", messages=messages, max_tokens=8, temperature=1.0, seed=7, n=3,
                                            stream=True)
    texts, reasons, usage = ["", "", ""], [None] * 3, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
        if chunk.usage is not None:
            assert not chunk.choices  # n > 1: usage comes in a chunk of its own, after every choice finished
            usage = chunk.usage
    assert texts == [c.message.content for c in reply.choices] and None not in reasons
    assert usage.completion_tokens == reply.usage.completion_tokens

    greedy = client.completions.create(model="x", prompt="def add(a, b):", max_tokens=6, temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text == client.completions.create(
        model="x", prompt="def add(a, b):", max_tokens=6, temperature=0).choices[0].text
    error = _error(_post(base, "/v1/completions", {"prompt": "hi", "n": 17}), 422)
    assert error["param"] == "n" and "16" in error["message"]


def test_tenant_without_speculation(base):
    out = _post(base, "/v1/completions", {"prompt": "import numpy as np", "max_tokens": 4}, key=KEYS["nospec"]).json()
    assert out["flashspec"]["speculation"] is False and out["flashspec"]["draft_version"] is None


# ----- errors: OpenAI shape, and the server stays up ------------------------------------------

def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_bad_key_is_401(base):
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="invalid API key"):
        bad.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    _error(httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}), 401)


def test_domain_not_allowed_is_403(base):
    error = _error(_post(base, "/v1/completions", {"prompt": "hi", "domain": "code"}, key=KEYS["limited"]), 403)
    assert "may not use domain 'code'" in error["message"] and error["type"] == "permission_error"


def test_rate_limit_is_429_with_retry_after(base):
    codes = [_post(base, "/v1/completions", {"prompt": "hello", "max_tokens": 2}, key=KEYS["limited"]) for _ in range(5)]
    limited = [r for r in codes if r.status_code == 429]
    assert limited, [r.status_code for r in codes]
    assert int(limited[0].headers["retry-after"]) >= 1
    assert _error(limited[0], 429)["type"] == "rate_limit_error"


def test_bad_params_are_422_with_a_message(client, base):
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        client.completions.create(model="x", prompt="hi", temperature=5)
    error = _error(_post(base, "/v1/chat/completions", {"messages": []}), 422)
    assert error["param"] == "messages" and "at least 1" in error["message"]
    _error(_post(base, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}), 422)


def test_a_parameter_the_server_does_not_implement_is_400_not_ignored(client, base):
    with pytest.raises(openai.BadRequestError, match="logprobs") as caught:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=2)
    assert caught.value.body["code"] == "unsupported_parameter" and caught.value.body["param"] == "logprobs"
    error = _error(_post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "presence_penalty": 0.6}), 400)
    assert error["param"] == "presence_penalty" and "at 0" in error["message"]
    # The same fields at their defaults, as some clients always send them, are served.
    reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           logprobs=False, presence_penalty=0, frequency_penalty=0, logit_bias={})
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_prompt_over_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError, match="context is 256"):
        client.completions.create(model="x", prompt="word " * 400, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context is 256"):  # a stream fails before its first byte
        client.completions.create(model="x", prompt="word " * 400, max_tokens=4, stream=True)


def test_max_tokens_over_the_cap_is_400(base):
    error = _error(_post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 100000}), 400)
    assert error["param"] == "max_tokens" and "at most 200" in error["message"]


def test_malformed_json_and_non_utf8_are_400(base):
    assert _error(_post(base, "/v1/chat/completions", b'{"messages": [}'), 400)["code"] == "invalid_json"
    assert _error(_post(base, "/v1/chat/completions", b'{"prompt": "\xff\xfe"}'), 400)["code"] == "invalid_encoding"
    assert _error(_post(base, "/v1/completions", b"[1, 2]"), 400)["code"] == "invalid_json"
    assert _health(base)["status"] == "ok"


def test_full_queue_is_503_and_the_rest_are_served(base):
    body = {"prompt": "count to a thousand", "max_tokens": 120, "speculation": False}
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        responses = list(pool.map(lambda _: _post(base, "/v1/completions", body), range(10)))
    codes = sorted(r.status_code for r in responses)
    assert codes.count(503) >= 1 and codes.count(200) >= 6, codes  # capacity: 4 running + 2 queued
    assert _error(next(r for r in responses if r.status_code == 503), 503)["code"] == "server_overloaded"
    assert _post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_disconnecting_a_stream_frees_its_slot(base):
    before = _health(base)
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEYS['acme']}"},
                      json={"prompt": "tell a long story", "max_tokens": 200, "stream": True, "speculation": False}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert _health(base)["in_flight"] >= 1
    deadline = time.monotonic() + 15
    while (h := _health(base))["in_flight"] or h["running"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
    assert h["cache_bytes"] == before["cache_bytes"]
    assert _post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def _drained(base: str, before: dict) -> None:
    deadline = time.monotonic() + 15
    while (h := _health(base))["in_flight"] or h["running"] or h["waiting"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
    assert h["cache_bytes"] == before["cache_bytes"]


def test_n_over_the_free_capacity_is_503_and_frees_the_choices_that_started(base):
    before = _health(base)  # capacity: 4 running + 2 queued; 8 choices cannot all be admitted
    body = {"prompt": "count to a thousand", "max_tokens": 200, "speculation": False, "n": 8}
    assert _error(_post(base, "/v1/completions", body), 503)["code"] == "server_overloaded"
    _drained(base, before)
    assert _health(base)["steps"] - before["steps"] < 100  # cancelled at once: 8 x 200 tokens would take hundreds
    assert _post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 4}).status_code == 200


def test_disconnecting_a_stream_of_n_choices_frees_every_slot(base):
    before = _health(base)
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEYS['acme']}"},
                      json={"prompt": "tell a long story", "max_tokens": 200, "stream": True, "speculation": False,
                            "n": 3}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert _health(base)["in_flight"] >= 3
    _drained(base, before)
    assert _health(base)["steps"] - before["steps"] < 100  # stopped when the client left, not after 200 tokens


# ----- draft hot-swap ---------------------------------------------------------------------------

def _admin(base: str, domain: str, version: str, key: str = KEYS["admin"]) -> httpx.Response:
    return _post(base, "/admin/drafts", {"domain": domain, "version": version}, key=key)


def test_admin_needs_the_admin_key(base):
    _error(_admin(base, "code", "v2", key=KEYS["acme"]), 401)
    _error(_post(base, "/admin/drafts", {"domain": "nope", "version": "v2"}, key=KEYS["admin"]), 422)


def test_hot_swap_while_other_domains_stream(base, client):
    def stream(domain: str) -> tuple[str, str]:
        chunks = list(client.completions.create(model="x", prompt=f"a {domain} text", max_tokens=60, temperature=0,
                                                stream=True, extra_body={"domain": domain}))
        return chunks[-1].choices[0].finish_reason, chunks[-1].model_extra["flashspec"]["draft_version"]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(stream, d) for d in ("general", "dialog", "general")]
        time.sleep(0.3)
        swap = _admin(base, "code", "v2")
        results = [f.result() for f in running]
    assert swap.status_code == 200, swap.text
    assert all(ok["ok"] for ok in swap.json()["replicas"].values())
    assert results == [("length", "v1"), ("length", "v2"), ("length", "v1")]
    out = client.completions.create(model="x", prompt="x = 1", max_tokens=4, extra_body={"domain": "code"})
    assert out.model_extra["flashspec"]["draft_version"] == "v2"


@pytest.mark.parametrize("version", ["bad-truncated", "nan-weights"])
def test_bad_draft_version_is_refused_and_the_old_keeps_serving(base, client, version):
    active = _health(base)["drafts"]["general"]
    error = _error(_admin(base, "general", version), 400)
    assert error["code"] == "draft_refused" and "previous version keeps serving" in error["message"]
    out = client.completions.create(model="x", prompt="The history of Rome", max_tokens=6,
                                    extra_body={"domain": "general"})
    assert out.model_extra["flashspec"]["draft_version"] == active and out.usage.completion_tokens == 6


def test_metrics_count_requests_tokens_and_speculation(base):
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for needle in ('flashspec_requests_total{endpoint="/v1/completions",status="200"}',
                   'flashspec_requests_total{endpoint="/v1/completions",status="401"}',
                   'flashspec_tokens_total{kind="completion"}', 'flashspec_draft_tokens_total{domain="code"}',
                   'flashspec_accepted_tokens_total{domain="code"}', 'flashspec_acceptance_rate{domain="code"}',
                   'flashspec_router_decisions_total{domain="code",fallback="false"}',
                   'flashspec_drafter_requests_total{domain="code",drafter="draft"}',
                   "flashspec_time_to_first_token_seconds_bucket", "flashspec_time_per_output_token_seconds_bucket"):
        assert needle in text, needle
    rate = [line for line in text.splitlines() if line.startswith('flashspec_acceptance_rate{domain="code"}')][0]
    assert 0.0 <= float(rate.split()[-1]) <= 1.0
