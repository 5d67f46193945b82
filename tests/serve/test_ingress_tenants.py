"""The ingress hands each request its key's tenant, never the key (no Ray: a stand-in handle)."""

from __future__ import annotations

import asyncio

import httpx

from tr_serve.engine.request_context import SHARED_TENANT
from tr_serve.serve.ingress import OpenAIIngress, build_fastapi_app
from serve_testutil import AcceptedThenOk, LiveHandle

MODEL = "m"
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


class _Handle(LiveHandle):
    """A model server handle with one live replica that records each request's context."""

    def __init__(self):
        self.contexts = []

    @property
    def completions(self):
        handle = self

        class _C:
            def remote(self, body, request_id, context):
                handle.contexts.append(context)
                return AcceptedThenOk()
        return _C()


def _post_as(keys: list[str], tenants: dict, isolation: str, callers: list[str]):
    handle = _Handle()
    plain = next(c for c in OpenAIIngress.__mro__ if "__serve_build_asgi_app__" in vars(c))
    ingress = plain(llm_deployments={MODEL: handle}, model_cards={MODEL: {"id": MODEL, "object": "model"}},
                    api_keys=keys, tenants=tenants, isolation=isolation)

    async def run():
        transport = httpx.ASGITransport(app=build_fastapi_app(ingress))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for key in callers:
                r = await client.post("/v1/completions", json=BODY, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
    asyncio.run(run())
    return [c.tenant for c in handle.contexts]


def test_each_key_reaches_the_model_server_as_its_tenant_id():
    a, b, t1, t2 = _post_as(["key-a", "key-b"], {"team": ["key-t1", "key-t2"]}, "tenant",
                            ["key-a", "key-b", "key-t1", "key-t2"])
    assert a != b and t1 == t2 and len({a, b, t1}) == 3 and SHARED_TENANT not in (a, b, t1)
    assert not any("key" in t for t in (a, b, t1))


def test_one_key_or_isolation_none_is_the_shared_tenant():
    assert _post_as(["only"], {}, "tenant", ["only"]) == [SHARED_TENANT]
    assert _post_as(["a", "b"], {}, "none", ["a", "b"]) == [SHARED_TENANT, SHARED_TENANT]
