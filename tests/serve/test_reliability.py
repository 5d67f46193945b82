"""The application under abuse, live on a local Ray (loopback HTTP, 2 CPUs, shut down at the end):
overload refusals of streamed requests, oversized and hostile bodies, API-key routes, a killed
model replica, and a drain. Every refusal must be an OpenAI error body; nothing may be logged as
an internal error; streams must end with ``data: [DONE]``.

Figures (``-s`` prints them): the time to refuse a 5 MB body, the largest gap between chunks of a
stream running meanwhile, the latency of the 503s while the replica is gone, the outage length."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from serve_testutil import free_port

MODEL = "smollm2-135m-instruct"
APP = "tr_serve_reliability"
KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 512
MAX_PROMPT_CHARS = 64 * MAX_MODEL_LEN  # TRServeConfig's default
APP_ARGS = {
    "model": MODEL,
    "engine_kwargs": {"tree": "top4", "max_num_seqs": 2, "max_model_len": MAX_MODEL_LEN, "device": "cpu"},
    "api_keys": [KEY],
    "max_ongoing_requests": 2,
    "max_queued_requests": 2,
    "retry_after_s": 2,
    "health_check_period_s": 2,
    "ray_actor_options": {"num_cpus": 0},
}
CHAT = [{"role": "user", "content": "Name three colors."}]
INTERNAL_ERROR_MARKS = ("Traceback", "unhandled error", "request to the model server failed", "internal error",
                        "PicklingError", "UnicodeEncodeError")


@pytest.fixture(scope="module")
def app(ray_local):
    from ray import serve

    from tr_serve.serve.builder import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(APP_ARGS), blocking=False, name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, 180)
    logs = Path(ray_local._private.worker._global_node.get_logs_dir_path())
    yield SimpleNamespace(base=base, ray=ray_local, logs=logs)


def wait_healthy(base: str, timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < timeout, "the app did not become healthy"
        time.sleep(0.3)


def post(app, body, path="/v1/chat/completions", headers=AUTH, timeout=60, **kw):
    if isinstance(body, bytes):
        return httpx.post(app.base + path, content=body, timeout=timeout,
                          headers={**headers, "Content-Type": "application/json"}, **kw)
    return httpx.post(app.base + path, json=body, headers=headers, timeout=timeout, **kw)


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    if param != "any":
        assert err["param"] == param, err
    return err


def sse(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


class Stream(threading.Thread):
    """A streamed chat request on its own thread; ``times`` are the arrival times of its events."""

    def __init__(self, app, max_tokens: int, content: str = "Write a long story about a red fox."):
        super().__init__(daemon=True)
        self.body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, "stream": True}
        self.app, self.events, self.times, self.status, self.error = app, [], [], None, None
        self.started = threading.Event()

    def run(self):
        try:
            with httpx.stream("POST", self.app.base + "/v1/chat/completions", json=self.body, headers=AUTH,
                              timeout=180) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.times.append(time.monotonic())
                        if len(self.events) >= 2:
                            self.started.set()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self.started.set()

    def last_json(self) -> dict:
        return json.loads(self.events[-2])


class LogWatch:
    """What Serve's and the workers' log files got while the block ran."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.sizes = {p: p.stat().st_size for p in self._files()}

    def _files(self):
        return list((self.logs / "serve").glob("*.log")) + list(self.logs.glob("worker-*.err"))

    def new_text(self) -> str:
        time.sleep(1.0)  # let the replicas' log handlers write
        out = []
        for p in self._files():
            with open(p, "rb") as f:
                f.seek(self.sizes.get(p, 0))
                out.append(f.read().decode(errors="replace"))
        return "\n".join(out)


# ---- overload ------------------------------------------------------------------------------------
def test_streamed_requests_refused_for_overload_get_openai_errors(app):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def one(client):
        async with client.stream("POST", app.base + "/v1/chat/completions", json=body, headers=AUTH) as r:
            return r.status_code, dict(r.headers), (await r.aread()).decode()

    async def burst(n):
        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=n)) as client:
            return await asyncio.gather(*[one(client) for _ in range(n)])

    results = asyncio.run(burst(16))
    refused = [r for r in results if r[0] != 200]
    assert refused, "16 streams over max_ongoing 2 + max_queued 2: some must be refused"
    for status, headers, text in refused:
        assert status == 429, (status, text)
        assert headers["content-type"].startswith("application/json"), (headers, text)
        assert headers["retry-after"] == "2"
        err = json.loads(text)["error"]
        assert (err["type"], err["code"]) == ("rate_limit_error", "overloaded"), err
    for status, headers, text in results:
        if status == 200:
            assert sse(text.splitlines())[-1] == "[DONE]"
    print(f"\n16 concurrent streams: {len(results) - len(refused)} served, {len(refused)} refused with an "
          "OpenAI 429 body + Retry-After")


# ---- bounded request cost ----------------------------------------------------------------------
def test_large_bodies_are_refused_fast_while_another_stream_flows(app):
    stream = Stream(app, max_tokens=200)
    stream.start()
    assert stream.started.wait(120) and stream.status == 200, stream.error
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "abc " * 1310720}]}).encode()
    assert len(big) > 5 * 1024 * 1024
    window_start = time.monotonic()

    async def concurrently(bodies):
        async def one(client, body):
            t = time.monotonic()
            r = await client.post(app.base + "/v1/chat/completions", content=body,
                                  headers={**AUTH, "Content-Type": "application/json"})
            return r, time.monotonic() - t

        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[one(client, b) for b in bodies])

    sized = asyncio.run(concurrently([big] * 3))  # three 5 MB bodies at once
    for r, _ in sized:
        err = assert_openai_error(r, 413, "request_too_large")
        assert f"larger than {4 * MAX_PROMPT_CHARS + 65536} bytes" in err["message"]  # the default limit

    def chunks():  # no Content-Length: counted while it is read
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    t = time.monotonic()
    r = httpx.post(app.base + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    chunked_s = time.monotonic() - t
    assert_openai_error(r, 413, "request_too_large")

    # under the body limit, over the character bound: refused before tokenizing
    t = time.monotonic()
    r = post(app, {"model": MODEL, "messages": [{"role": "user", "content": "a " * (MAX_PROMPT_CHARS // 2 + 100)}]})
    chars_s = time.monotonic() - t
    err = assert_openai_error(r, 400, "context_length_exceeded", "messages")
    assert "max_prompt_chars" in err["message"]

    # just under the character bound: tokenized (off the event loop), then refused for its tokens
    near = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "abc " * (MAX_PROMPT_CHARS // 4 - 8)}],
                       "max_tokens": 1}).encode()
    tokenized = asyncio.run(concurrently([near] * 2))  # the stream + 2: within max_ongoing + max_queued
    for r, _ in tokenized:
        assert_openai_error(r, 400, "context_length_exceeded", "messages")
    window_end = time.monotonic()
    stream.join(180)
    assert stream.error is None and stream.events[-1] == "[DONE]", stream.error
    gaps = [(a, b - a) for a, b in zip(stream.times, stream.times[1:])]
    during = [g for a, g in gaps if a <= window_end and a + g >= window_start]
    gap = max(during)
    print(f"\n5 MB bodies refused in {max(s for _, s in sized):.3f} s (3 at once, Content-Length), "
          f"{chunked_s:.3f} s (chunked); {MAX_PROMPT_CHARS + 200}-char prompt refused in {chars_s:.3f} s; "
          f"2 prompts of {MAX_PROMPT_CHARS - 32} chars tokenized and refused in {max(s for _, s in tokenized):.3f} s; "
          f"largest gap of the other stream meanwhile {gap:.3f} s ({len(during)} gaps over "
          f"{window_end - window_start:.2f} s), over its whole run {max(g for _, g in gaps):.3f} s")
    # refused before any tokenizing: tokenizing one such body alone takes 2.7 s here. The bodies still
    # cross the loopback first (alone 0.04-0.05 s; 1.2-1.5 s measured while the other test worker
    # loaded both cores), so the bound sits between the two
    assert max(s for _, s in sized) < 2.0 and chunked_s < 2.0 and chars_s < 1.0
    assert gap < 2.0


def _deep(n: int) -> dict:
    root = node = {}
    for _ in range(n):
        node["a"] = {}
        node = node["a"]
    return root


HOSTILE = [
    # (name, body (JSON-able or raw bytes), status, code, param)
    ("tool_choice nested 900 deep", {"model": MODEL, "messages": CHAT, "tool_choice": _deep(900)}, 400,
     "invalid_body", "tool_choice.a.a.a"),
    ("unknown field nested 900 deep", {"model": MODEL, "messages": CHAT, "extra": _deep(900)}, 400,
     "invalid_body", "extra.a.a.a"),
    ("arrays nested 40000 deep", b'{"model": "%s", "x": ' % MODEL.encode() + b"[" * 40000 + b"]" * 40000 + b"}",
     400, "invalid_body", None),
    ("lone surrogate in model", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 400,
     "invalid_unicode", "model"),
    ("lone surrogate in content", b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udfffb"}]}'
     % MODEL.encode(), 400, "invalid_unicode", "messages[0].content"),
    ("lone surrogate in a name", b'{"model": "%s", "messages": [{"role": "user", "content": "hi", "name": '
     b'"\\ud83d"}]}' % MODEL.encode(), 400, "invalid_unicode", "messages[0].name"),
    ("lone surrogate in stop", b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop": '
     b'["x", "\\udc00"]}' % MODEL.encode(), 400, "invalid_unicode", "stop[1]"),
    ("lone surrogate in an unknown key", b'{"model": "%s", "messages": [], "\\ud800k": 1}' % MODEL.encode(), 400,
     "invalid_unicode", None),
    ("lone surrogate in a completion prompt", b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode(), 400,
     "invalid_unicode", "prompt"),
    ("tool_choice auto", {"model": MODEL, "messages": CHAT, "tool_choice": "auto"}, 400, "unsupported_value",
     "tool_choice"),
    ("tool_choice named", {"model": MODEL, "messages": CHAT, "tool_choice": {"type": "function",
                                                                          "function": {"name": "f"}}}, 400,
     "unsupported_value", "tool_choice"),
    ("tools", {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "unsupported_value", "tools"),
    ("functions", {"model": MODEL, "messages": CHAT, "functions": [{"name": "f"}]}, 400, "unsupported_value",
     "functions"),
    ("audio", {"model": MODEL, "messages": CHAT, "audio": {"voice": "x"}}, 400, "unsupported_value", "audio"),
    ("modalities audio", {"model": MODEL, "messages": CHAT, "modalities": ["text", "audio"]}, 400,
     "unsupported_value", "modalities"),
    ("17 stop strings", {"model": MODEL, "messages": CHAT, "stop": [f"s{i}" for i in range(17)]}, 400,
     "invalid_value", "stop"),
    ("invalid UTF-8", b'{"model": "\xff\xfe"}', 400, "invalid_json", None),
    ("array body", b"[1, 2]", 400, "invalid_body", None),
    ("null body", b"null", 400, "invalid_body", None),
    ("empty body", b"", 400, "missing_body", None),
    ("100 KB model name", {"model": "m" * 100_000, "messages": CHAT}, 404, "model_not_found", "model"),
    ("control characters in the model name", {"model": "a\x00\x1b[31mb", "messages": CHAT}, 404,
     "model_not_found", "model"),
]


def test_hostile_bodies_get_openai_4xx_and_nothing_is_logged_as_an_internal_error(app):
    watch = LogWatch(app.logs)
    for name, body, status, code, param in HOSTILE:
        path = "/v1/completions" if "completion prompt" in name else "/v1/chat/completions"
        r = post(app, body, path=path)
        err = assert_openai_error(r, status, code, param)
        assert len(r.content) < 2048, (name, len(r.content))  # nothing echoed unbounded
        r.content.decode("ascii")  # escaped: no raw user bytes in an error body
        if name == "100 KB model name":
            assert "(100000 characters)" in err["message"]
        if name.startswith("control"):
            assert "\x1b" not in err["message"] and "\\u001b" in err["message"]
    # tool_choice "none" asks for what the server does anyway
    ok = post(app, {"model": MODEL, "messages": CHAT, "tool_choice": "none", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text
    # the same refusals streamed: still plain OpenAI errors, not SSE
    r = post(app, b'{"model": "\\ud800", "stream": true, "messages": [{"role": "user", "content": "x"}]}')
    assert_openai_error(r, 400, "invalid_unicode", "model")
    logged = watch.new_text()
    bad = [line for line in logged.splitlines() if any(mark in line for mark in INTERNAL_ERROR_MARKS)]
    assert not bad, "\n".join(bad[:20])


def test_api_keys_are_skipped_only_for_the_exact_health_route(app):
    assert httpx.get(app.base + "/health", timeout=30).status_code == 200
    for path in ("/v1/health", "/x/health", "/health/", "/healthz", "/v1/models/health"):
        r = httpx.get(app.base + path, timeout=30)
        assert_openai_error(r, 401, "invalid_api_key")
    assert httpx.get(app.base + "/v1/models/health", headers=AUTH, timeout=30).status_code == 404


# ---- a model replica dies --------------------------------------------------------------------------
def _replica_actor(app):
    from ray.serve._private.constants import SERVE_NAMESPACE

    names = [a["name"] for a in app.ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#LLMServer")]
    assert len(names) == 1, names
    return app.ray.get_actor(names[0], namespace=SERVE_NAMESPACE)


def test_killed_replica_gives_fast_503s_then_the_same_greedy_output(app):
    greedy = {"model": MODEL, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    reference = post(app, greedy).json()["choices"][0]["message"]["content"]
    stream = Stream(app, max_tokens=400)
    stream.start()
    assert stream.started.wait(120) and stream.status == 200, stream.error
    app.ray.kill(_replica_actor(app), no_restart=True)  # Serve starts a new replica
    killed_at = time.monotonic()

    stream.join(60)
    assert stream.error is None and stream.events[-1] == "[DONE]", (stream.error, stream.events[-2:])
    assert stream.last_json()["error"]["code"] == "unavailable", stream.events[-2]

    latencies, refused, streamed_refused, stats_s = [], 0, 0, []
    streamed = False
    while True:
        assert time.monotonic() - killed_at < 240, "the replica did not come back"
        streamed = not streamed  # streamed and non-streamed requests in turn
        t = time.monotonic()
        r = post(app, {**greedy, "stream": streamed})
        latencies.append(time.monotonic() - t)
        if r.status_code == 200:
            break
        assert_openai_error(r, 503, "unavailable")
        assert r.headers["retry-after"] == "5"
        refused += 1
        streamed_refused += streamed
        t = time.monotonic()
        s = httpx.get(app.base + "/v1/tr/stats", headers=AUTH, timeout=30)
        stats_s.append(time.monotonic() - t)
        assert s.status_code == 200
        time.sleep(0.5)
    outage = time.monotonic() - killed_at
    print(f"\nreplica killed: {refused} requests refused with 503 (slowest {max(latencies[:-1] or [0]):.3f} s, "
          f"median {sorted(latencies[:-1] or [0])[len(latencies[:-1]) // 2]:.3f} s), /v1/tr/stats slowest "
          f"{max(stats_s or [0]):.3f} s; served again after {outage:.1f} s")
    assert refused >= 1 and streamed_refused >= 1
    assert max(latencies[:-1]) < 2.0 and max(stats_s) < 2.0
    again = post(app, greedy).json()["choices"][0]["message"]["content"]
    assert again == reference


# ---- drain (last: the app refuses new requests afterwards) ------------------------------------------
def test_drain_ends_in_flight_streams_with_an_error_event_and_done(app):
    from ray import serve

    from tr_serve.serve.builder import INGRESS_NAME

    streams = [Stream(app, max_tokens=400), Stream(app, max_tokens=400, content="Describe the sea at night.")]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120) and s.status == 200, s.error
    handle = serve.get_deployment_handle(INGRESS_NAME, APP)
    replies = handle.broadcast("drain", 2.0).results(timeout_s=30)
    drained_at = time.monotonic()
    assert sum(r["in_flight"] for r in replies) == 2 and all(r["draining"] for r in replies), replies
    t = time.monotonic()
    r = post(app, {"model": MODEL, "messages": CHAT, "max_tokens": 2})
    assert time.monotonic() - t < 1.0
    assert_openai_error(r, 503, "shutting_down")
    assert_openai_error(httpx.get(app.base + "/health", timeout=30), 503, "shutting_down")
    for s in streams:
        s.join(60)
        assert s.error is None and s.events[-1] == "[DONE]", (s.error, s.events[-2:])
        assert s.last_json()["error"]["code"] == "shutting_down", s.events[-2]
        assert s.times[-1] - drained_at < 2.0 + 10.0
    deadline = time.monotonic() + 30
    while handle.broadcast("drain_status").results(timeout_s=30)[0]["in_flight"]:
        assert time.monotonic() < deadline, "requests still counted in flight"
        time.sleep(0.2)
