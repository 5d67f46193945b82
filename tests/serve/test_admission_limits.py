"""Admission limits at the ingress: ``queue_timeout_s`` (a request no replica took in time is
cancelled and gets 503 ``queue_timeout``) and ``max_concurrent_requests_per_key`` (a key, or a
``tenants`` group, over its cap gets 429 ``too_many_requests``; the slot frees when the response
ends). No Ray: the ingress runs over stand-in handles."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tr_serve.serve.config import ConfigError, TRServeConfig
from tr_serve.serve.ingress import OpenAIIngress, build_fastapi_app
from tr_serve.serve.server import ACCEPTED
from serve_testutil import LiveHandle

MODEL = "m"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHUNK = {"object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": None}]}


class _Call:
    """One handle call's response stream: ``ACCEPTED`` once ``accept`` is set (never, if it is
    None), then its items, each marked whether it waits for ``release``; records how many items it
    gave and whether it was cancelled."""

    def __init__(self, accept: asyncio.Event | None, release: asyncio.Event, items: list[tuple[bool, dict]]):
        self.accept, self.release, self.items = accept, release, list(items)
        self.accepted = False
        self.given = 0
        self.cancelled = False

    async def __anext__(self):
        if not self.accepted:
            if self.accept is None:
                await asyncio.Event().wait()  # Serve's queue never hands it to a replica
            else:
                await self.accept.wait()
            self.accepted = True
            return ACCEPTED
        if not self.items:
            raise StopAsyncIteration
        held, item = self.items.pop(0)
        if held:
            await self.release.wait()
        self.given += 1
        return item

    def cancel(self):
        self.cancelled = True


class _Handle(LiveHandle):
    """A model server handle with one live replica; ``accept``: None never admits a request."""

    def __init__(self, accept: asyncio.Event | None = None):
        self.accept = accept
        self.release = asyncio.Event()  # held requests answer once it is set
        self.release.set()
        self.calls: list[_Call] = []

    def _call(self, body) -> _Call:
        # a stream's first chunk comes at once (its 200 goes out), the rest waits; a full response waits
        items = [(False, CHUNK), (True, {**CHUNK, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})] \
            if body.stream else [(True, {"object": "text_completion", "choices": [{"text": "ok"}]})]
        call = _Call(self.accept, self.release, items)
        self.calls.append(call)
        return call

    @property
    def completions(self):
        handle = self

        class _C:
            def remote(self, body, request_id, context=None):
                return handle._call(body)
        return _C()


def _ingress(handle: _Handle, limits: dict, keys: list[str] | None = None, tenants: dict | None = None,
             isolation: str = "tenant"):
    plain = next(c for c in OpenAIIngress.__mro__ if "__serve_build_asgi_app__" in vars(c))  # without Serve's wrapper
    ingress = plain(llm_deployments={MODEL: handle}, model_cards={MODEL: {"id": MODEL, "object": "model"}},
                    api_keys=keys, limits=limits, tenants=tenants, isolation=isolation)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_fastapi_app(ingress)), base_url="http://t")
    return ingress, client


async def _started(client: httpx.AsyncClient, key: str | None = None) -> None:
    """Wait for the first probe round, so requests find the model started."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for _ in range(50):
        if (await client.get("/health", headers=headers)).status_code == 200:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the model never started")


def _post(client: httpx.AsyncClient, key: str | None, stream: bool = False):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/completions", json={**BODY, "stream": stream}, headers=headers)


async def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


# ---- queue_timeout_s ----------------------------------------------------------------------------
def test_a_request_no_replica_takes_within_queue_timeout_s_is_cancelled_with_503():
    async def run():
        handle = _Handle(accept=None)
        ingress, client = _ingress(handle, {"queue_timeout_s": 0.3})
        async with client:
            await _started(client)
            t0 = time.monotonic()
            r = await _post(client, None)
            waited = time.monotonic() - t0
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "queue_timeout" and err["type"] == "service_unavailable_error"
            assert int(r.headers["retry-after"]) > 0 and "queue_timeout_s" in err["message"]
            assert 0.25 < waited < 3
            assert len(handle.calls) == 1 and handle.calls[0].cancelled  # nothing left waiting or running
            assert ingress.in_flight == 0

    asyncio.run(run())


def test_without_queue_timeout_s_a_request_waits_for_its_replica():
    async def run():
        accept = asyncio.Event()
        handle = _Handle(accept=accept)
        _, client = _ingress(handle, {})
        async with client:
            await _started(client)
            request = asyncio.ensure_future(_post(client, None))
            await asyncio.sleep(0.5)
            assert not request.done()
            accept.set()
            r = await request
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"

    asyncio.run(run())


def test_a_request_taken_within_queue_timeout_s_is_served():
    async def run():
        accept = asyncio.Event()
        handle = _Handle(accept=accept)
        _, client = _ingress(handle, {"queue_timeout_s": 5})
        async with client:
            await _started(client)
            asyncio.get_running_loop().call_later(0.2, accept.set)
            r = await _post(client, None)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"

    asyncio.run(run())


# ---- max_concurrent_requests_per_key --------------------------------------------------------------
def _assert_too_many(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["code"] == "too_many_requests" and err["type"] == "rate_limit_error"
    assert int(r.headers["retry-after"]) > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_key_over_its_cap_gets_429_while_another_key_is_served_and_the_slot_frees_at_the_end(stream):
    async def run():
        handle = _Handle(accept=asyncio.Event())
        handle.accept.set()
        handle.release.clear()  # responses stay unfinished (a stream after its first chunk) until released
        ingress, client = _ingress(handle, {"max_concurrent_requests_per_key": 2}, keys=["key-a", "key-b"])
        async with client:
            await _started(client, "key-a")
            # a stream holds its slot past its 200 and first chunk, until the response ends
            given = 1 if stream else 0
            held = [asyncio.ensure_future(_post(client, "key-a", stream)) for _ in range(2)]
            await _until(lambda: len(handle.calls) == 2 and all(c.accepted and c.given == given for c in handle.calls))
            _assert_too_many(await _post(client, "key-a", stream))  # the third of key-a
            assert len(handle.calls) == 2  # never sent to the model server
            other = asyncio.ensure_future(_post(client, "key-b", stream))  # another key is not held up
            await _until(lambda: len(handle.calls) == 3 and handle.calls[2].given == given)
            handle.release.set()
            results = await asyncio.gather(*held, other)
            assert [r.status_code for r in results] == [200] * 3
            if stream:
                assert all(r.text.endswith("data: [DONE]\n\n") and '"text":"ok"' in r.text for r in results)
            else:
                assert [r.json()["choices"][0]["text"] for r in results] == ["ok"] * 3
            await _until(lambda: not ingress._per_key)  # every slot given back
            for _ in range(3):  # key-a has its room again, one request after another
                r = await _post(client, "key-a", stream)
                assert r.status_code == 200, r.text
            assert not ingress._per_key and ingress.in_flight == 0

    asyncio.run(run())


async def _stream_then_leave(app, key: str, leave: asyncio.Event) -> None:
    """POST a streamed completion straight to the ASGI app and disconnect once its first body
    chunk came and ``leave`` is set (httpx's ASGI transport reads a response to its end before it
    returns)."""
    body = json.dumps({**BODY, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "server": ("t", 80), "client": ("127.0.0.1", 1234),
             "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()), (b"authorization", f"Bearer {key}".encode())]}
    sent_body = asyncio.Event()
    requested = False
    statuses = []

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await sent_body.wait()
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        elif message["type"] == "http.response.body" and message.get("body"):
            sent_body.set()

    await asyncio.wait_for(app(scope, receive, send), 10)
    assert statuses == [200]


def test_a_stream_whose_client_leaves_frees_its_slot():
    async def run():
        handle = _Handle(accept=asyncio.Event())
        handle.accept.set()
        handle.release.clear()  # the stream never ends by itself
        ingress, client = _ingress(handle, {"max_concurrent_requests_per_key": 1}, keys=["key-a", "key-b"])
        async with client:
            await _started(client, "key-a")
            leave = asyncio.Event()
            leaving = asyncio.ensure_future(_stream_then_leave(client._transport.app, "key-a", leave))
            await _until(lambda: len(handle.calls) == 1 and handle.calls[0].given == 1)
            _assert_too_many(await _post(client, "key-a", True))  # the stream still holds the slot
            leave.set()
            await leaving
            # the client left before the stream's end: the ingress cancelled the call and freed the slot
            assert handle.calls[0].cancelled and not ingress._per_key and ingress.in_flight == 0
            handle.release.set()
            assert (await _post(client, "key-a")).status_code == 200

    asyncio.run(run())


def test_a_refused_or_timed_out_request_frees_its_slot():
    async def run():
        handle = _Handle(accept=None)
        ingress, client = _ingress(handle, {"max_concurrent_requests_per_key": 1, "queue_timeout_s": 0.2},
                                   keys=["key-a", "key-b"])
        async with client:
            await _started(client, "key-a")
            headers = {"Authorization": "Bearer key-a"}
            r = await client.post("/v1/completions", json={"model": "nope", "prompt": "hi"}, headers=headers)
            assert r.status_code == 404
            assert (await _post(client, "key-a")).json()["error"]["code"] == "queue_timeout"
            assert (await _post(client, "key-a")).json()["error"]["code"] == "queue_timeout"  # not 429
            assert not ingress._per_key

    asyncio.run(run())


def test_the_keys_of_one_tenants_group_share_one_cap_even_with_isolation_none():
    async def run():
        for isolation in ("tenant", "none"):
            handle = _Handle(accept=asyncio.Event())
            handle.accept.set()
            handle.release.clear()
            ingress, client = _ingress(handle, {"max_concurrent_requests_per_key": 1}, keys=["solo"],
                                       tenants={"team": ["t1", "t2"]}, isolation=isolation)
            async with client:
                await _started(client, "solo")
                first = asyncio.ensure_future(_post(client, "t1"))
                await _until(lambda: len(handle.calls) == 1)
                _assert_too_many(await _post(client, "t2"))  # the group's one slot is taken
                solo = asyncio.ensure_future(_post(client, "solo"))  # a key of its own is another caller
                await _until(lambda: len(handle.calls) == 2)
                assert len(ingress._per_key) == 2 and all(k.startswith("t-") for k in ingress._per_key)  # ids
                handle.release.set()
                assert (await first).status_code == 200 and (await solo).status_code == 200
                assert not ingress._per_key, isolation

    asyncio.run(run())


def test_without_a_cap_nothing_is_counted():
    async def run():
        handle = _Handle(accept=asyncio.Event())
        handle.accept.set()
        handle.release.clear()
        ingress, client = _ingress(handle, {}, keys=["key-a", "key-b"])
        async with client:
            await _started(client, "key-a")
            held = [asyncio.ensure_future(_post(client, "key-a")) for _ in range(5)]
            await _until(lambda: len(handle.calls) == 5)
            assert not ingress._per_key
            handle.release.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 5

    asyncio.run(run())


# ---- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [{"queue_timeout_s": 0}, {"queue_timeout_s": -1}, {"queue_timeout_s": "inf"},
                                  {"max_concurrent_requests_per_key": 0},
                                  {"max_concurrent_requests_per_key": -2}])
def test_non_positive_limits_are_refused_naming_the_key(args):
    with pytest.raises(ConfigError, match=next(iter(args))):
        TRServeConfig.from_args(args)


def test_the_limits_reach_the_ingress_from_the_config():
    from tr_serve.serve.builder import build_app

    cfg = TRServeConfig.from_args({"queue_timeout_s": 2.5, "max_concurrent_requests_per_key": 3})
    assert (cfg.queue_timeout_s, cfg.max_concurrent_requests_per_key) == (2.5, 3)
    default = TRServeConfig.from_args({})
    assert default.queue_timeout_s is None and default.max_concurrent_requests_per_key is None
    app = build_app({"queue_timeout_s": 2.5, "max_concurrent_requests_per_key": 3})
    limits = app._bound_deployment.init_kwargs["limits"]
    assert limits["queue_timeout_s"] == 2.5 and limits["max_concurrent_requests_per_key"] == 3
