"""API keys to tenants (serve/tenants.py) and the request's ``tr`` switches (no Ray)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tr_serve.engine.request_context import SHARED_TENANT, RequestContext
from tr_serve.serve.protocol import ChatCompletionRequest
from tr_serve.serve.tenants import TenantDirectory


def test_each_key_is_a_tenant_and_a_declared_group_is_one():
    d = TenantDirectory.from_config(["k1", "k2"], {"team": ["k3", "k4"]}, "tenant")
    ids = {k: d.tenant_of(k.encode()) for k in ("k1", "k2", "k3", "k4")}
    assert ids["k3"] == ids["k4"] and len({ids["k1"], ids["k2"], ids["k3"]}) == 3
    assert SHARED_TENANT not in ids.values()
    assert all("k" not in t[2:] for t in ids.values())  # a hash, never the key
    assert d.tenant_of(b"nope") is None
    again = TenantDirectory.from_config(["k2", "k1"], {"team": ["k4", "k3"]}, "tenant")
    assert again.tenant_of(b"k1") == ids["k1"]  # the same ids on every replica of the deployment


def test_one_tenant_or_isolation_none_is_the_shared_tenant():
    assert TenantDirectory.from_config(["only"], {}, "tenant").tenant_of(b"only") == SHARED_TENANT
    assert TenantDirectory.from_config([], {"t": ["a", "b"]}, "tenant").tenant_of(b"b") == SHARED_TENANT
    d = TenantDirectory.from_config(["a", "b"], {}, "none")
    assert d.tenant_of(b"a") == d.tenant_of(b"b") == SHARED_TENANT


def test_the_tr_field_only_takes_away_and_refuses_unknown_keys():
    base = RequestContext(tenant="t-x")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(body).request_context(base) == base
    off = ChatCompletionRequest.model_validate({**body, "tr": {"speculation": "off", "learn": False}})
    assert off.request_context(base) == RequestContext(tenant="t-x", speculation=False, learn=False)
    for bad in ({"tenant": "t-y"}, {"speculation": "maybe"}, {"learn": "no"}):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate({**body, "tr": bad})
