"""Who a request belongs to and what it allows: made once at the HTTP edge, carried whole to the engine.

Why one object: the tenant and the per-request switches cross the ingress, a Ray call, the server
and the engine; one frozen value keeps every hop's signature the same as switches are added.
"""

from __future__ import annotations

from dataclasses import dataclass

from tr_serve.tr.suffix_index import DEFAULT_NAMESPACE

# the tenant of every request on a server with no keys, or with isolation off: what it learns is
# shared by every request (the single-tenant case, which loses nothing by isolation)
SHARED_TENANT = DEFAULT_NAMESPACE


@dataclass(frozen=True)
class RequestContext:
    """``tenant``: a keyed hash of the caller's API key (never the key); :data:`SHARED_TENANT` on a
    single-tenant server. ``speculation``: False verifies no draft for this request (plain decoding,
    same output). ``learn``: False keeps everything this request sends or receives out of every
    index and matrix row (it still drafts from what is already there)."""

    tenant: str = SHARED_TENANT
    speculation: bool = True
    learn: bool = True

    @property
    def shared(self) -> bool:
        """True when what this request teaches may draft for every other request."""
        return self.tenant == SHARED_TENANT


DEFAULT_CONTEXT = RequestContext()
