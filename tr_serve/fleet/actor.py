"""The matrix actor: one fleet-wide adjacency matrix per (model id, namespace), and beside it the
fleet's suffix corpus (fleet/corpus.py: the finished documents of the replicas' suffix indexes).

Why a named, detached Ray actor (:class:`ActorAddress`: ``tr_matrix:<model id>:<namespace>`` in
the Ray namespace ``tr_serve``; ``lifetime="detached"``, ``get_if_exists=True``, ``max_restarts=-1``) rather than a
Serve deployment:

* **Its state must outlive the app.** The matrix is the hot start; a Serve deployment is torn
  down and recreated with its application (``serve run`` of a new config, an upgrade, a rollback),
  which would throw the fleet's matrix away exactly when new replicas need it. A detached actor
  lives until it is stopped (:func:`stop_matrix_actor`) or the cluster goes.
* **It is keyed by model and namespace, not by application.** Several deployments or apps that
  serve the same model in the same namespace share it; a deployment is app-scoped.
* **It is a singleton with internal methods, not a request handler.** Replicas call it directly
  through an actor handle (no Serve router, queue, autoscaling or HTTP surface), and none of its
  methods is reachable by clients: no API returns matrix rows.
* **Creation is idempotent and failure is repaired by Ray.** Every replica calls
  ``get_if_exists=True`` with the same name, so whichever comes first creates it; with
  ``max_restarts=-1`` Ray restarts it after a crash and it reloads its newest good snapshot from
  disk. A replica that finds it gone re-resolves it by name (which re-creates it).

The corpus travels as the matrix does: replicas push the documents they finished with their
rows (``push``), the actor numbers them, publishes the whole corpus once per change (``corpus``:
an object-store reference) and writes it to disk beside each matrix snapshot (fleet/corpus_file.py).

Nothing on the token path waits for the actor: replicas push and poll from a background asyncio
task (:mod:`tr_serve.fleet.sync`) and only the final table copy runs between engine steps.

The actor is an asyncio actor, so its methods run one at a time on its event loop (a merge is
never interleaved with another); disk writes run in a worker thread on a copy of the state.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from tr_serve.fleet.config import DEFAULT_NAMESPACE, FleetSyncConfig
from tr_serve.fleet.corpus import DocumentBatch, FleetCorpus
from tr_serve.fleet.corpus_file import PREFIX as CORPUS_PREFIX
from tr_serve.fleet.corpus_file import load_newest_corpus, write_corpus
from tr_serve.fleet.merge import EMPTY, merge_push
from tr_serve.fleet.metrics import FleetMetrics
from tr_serve.fleet.snapshot import PREFIX as MATRIX_PREFIX
from tr_serve.fleet.snapshot import (Identity, MatrixState, load_newest, remove_stale_temp_files,
                                     write_snapshot)
from tr_serve.tr.suffix_index import DEFAULT_CAPACITY

DEFAULT_TENANT_MATRIX_ROWS = 8192  # as EngineConfig.tenant_matrix_rows

logger = logging.getLogger("tr_serve.fleet")


@dataclasses.dataclass(frozen=True)
class ActorAddress:
    """Where the matrix actor of one (model id, fleet namespace) lives: the named actor
    ``tr_matrix:<model id>:<namespace>`` in the Ray namespace ``tr_serve`` (Serve replicas run in
    "serve"). Replicas, the benches and :func:`stop_matrix_actor` all find it by this."""

    model_id: str
    namespace: str = DEFAULT_NAMESPACE
    ray_namespace: ClassVar[str] = "tr_serve"

    @classmethod
    def of(cls, model_id: str, namespace: str | None = None) -> "ActorAddress":
        return cls(model_id, namespace or DEFAULT_NAMESPACE)

    @property
    def name(self) -> str:
        return f"tr_matrix:{self.model_id}:{self.namespace}"


# what an actor and a replica must agree on (a snapshot's :class:`Identity`), in the actor's spec
IDENTITY_KEYS = tuple(f.name for f in dataclasses.fields(Identity))


def actor_spec(config: FleetSyncConfig, model_id: str, vocab_size: int, k: int, fingerprint: str,
               tenant_matrix_rows: int = DEFAULT_TENANT_MATRIX_ROWS) -> dict[str, Any]:
    """The actor's constructor argument: its :class:`Identity` (as ``IDENTITY_KEYS``) and its
    snapshot settings. The snapshot folder is resolved here, on the caller."""
    identity = Identity(model_id, int(vocab_size), int(k), fingerprint, config.namespace_name)
    return {
        **dataclasses.asdict(identity),
        "snapshot_folder": str(config.snapshot_folder(model_id)),
        "snapshot_interval_s": float(config.snapshot_interval_s),
        "keep_snapshots": int(config.keep_snapshots),
        "half_life_s": float(config.half_life_s),
        "suffix_index_tokens": int(config.suffix_index_tokens),
        "tenant_matrix_rows": int(tenant_matrix_rows),
    }


class MatrixActor:
    """Internal methods only (called by :class:`tr_serve.fleet.sync.MatrixSync`)."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = dict(spec)
        self.identity = Identity(**{key: spec[key] for key in IDENTITY_KEYS})
        self.address = ActorAddress.of(self.identity.model_id, self.identity.namespace)
        self.folder = Path(spec["snapshot_folder"])
        self.snapshot_interval_s = float(spec["snapshot_interval_s"])
        self.keep = int(spec["keep_snapshots"])
        self.half_life_s = float(spec["half_life_s"])
        self.epoch = uuid.uuid4().hex  # changes at every (re)start: replicas detect restarts by it
        self.metrics = FleetMetrics(self.identity.model_id, self.identity.namespace, "actor")
        self.loaded_from: str | None = None
        remove_stale_temp_files(self.folder, (MATRIX_PREFIX, CORPUS_PREFIX))
        loaded = None
        try:
            loaded = load_newest(self.folder, self.identity)
        except Exception as e:  # a folder we cannot list: start empty, never crash
            logger.warning("matrix actor %s: cannot read snapshots in %s (%s); starting empty",
                           self.address.name, self.folder, e)
        if loaded is not None:
            self.state, meta, path = loaded
            self.version = meta.version
            self.loaded_from = str(path)
        else:
            self.state = MatrixState.empty(self.identity.vocab_size, self.identity.k)
            self.version = 0
        self.saved_version = self.version
        self.rows_merged = 0
        self.corpus, self.corpus_loaded_from = self._load_corpus(int(spec.get("suffix_index_tokens", DEFAULT_CAPACITY)))
        self.saved_corpus_seq = self.corpus.last_seq
        self.documents_added = 0
        self._corpus_published: tuple[int, Any] | None = None  # (last seq, ObjectRef)
        self._published: tuple[int, float, Any] | None = None  # (version, published_at, ObjectRef)
        self._last_seq: dict[str, int] = {}
        # each named tenant's rows (tr/tenant_rows.py), in memory only: token -> row, least recently
        # written first, at most tenant_matrix_rows per tenant; the newest push of a row wins
        self.tenant_capacity = int(spec.get("tenant_matrix_rows", DEFAULT_TENANT_MATRIX_ROWS))
        self.tenant_rows: dict[str, OrderedDict[int, np.ndarray]] = {}
        self.tenant_version = 0
        self._tenants_published: tuple[int, Any] | None = None  # (tenant_version, ObjectRef)
        self._save_lock = asyncio.Lock()
        self._saver: asyncio.Task | None = None
        self.metrics.version.set(self.version)
        atexit.register(self._save_at_exit)
        logger.info("matrix actor %s started (epoch %s, version %d, %s; suffix corpus of %d documents)",
                    self.address.name, self.epoch[:8], self.version,
                    f"from {self.loaded_from}" if self.loaded_from else "empty", len(self.corpus))

    def _load_corpus(self, capacity: int) -> tuple[FleetCorpus, str | None]:
        try:
            loaded = load_newest_corpus(self.folder, self.identity)
        except Exception as e:  # a folder we cannot list: start empty, never crash
            logger.warning("matrix actor %s: cannot read suffix corpus snapshots in %s (%s); starting empty",
                           self.address.name, self.folder, e)
            loaded = None
        if loaded is None:
            return FleetCorpus(capacity), None
        return FleetCorpus.restore(loaded[0], capacity), str(loaded[1])

    # ---- replica-facing (internal) ---------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        self._ensure_saver()
        return {**{k: self.spec[k] for k in IDENTITY_KEYS}, "epoch": self.epoch, "version": self.version,
                "loaded_from": self.loaded_from, "saved_version": self.saved_version,
                "filled_rows": int(self.state.filled_rows().size), "rows_merged": self.rows_merged,
                "snapshot_folder": str(self.folder), "corpus_seq": self.corpus.last_seq,
                "corpus_documents": len(self.corpus), "corpus_tokens": self.corpus.num_tokens,
                "corpus_capacity": self.corpus.capacity, "corpus_loaded_from": self.corpus_loaded_from,
                "saved_corpus_seq": self.saved_corpus_seq, "documents_added": self.documents_added}

    async def state_version(self) -> dict[str, Any]:
        """The cheap poll."""
        self._ensure_saver()
        return {"epoch": self.epoch, "version": self.version, "corpus_seq": self.corpus.last_seq,
                "tenant_version": self.tenant_version}

    async def push(self, replica_id: str, seq: int, ids, rows, docs: DocumentBatch | None = None,
                   tenants: dict[str, tuple[Any, Any]] | None = None) -> dict[str, Any]:
        """Merge one replica's changed rows (the version grows when any row was merged), add its
        finished suffix-index documents ``docs`` to the corpus and each named tenant's changed
        rows (``tenants``: tenant id -> (ids [n], rows [n, k])) to that tenant's rows. A bad push
        is refused whole."""
        self._ensure_saver()
        tenant_batches = self._checked_tenant_rows(tenants)
        if docs is not None:
            if not isinstance(docs, DocumentBatch):
                raise ValueError(f"push with documents of type {type(docs).__name__}, expected a DocumentBatch")
            docs.check(self.identity.vocab_size, numbered=False)
        ids, rows = self._checked_rows(ids, rows, "row")
        last = self._last_seq.get(replica_id)
        merged = added = 0
        corpus_before = self.corpus.last_seq
        if last is None or seq > last:  # a duplicate or out-of-order (older) push is ignored
            self._last_seq[replica_id] = seq
            if docs is not None and len(docs):
                added = self.corpus.add(docs, replica_id)
                self.documents_added += added
                self.metrics.documents.inc(added)
            merged = merge_push(self.state.cands, self.state.scores, self.state.stamp, ids, rows.astype(np.int32),
                                time.time(), self.half_life_s)
            if tenant_batches:
                for tenant, (t_ids, t_rows) in tenant_batches.items():
                    self._put_tenant_rows(tenant, t_ids, t_rows)
                self.tenant_version += 1
            if merged:
                self.version += 1
                self.rows_merged += merged
                self.metrics.rows_merged.inc(merged)
                self.metrics.version.set(self.version)
        return {"epoch": self.epoch, "version": self.version, "merged_version": self.version, "merged": merged,
                "corpus_seq": self.corpus.last_seq, "corpus_seq_before": corpus_before, "documents_added": added,
                "tenant_version": self.tenant_version}

    def _checked_tenant_rows(self, tenants) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if tenants is None:
            return {}
        if not isinstance(tenants, dict):
            raise ValueError(f"push with tenant rows of type {type(tenants).__name__}, expected a dict")
        out = {}
        for tenant, (t_ids, t_rows) in tenants.items():
            if not isinstance(tenant, str):
                raise ValueError(f"push of tenant rows under a {type(tenant).__name__}, expected a tenant id")
            t_ids, t_rows = self._checked_rows(t_ids, t_rows, "tenant row")
            if t_ids.size:
                out[tenant] = (t_ids, t_rows.astype(np.int32))
        return out

    def _checked_rows(self, ids, rows, what: str) -> tuple[np.ndarray, np.ndarray]:
        """``ids`` [n] and ``rows`` [n, k] as arrays, or ValueError when the shapes disagree or an id
        or candidate is outside the vocabulary."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        rows = np.asarray(rows)
        vocab, k = self.identity.vocab_size, self.identity.k
        if rows.shape != (ids.size, k):
            raise ValueError(f"push of {ids.size} {what} ids with rows of shape {rows.shape}, expected ({ids.size}, {k})")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab or rows.min() < EMPTY or rows.max() >= vocab):
            raise ValueError(f"push with {what} ids or candidates outside the vocabulary")
        return ids, rows

    def _put_tenant_rows(self, tenant: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """A tenant's pushed rows: the newest wins; past the cap its least recently written rows go."""
        held = self.tenant_rows.setdefault(tenant, OrderedDict())
        for token, row in zip(ids.tolist(), rows):
            held.pop(token, None)
            held[token] = row
        while len(held) > self.tenant_capacity:
            held.popitem(last=False)

    def tenant_table(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Every named tenant's rows as (ids [n], rows [n, k]): what :meth:`tenant_snapshot` publishes."""
        k = self.identity.k
        return {t: (np.fromiter(held.keys(), dtype=np.int64, count=len(held)),
                    np.stack(list(held.values())) if held else np.empty((0, k), dtype=np.int32))
                for t, held in self.tenant_rows.items()}

    async def tenant_snapshot(self) -> dict[str, Any]:
        """The named tenants' rows, put in the object store once per ``tenant_version``; the
        ObjectRef inside a list, as :meth:`snapshot`'s. Each replica adopts every tenant's rows:
        a tenant's rows draft only for that tenant's requests there (tr/tenant_rows.py)."""
        import ray

        self._ensure_saver()
        if self._tenants_published is None or self._tenants_published[0] != self.tenant_version:
            self._tenants_published = (self.tenant_version, ray.put(self.tenant_table()))
        version, ref = self._tenants_published
        return {"epoch": self.epoch, "tenant_version": version, "ref": [ref]}

    async def snapshot(self) -> dict[str, Any]:
        """The current table, put in the object store once per version. The ObjectRef is returned
        inside a list so that Ray hands the reference over instead of resolving it."""
        import ray

        self._ensure_saver()
        if self._published is None or self._published[0] != self.version:
            self._published = (self.version, time.time(), ray.put(self.state.cands))
        version, published_at, ref = self._published
        return {"epoch": self.epoch, "version": version, "published_at": published_at, "ref": [ref]}

    async def corpus_snapshot(self) -> dict[str, Any]:
        """The suffix corpus in its numbered form (a DocumentBatch), put in the object store once per
        change; the ObjectRef inside a list, as :meth:`snapshot`'s."""
        import ray

        self._ensure_saver()
        if self._corpus_published is None or self._corpus_published[0] != self.corpus.last_seq:
            self._corpus_published = (self.corpus.last_seq, ray.put(self.corpus.batch()))
        last_seq, ref = self._corpus_published
        return {"epoch": self.epoch, "corpus_seq": last_seq, "ref": [ref]}

    async def save(self, force: bool = False) -> str | None:
        """Write a disk snapshot now if the version changed since the last one (or ``force``), and
        one of the suffix corpus if it changed. Returns the matrix snapshot's path, if one was written."""
        async with self._save_lock:
            await self._save_corpus(force)
            if not force and self.version == self.saved_version:
                return None
            version = self.version
            state = MatrixState(self.state.cands.copy(), self.state.scores.copy(), self.state.stamp.copy())
            t0 = time.perf_counter()
            try:
                path = await asyncio.to_thread(write_snapshot, self.folder, state, self.identity, version, self.keep)
            except Exception as e:  # a full or read-only disk: keep merging, try again later
                logger.warning("matrix actor: could not write a snapshot to %s: %s", self.folder, e)
                self.metrics.error("snapshot_write")
                return None
            self.metrics.snapshot_latency.observe(time.perf_counter() - t0)
            self.saved_version = version
            return str(path)

    async def _save_corpus(self, force: bool) -> None:
        last_seq = self.corpus.last_seq
        if last_seq == self.saved_corpus_seq and not (force and len(self.corpus)):
            return
        batch = self.corpus.batch()  # a copy: pushes go on meanwhile
        try:
            await asyncio.to_thread(write_corpus, self.folder, batch, self.identity, self.keep)
        except Exception as e:  # a full or read-only disk: keep serving, try again later
            logger.warning("matrix actor: could not write a suffix corpus snapshot to %s: %s", self.folder, e)
            self.metrics.error("corpus_write")
            return
        self.saved_corpus_seq = last_seq

    async def shutdown(self) -> None:
        """Final snapshot, then exit (no restart)."""
        import ray

        await self.save()
        ray.actor.exit_actor()

    # ---- internals ----------------------------------------------------------------------------
    def _ensure_saver(self) -> None:
        if self._saver is None or self._saver.done():
            self._saver = asyncio.get_running_loop().create_task(self._save_loop())

    async def _save_loop(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            try:
                await self.save()
            except Exception:  # never let the saver die
                logger.exception("matrix actor: snapshot failed")

    def _save_at_exit(self) -> None:
        if self.corpus.last_seq != self.saved_corpus_seq:
            try:
                write_corpus(self.folder, self.corpus.batch(), self.identity, self.keep)
                self.saved_corpus_seq = self.corpus.last_seq
            except Exception as e:
                logger.warning("matrix actor: final suffix corpus snapshot failed: %s", e)
        if self.version == self.saved_version:
            return
        try:
            write_snapshot(self.folder, self.state, self.identity, self.version, self.keep)
            self.saved_version = self.version
        except Exception as e:
            logger.warning("matrix actor: final snapshot failed: %s", e)


_remote_cls = None


def remote_actor_class():
    global _remote_cls
    if _remote_cls is None:
        import ray

        _remote_cls = ray.remote(MatrixActor)
    return _remote_cls


def get_or_create_actor(spec: dict[str, Any], num_cpus: float = 0.0):
    """The actor of ``spec``'s (model, namespace), created if it does not exist (blocking: call it
    off the event loop).

    ``scheduling_strategy="DEFAULT"``: a Serve replica with placement group bundles captures child
    actors into its group, which would tie the fleet's actor to the first replica's lifetime."""
    address = ActorAddress.of(spec["model_id"], spec["namespace"])
    return remote_actor_class().options(
        name=address.name, namespace=address.ray_namespace, lifetime="detached",
        get_if_exists=True, max_restarts=-1, num_cpus=num_cpus, scheduling_strategy="DEFAULT",
    ).remote(spec)


def get_actor(model_id: str, namespace: str | None = None):
    """The existing actor, or None."""
    import ray

    try:
        address = ActorAddress.of(model_id, namespace)
        return ray.get_actor(address.name, namespace=address.ray_namespace)
    except ValueError:
        return None


def stop_matrix_actor(model_id: str, namespace: str | None = None, timeout_s: float = 30.0) -> bool:
    """Write a final snapshot and stop the actor; False when there was none."""
    import ray

    handle = get_actor(model_id, namespace)
    if handle is None:
        return False
    try:
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError:
        pass  # the expected outcome: it exited
    except ray.exceptions.GetTimeoutError:
        ray.kill(handle, no_restart=True)
    return True
