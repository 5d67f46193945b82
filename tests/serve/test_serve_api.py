"""The real application on a local Ray instance: the embedded model on CPU behind the OpenAI API,
driven by the official ``openai`` client (and ``httpx`` for raw requests)."""

from __future__ import annotations

import asyncio
import threading
import tempfile
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from serve_testutil import free_port

MODEL = "smollm2-135m-instruct"
KEY = "test-key-123"
MAX_MODEL_LEN = 512
APP_ARGS = {
    "model": MODEL,
    "engine_kwargs": {"tree": "top4", "max_num_seqs": 4, "max_model_len": MAX_MODEL_LEN, "device": "cpu"},
    "api_keys": [KEY],
    "max_ongoing_requests": 4,
    "max_queued_requests": 2,
    "retry_after_s": 2,
    "ray_actor_options": {"num_cpus": 0},
    # fleet hot start on: the replica pushes its recycled rows to the matrix actor in the background
    "fleet": {"enabled": True, "namespace": "serve-api-test", "sync_interval_s": 0.5,
              "snapshot_dir": tempfile.mkdtemp(prefix="tr_serve_fleet_")},
}
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def app(ray_local):
    from ray import serve

    from tr_serve.serve.builder import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(APP_ARGS), blocking=False, name="tr_serve_test", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(base + "/v1/models", headers=AUTH, timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the app did not come up"
        time.sleep(0.5)
    yield SimpleNamespace(base=base, client=openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0,
                                                          timeout=120))


def post(app, path, body=None, headers=AUTH, timeout=120):
    return httpx.post(app.base + path, json=body, headers=headers, timeout=timeout)


def stats(app) -> dict:
    r = httpx.get(app.base + "/v1/tr/stats", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"][0]


def wait_idle(app, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = stats(app)
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        assert time.monotonic() < deadline, f"requests left in the engine: {s}"
        time.sleep(0.2)


def sse_events(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[len("data: "):])
    return out


# ---- happy paths ------------------------------------------------------------------------------
def test_list_models(app):
    models = app.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "tr_serve"
    assert app.client.models.retrieve(MODEL).id == MODEL


def test_tr_stats_reports_the_engine_load(app):
    s = wait_idle(app)
    assert s["model"] == MODEL and s["engine_alive"] is True
    assert (s["num_rows"], s["max_num_seqs"], s["kv_cache_usage"]) == (4, 4, 0.0)
    assert s["num_prefilling"] == s["num_decoding"] == 0


def test_completion_greedy_with_usage_and_tr_extension(app):
    r = app.client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                      temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    tr = r.model_extra["tr"]
    assert tr["verification_steps"] == len(tr["accepted_per_step"]) >= 1
    assert sum(tr["accepted_per_step"]) == r.usage.completion_tokens - 1  # the first token comes from the prefill
    assert tr["mat"] == round(sum(tr["accepted_per_step"]) / len(tr["accepted_per_step"]), 4)
    assert all(1 <= a <= 5 for a in tr["accepted_per_step"])  # top4: at most 4 drafts and the bonus token
    assert tr["tree"] == "top4"


def test_a_second_turn_reports_its_cached_prompt_tokens(app):
    """The first turn's row keeps its KV: the second turn (its history re-sent) prefills only what
    is new, and says so in usage.prompt_tokens_details, streamed and not."""
    system = {"role": "system", "content": "You answer questions about gardening in one short, plain sentence, "
                                           "without lists, and you say so when you do not know."}
    turn = [system, {"role": "user", "content": "When should I plant tulip bulbs?"}]
    first = app.client.chat.completions.create(model=MODEL, messages=turn, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And how deep?"}]
    chunks = list(app.client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    streamed = chunks[-1].usage
    assert streamed.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 > 0
    again = app.client.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= streamed.prompt_tokens_details.cached_tokens


def test_completion_length_and_stop(app):
    r = app.client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    full = app.client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12,
                                         temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full
    for stops in ([stop, "never-seen-xyz"], stop):  # a list or one string
        cut = app.client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                            top_p=0.9, stop=stops)
        assert cut.choices[0].finish_reason == "stop"
        assert cut.choices[0].text == full[:full.index(stop)]


def test_chat_and_streaming_chat_give_the_same_greedy_text(app):
    full = app.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, seed=1)
    text = full.choices[0].message.content
    assert full.choices[0].message.role == "assistant" and text
    assert full.choices[0].finish_reason in ("stop", "length")

    stream = app.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    pieces, reasons, usage, first_role, final_tr = [], [], None, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        first_role = first_role or delta.role
        pieces.append(delta.content or "")
        if chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
            final_tr = chunk.model_extra["tr"]
    assert first_role == "assistant"
    assert "".join(pieces) == text
    assert reasons == [full.choices[0].finish_reason]
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    # the finishing chunk carries the request's TR stats: one entry per verification step, which
    # together made every token but the prefill's first
    assert final_tr["verification_steps"] == len(final_tr["accepted_per_step"]) >= 1
    assert sum(final_tr["accepted_per_step"]) == usage.completion_tokens - 1

    # text content parts and max_completion_tokens are the same request
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    again = app.client.chat.completions.create(model=MODEL, messages=parts, max_completion_tokens=24, temperature=0)
    assert again.choices[0].message.content == text


def test_streaming_completion_matches_and_ends_with_done(app):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    full = post(app, "/v1/completions", body).json()
    with httpx.stream("POST", app.base + "/v1/completions", json={**body, "stream": True}, headers=AUTH,
                      timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert all("usage" not in c for c in chunks)  # only with stream_options.include_usage


def test_unknown_fields_are_ignored(app):
    r = post(app, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0,
                                          "user": "u1", "metadata": {"a": "b"}, "some_future_field": [1, 2]})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"


# ---- errors -----------------------------------------------------------------------------------
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 10)
ERROR_CASES = [
    # (name, path, body or raw bytes, status, param, code)
    ("malformed json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400, None, "invalid_json"),
    ("body is an array", "/v1/chat/completions", b"[1, 2]", 400, None, None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("missing model", "/v1/completions", {"prompt": "hi"}, 400, "model", "missing_required_parameter"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", None),
    ("messages not a list", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("bad role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x", "content": "a"}]}, 400,
     "messages[0].role", None),
    ("max_tokens wrong type", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": "5"}, 400,
     "max_tokens", None),
    ("stream wrong type", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stream": "true"}, 400,
     "stream", None),
    ("max_tokens zero", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens",
     None),
    ("max_tokens negative", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": -3}, 400,
     "max_tokens", None),
    ("max_completion_tokens zero", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("temperature too high", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 3}, 400,
     "temperature", None),
    ("empty stop string", "/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, 400, "stop", None),
    ("n > 1", "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 2}, 400, "n", "unsupported_value"),
    ("prompt + max_tokens too long", "/v1/chat/completions",
     {"model": MODEL, "messages": CHAT, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens", "context_length_exceeded"),
    ("prompt too long", "/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT}, 400, "prompt",
     "context_length_exceeded"),
    ("streamed prompt too long", "/v1/completions", {"model": MODEL, "prompt": LONG_PROMPT, "stream": True}, 400,
     "prompt", "context_length_exceeded"),
    ("token id outside vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", None),
    ("batched prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-5", "messages": CHAT}, 404, "model", "model_not_found"),
    ("unknown model streamed", "/v1/completions", {"model": "gpt-5", "prompt": "hi", "stream": True}, 404, "model",
     "model_not_found"),
    ("unknown route", "/v1/embeddings", {"model": MODEL, "input": "hi"}, 404, None, None),
]


def test_errors_have_the_openai_shape_and_leave_other_requests_alone(app):
    # a long greedy stream runs while every bad request comes and goes
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 40, "temperature": 0}
    reference = post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    streamed = []

    def run_stream():
        with httpx.stream("POST", app.base + "/v1/chat/completions", json={**body, "stream": True}, headers=AUTH,
                          timeout=120) as r:
            streamed.extend(sse_events(r.iter_lines()))

    t = threading.Thread(target=run_stream)
    t.start()
    try:
        for name, path, payload, status, param, code in ERROR_CASES:
            if isinstance(payload, bytes):
                r = httpx.post(app.base + path, content=payload, timeout=60,
                               headers={**AUTH, "Content-Type": "application/json"})
            else:
                r = post(app, path, payload)
            assert r.status_code == status, (name, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, name
            assert err["message"] and isinstance(err["type"], str), name
            assert err["param"] == param, (name, err)
            if code is not None:
                assert err["code"] == code, (name, err)
        r = httpx.get(app.base + "/v1/chat/completions", headers=AUTH)
        assert r.status_code == 405 and "error" in r.json()
        assert "n > 1 is not supported" in post(app, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                                                            "n": 3}).json()["error"]["message"]
    finally:
        t.join(timeout=120)
    import json

    assert streamed[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in streamed[:-1])
    assert text == reference
    assert stats(app)["engine_alive"] is True


def test_openai_client_raises_the_matching_errors(app):
    with pytest.raises(openai.NotFoundError):
        app.client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.BadRequestError) as e:
        app.client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert (e.value.param, e.value.code) == ("n", "unsupported_value")
    with pytest.raises(openai.BadRequestError):
        app.client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN + 1)


def test_api_key_is_required(app):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": "Bearer"}):
        r = post(app, "/v1/chat/completions", {"model": MODEL, "messages": CHAT}, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(app.base + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(app.base + "/v1/tr/stats", timeout=30).status_code == 401
    assert httpx.get(app.base + "/health", timeout=30).status_code == 200  # probes need no key
    bad = openai.OpenAI(base_url=app.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- cancellation and overload ----------------------------------------------------------------
def test_client_disconnect_mid_stream_aborts_the_request(app):
    before = wait_idle(app)
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": MAX_MODEL_LEN - 20,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", app.base + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got += 1
                    if got == 2:
                        break
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while True:
        s = stats(app)
        if s["num_running"] == 0 and s["num_waiting"] == 0 and s["requests_aborted"] == before["requests_aborted"] + 1:
            break
        assert time.monotonic() < deadline, f"the generation was not aborted: {s}"
        time.sleep(0.2)
    assert s["requests_finished"] == before["requests_finished"]  # it did not run to its end

    # a non-streamed request whose client gives up is aborted the same way
    with pytest.raises(httpx.TimeoutException):
        post(app, "/v1/completions", {**body, "stream": False}, timeout=2)
    deadline = time.monotonic() + 30
    while True:
        s = stats(app)
        if s["num_running"] == 0 and s["requests_aborted"] == before["requests_aborted"] + 2:
            break
        assert time.monotonic() < deadline, f"the non-streamed generation was not aborted: {s}"
        time.sleep(0.2)


def test_overload_returns_429_with_retry_after(app):
    wait_idle(app)
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 48, "temperature": 0, "ignore_eos": True}

    async def burst(n):
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
            return await asyncio.gather(*[client.post(app.base + "/v1/completions", json=body, headers=AUTH)
                                          for _ in range(n)])

    responses = asyncio.run(burst(12))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, statuses
    rejected = [r for r in responses if r.status_code == 429]
    # Serve admits at least max_queued_requests of a simultaneous burst (its router may refuse more
    # than strictly needed while requests are being assigned), and refuses some of 12
    assert rejected and statuses.count(200) >= APP_ARGS["max_queued_requests"], statuses
    for r in rejected:
        assert r.headers["Retry-After"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "overloaded"
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 48
    wait_idle(app)
    ok = app.client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_metrics_record_outside_a_replica(app):
    from tr_serve.serve.metrics import IngressMetrics, ServerMetrics

    m = ServerMetrics("unit-test-model")
    calls = []  # (metric, value, tags) for every record the metrics make
    for name in ("running", "waiting", "kv_usage", "steps", "accepted", "tree_nodes", "prefix_queries", "prefix_hits"):
        metric = getattr(m, name)
        for method in ("set", "inc", "observe"):
            real = getattr(metric, method, None)
            if real is not None:
                def record(value=1, tags=None, _real=real, _name=name):
                    calls.append((_name, value))
                    return _real(value, tags=tags)
                setattr(metric, method, record)
    stats = {"running": 1, "prefilling": 1, "waiting": 1, "kv_rows_used": 2, "kv_rows": 4}  # AsyncEngine.stats()
    m.on_step(stats)
    # running counts every request holding a KV row (decoding + prefilling); usage = rows used / rows
    assert calls == [("steps", 1), ("running", 2), ("waiting", 1), ("kv_usage", 0.5)]
    m.on_step(dict(stats))  # unchanged: the step is counted, the gauges are not set again
    assert calls[4:] == [("steps", 1)]
    m.on_step({**stats, "waiting": 0, "kv_rows_used": 1})
    assert calls[5:] == [("steps", 1), ("running", 2), ("waiting", 0), ("kv_usage", 0.25)]
    # the prefix-cache counters grow by the engine's totals' difference; the gauges stay as they were
    m.on_step({**stats, "waiting": 0, "kv_rows_used": 1, "prefix_cache_queries": 10, "prefix_cache_hits": 4})
    m.on_step({**stats, "waiting": 0, "kv_rows_used": 1, "prefix_cache_queries": 15, "prefix_cache_hits": 4})
    assert calls[9:] == [("steps", 1), ("prefix_queries", 10), ("prefix_hits", 4), ("steps", 1), ("prefix_queries", 5)]
    m.accepted.observe(3)
    m.tree_nodes.observe(4)
    assert calls[-2:] == [("accepted", 3), ("tree_nodes", 4)]
    ingress = IngressMetrics()
    seen = []
    real_inc = ingress.requests.inc
    ingress.requests.inc = lambda value=1, tags=None: (seen.append((value, tags)), real_inc(value, tags=tags))
    ingress.request("unit-test-model", "/v1/completions", 200)
    assert seen == [(1, {"model": "unit-test-model", "endpoint": "/v1/completions", "status": "200"})]


def test_replica_syncs_its_matrix_with_the_fleet_actor(app):
    app.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    deadline = time.monotonic() + 60
    while True:
        fleet = stats(app)["fleet"]
        if fleet and fleet["pushes"] >= 1 and fleet["rows_pushed"] > 0 and fleet["adopted_version"] >= 1:
            break
        assert time.monotonic() < deadline, f"no fleet sync happened: {fleet}"
        time.sleep(0.5)
    assert fleet["errors"] == 0, fleet
    assert "rows" not in fleet and "table" not in fleet  # figures only, never matrix contents
