"""API keys to tenants: who a request belongs to, as a keyed hash that never holds the key.

A tenant is an API key, or a group of keys the config declares one tenant
(``tenants: {team-a: [key1, key2]}``). Its id is ``HMAC-SHA256(secret, group)`` cut to 16 bytes,
with the secret derived from every configured key (or ``TR_SERVE_TENANT_SECRET``): the same on
every replica of a deployment, so the fleet can keep a tenant's state apart, and never the key
itself in memory snapshots, files or logs. One tenant, or ``isolation: none``, maps every key to
the shared tenant: the single-tenant server works exactly as one with no keys.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from tr_serve.engine.request_context import SHARED_TENANT

TENANT_SECRET_ENV = "TR_SERVE_TENANT_SECRET"
TENANT_ID_BYTES = 16


def _secret(keys: list[str]) -> bytes:
    given = os.environ.get(TENANT_SECRET_ENV, "")
    if given:
        return hashlib.sha256(given.encode()).digest()
    digest = hashlib.sha256(b"tr_serve tenant secret\0")
    for key in sorted(set(keys)):
        digest.update(key.encode() + b"\0")
    return digest.digest()


class TenantDirectory:
    """``groups``: each API key's group (a key not declared in a group is its own). ``isolated``:
    False maps every key to the shared tenant (``isolation: none``)."""

    def __init__(self, groups: dict[str, str], isolated: bool = True):
        secret = _secret(list(groups))
        distinct = set(groups.values())
        shared = not isolated or len(distinct) <= 1
        ids = {g: SHARED_TENANT if shared else "t-" + hmac.new(secret, b"group\0" + g.encode(),
                                                                hashlib.sha256).hexdigest()[: 2 * TENANT_ID_BYTES]
               for g in distinct}
        # the keys as bytes for the constant-time compare, each with its tenant id (not its group)
        self._keys = [(k.encode(), ids[g]) for k, g in sorted(groups.items())]
        self.isolated = not shared

    @classmethod
    def from_config(cls, api_keys: list[str], tenants: dict[str, list[str]], isolation: str) -> "TenantDirectory":
        groups = {k: "key\0" + k for k in api_keys}
        for name, keys in tenants.items():
            for k in keys:
                groups[k] = "tenant\0" + name
        return cls(groups, isolated=isolation != "none")

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def keys(self) -> list[bytes]:
        return [k for k, _ in self._keys]

    def tenant_of(self, token: bytes) -> str | None:
        """The tenant of a bearer token, or None for an unknown one. Compares against every key,
        so the time does not depend on which one matched."""
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(token, key):
                found = tenant
        return found
