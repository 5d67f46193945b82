"""``FleetSyncConfig``: the options of the fleet-wide hot start (one pydantic model, frozen)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

from tr_serve.tr.suffix_index import DEFAULT_CAPACITY

DEFAULT_NAMESPACE = "default"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class FleetSyncConfig(BaseModel):
    """Replicas of one model (and namespace) share one adjacency matrix through a Ray actor, and
    the finished documents of their suffix indexes (fleet/corpus.py) where their engines have one.

    ``namespace`` separates fleets of the same model (tenants, A/B arms, traffic kinds): each
    (model id, namespace) pair has its own actor and its own snapshot folder.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=False, description="share the matrix across replicas")
    namespace: Optional[str] = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
                                     description="fleet name; default: 'default'")
    sync_interval_s: float = Field(default=2.0, gt=0, description="replica push/poll period")
    snapshot_interval_s: float = Field(default=60.0, gt=0, description="actor's disk snapshot period")
    snapshot_dir: Optional[str] = Field(default=None,
                                        description="snapshot root; default: <tr_serve cache>/matrix")
    keep_snapshots: int = Field(default=3, ge=1, description="snapshot files kept per (model, namespace)")
    half_life_s: float = Field(default=30.0, gt=0, description="merge recency: a vote's weight halves after this")
    rpc_timeout_s: float = Field(default=10.0, gt=0, description="timeout of one replica -> actor call")
    actor_num_cpus: float = Field(default=0.0, ge=0, description="CPUs reserved by the matrix actor")
    suffix_index: bool = Field(default=True, description="share the suffix index's finished documents too "
                                                         "(replicas whose engine has one)")
    suffix_index_tokens: int = Field(default=DEFAULT_CAPACITY, ge=1,
                                     description="tokens of documents the actor holds per tenant; "
                                                 "that tenant's oldest are evicted past it")

    @property
    def namespace_name(self) -> str:
        return self.namespace or DEFAULT_NAMESPACE

    def snapshot_root(self) -> Path:
        if self.snapshot_dir:
            return Path(self.snapshot_dir).expanduser()
        from tr_serve.model_loader import cache_root

        return cache_root() / "matrix"

    def snapshot_folder(self, model_id: str) -> Path:
        """``<root>/<model key>/<namespace>``: one folder per actor."""
        return self.snapshot_root() / model_key(model_id) / self.namespace_name


def model_key(model_id: str) -> str:
    """A file-name-safe, collision-free folder name for a model id (which may be a path)."""
    safe = _UNSAFE.sub("_", model_id).strip("._-")[-48:] or "model"
    return f"{safe}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"
