"""Replica side of the fleet matrix: ``MatrixSync`` pushes this engine's changed rows to the matrix
actor and adopts the fleet's snapshot, from a background asyncio task.

Every ``sync_interval_s``:

1. **Take** (between steps, via ``AsyncEngine.call_between_steps``): ``take_dirty_rows()`` and a
   copy of those rows into a CPU shadow (``rows``, and per row the state ``PENDING``).
2. **Push** (off the token path): the pending rows go to ``actor.push``; the reply says at which
   actor version they were merged, which the shadow records per row. Without pending rows the
   task polls ``actor.state_version`` instead (two ints).
3. **Adopt** when the actor's version is newer than the adopted one: the snapshot ObjectRef comes
   from ``actor.snapshot`` (put once per version), the table is fetched from the object store into
   a private (on CUDA: pinned) CPU tensor off the token path; then, between steps,
   ``table.copy_(snapshot)`` (an asynchronous host-to-device copy on CUDA)
   and this replica's own rows that the snapshot does not contain yet (pending, in flight, or
   merged after the snapshot's version) are written back from the shadow.

When the only change since the adopted version is this replica's own push, nothing is fetched.

Named tenants' overlay rows (tr/tenant_rows.py) ride along: the take copies each overlay's rows
changed since the last take, the push carries them per tenant id, and when the actor's
``tenant_version`` is newer than the adopted one every tenant's merged rows are fetched and
written into the overlays between steps (a row changed here since the last take stays: it is
newer). A tenant's rows draft only for that tenant's requests on every replica. The actor keeps
them in memory (no file): a restarted actor relearns them from the pushes that follow.

The suffix index rides along (fleet/suffix_share.py): the take also copies the documents the
engine finished, the push carries them, and when the actor's corpus has documents of other
replicas this one has not indexed, the corpus object is fetched and they are indexed between
steps, a bounded number of tokens at a time.

Failure: an actor that is dead, restarting, slow, or a snapshot object that is lost (its owner,
the actor, died) is logged once per failure kind, counted, and retried at the next interval
(the actor is re-resolved by name, which re-creates it if it is gone). The engine keeps its last
good matrix all along. A restarted actor (new ``epoch``) gets this replica's unconfirmed rows
again and its snapshot is adopted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np
import torch

from tr_serve.engine.async_engine import AsyncEngine
from tr_serve.fleet.actor import (DEFAULT_TENANT_MATRIX_ROWS, IDENTITY_KEYS, ActorAddress, actor_spec,
                                  get_or_create_actor)
from tr_serve.fleet.config import FleetSyncConfig
from tr_serve.fleet.metrics import FleetMetrics
from tr_serve.fleet.snapshot import tokenizer_fingerprint
from tr_serve.fleet.suffix_share import IMPORT_TOKENS_PER_STEP, CorpusImport, SuffixShare
from tr_serve.tr.matrix import EMPTY

logger = logging.getLogger("tr_serve.fleet")

CLEAN = 0  # shadow row states; a positive value below IN_FLIGHT = merged at that actor version
IN_FLIGHT = 1 << 61
PENDING = 1 << 62
_BETWEEN_STEPS_TIMEOUT_S = 120.0  # a long prefill chunk on a slow CPU still fits
_CONNECT_TIMEOUT_S = 60.0  # creating the actor starts a worker process


class MatrixSync:
    """``engine`` is an ``EngineHandle`` with a matrix (``tr_serve/engine/core.py``): an
    ``AsyncEngine``, whose ``call_between_steps`` runs the table work on its step thread, or a plain
    ``Engine`` that nothing else steps while a sync runs (offline tools)."""

    def __init__(self, engine, config: FleetSyncConfig, *, model_id: str, tokenizer=None,
                 fingerprint: str | None = None, replica_id: str | None = None):
        self.engine = engine
        matrix = engine.matrix  # an EngineHandle (tr_serve/engine/core.py): AsyncEngine or Engine
        self.vocab_size, self.k = int(matrix.vocab_size), int(matrix.k)
        self.config = config
        self.model_id = model_id
        if fingerprint is None:
            fingerprint = tokenizer_fingerprint(tokenizer if tokenizer is not None else engine.tokenizer)
        self.spec = actor_spec(config, model_id, self.vocab_size, self.k, fingerprint,
                               getattr(engine.config, "tenant_matrix_rows", DEFAULT_TENANT_MATRIX_ROWS))
        self.name = ActorAddress.of(model_id, config.namespace_name).name
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # the suffix index's documents (None: not shared); an actor of an older release has no corpus
        self.suffix = SuffixShare(self.replica_id, self.vocab_size) if config.suffix_index else None
        self._actor_has_corpus: bool | None = None  # None: not known yet (the actor's info says)
        self._shadow_rows = torch.full((self.vocab_size, self.k), EMPTY, dtype=torch.int32)
        self._shadow_ver = torch.zeros(self.vocab_size, dtype=torch.int64)
        self._lock = threading.Lock()
        # named tenants' overlay rows taken and not pushed yet: tenant id -> token -> row
        self._tenant_pending: dict[str, dict[int, np.ndarray]] = {}
        self._adopted_tenant_version = 0  # the actor's tenant_version last adopted (this epoch)
        self.tenant_rows_pushed = 0
        self.tenant_rows_adopted = 0
        self._actor = None
        self._epoch: str | None = None
        self._adopted_version = -1  # in the current epoch; -1 = nothing adopted
        self._adopted_published_at: float | None = None
        self._seq = 0
        self._task: asyncio.Task | None = None
        self._round_lock: asyncio.Lock | None = None
        self._stopping = False
        self._failing: str | None = None
        self.metrics = FleetMetrics(model_id, config.namespace_name, "replica")
        # figures (read by tests, the benchmark and engine_stats)
        self.token_path_s = 0.0  # seconds spent between steps (take + adopt)
        self.token_path_calls = 0
        self.adopt_s: list[float] = []  # between-steps part of each adoption
        self.import_s: list[float] = []  # each between-steps chunk of a suffix corpus import
        self.pushes = 0
        self.rows_pushed = 0
        self.adoptions = 0
        self.restarts_seen = 0
        self.errors = 0
        self.last_error: str | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background task on the running event loop (returns at once)."""
        if self._task is None or self._task.done():
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"matrix-sync:{self.name}")

    async def stop(self, final_push: bool = True, timeout_s: float = 5.0) -> None:
        """Stop the task; optionally push the last changed rows (best effort, bounded)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        if final_push:
            try:
                result = await asyncio.wait_for(self.flush(), timeout_s)
            except (asyncio.TimeoutError, Exception) as e:
                result = {"error": f"{type(e).__name__}: {e}"}
            if result.get("error"):
                logger.info("matrix sync %s: final push skipped (%s)", self.name, result["error"])

    async def flush(self) -> dict[str, Any]:
        """Push the rows changed so far now (connecting first if needed); no adoption."""
        return await self.sync_once(adopt=False)

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the task never dies
                self._fail("internal", e, log_exc=True)
            await asyncio.sleep(self.config.sync_interval_s)

    # ---- one round --------------------------------------------------------------------------------
    async def sync_once(self, adopt: bool = True) -> dict[str, Any]:
        """Take -> push (or poll) -> adopt if newer. Never raises for actor or object-store failures:
        they are logged and reported in the result's ``error``. Rounds never overlap."""
        if self._round_lock is None:
            self._round_lock = asyncio.Lock()
        async with self._round_lock:
            return await self._sync_once(adopt)

    async def _sync_once(self, adopt: bool) -> dict[str, Any]:
        result: dict[str, Any] = {"pushed": 0, "adopted": None, "imported": None, "version": None, "error": None}
        actor = await self._connected()
        if actor is None:
            result["error"] = self.last_error
            return result
        await self._between_steps(self._take_between_steps)
        ids, rows = self._begin_push()
        docs = self.suffix.payload() if self._shares_suffix else None
        tenants = self._begin_tenant_push()
        try:
            if ids.size or docs is not None or tenants:
                self._seq += 1
                t0 = time.perf_counter()
                args = (self.replica_id, self._seq, ids, rows) + ((docs,) if docs is not None or tenants else ())
                args += (tenants,) if tenants else ()
                reply = await self._rpc(actor.push.remote(*args))
                self.metrics.push_latency.observe(time.perf_counter() - t0)
            else:
                reply = await self._rpc(actor.state_version.remote())
        except asyncio.CancelledError:  # stopped mid-push: those rows go out with the next push
            self._push_failed(ids)
            self._tenant_push_failed(tenants)
            raise
        except Exception as e:
            self._push_failed(ids)
            self._tenant_push_failed(tenants)
            self._fail("actor_unreachable", e, drop_actor=True)
            result["error"] = self.last_error
            return result
        if self.suffix is not None:
            self.suffix.pushed(reply if docs is not None else None)
            if docs is not None:
                self.metrics.documents.inc(int(reply.get("documents_added", 0)))
        self._check_epoch(reply["epoch"])
        version = int(reply["version"])
        result["version"] = version
        if ids.size:
            merged_version = int(reply["merged_version"])
            self._end_push(ids, merged_version)
            self.pushes += 1
            self.rows_pushed += int(ids.size)
            self.metrics.rows_pushed.inc(int(ids.size))
            result["pushed"] = int(ids.size)
            if reply.get("merged") and version == merged_version and self._adopted_version == merged_version - 1:
                # nothing but our own rows changed: our table is already that snapshot, plus our
                # local values of those rows
                self._adopted_version = version
                self._adopted_published_at = time.time()
                result["adopted"] = "own"
        if adopt and version > max(self._adopted_version, 0):
            result["adopted"] = await self._adopt(actor)
            if result["adopted"] is None:
                result["error"] = self.last_error
        if tenants:
            self.tenant_rows_pushed += sum(len(t_ids) for t_ids, _ in tenants.values())
        if adopt and int(reply.get("tenant_version", 0)) > self._adopted_tenant_version:
            if await self._adopt_tenants(actor) is None:
                result["error"] = self.last_error
        corpus_seq = int(reply.get("corpus_seq", 0))
        if adopt and self._shares_suffix and self.suffix.needs_import(corpus_seq):
            result["imported"] = await self._import_corpus(actor)
            if result["imported"] is None:
                result["error"] = self.last_error
        if result["error"] is None:
            self._recovered()
        self.metrics.version.set(max(self._adopted_version, 0))
        if self._adopted_published_at is not None:
            self.metrics.snapshot_age.set(max(0.0, time.time() - self._adopted_published_at))
        return result

    async def _box(self, call) -> dict | None:
        """What an actor method returned about its published object (``call``: ``actor.snapshot``
        or ``actor.corpus_snapshot``), its epoch checked; None when the actor is unreachable (logged)."""
        try:
            box = await self._rpc(call.remote())
        except Exception as e:
            self._fail("actor_unreachable", e, drop_actor=True)
            return None
        self._check_epoch(box["epoch"])
        return box

    async def _adopt(self, actor) -> int | None:
        box = await self._box(actor.snapshot)
        if box is None:
            return None
        version = int(box["version"])
        if version <= self._adopted_version:
            return self._adopted_version
        table = await self._fetch_published(box)
        if table is None:
            return None
        if getattr(table, "shape", None) != (self.vocab_size, self.k):
            self._fail("bad_snapshot", ValueError(f"snapshot shape {getattr(table, 'shape', None)}, "
                                                  f"expected ({self.vocab_size}, {self.k})"))
            return None
        snap = torch.from_numpy(np.array(table, dtype=np.int32, copy=True))  # ours, not object-store memory
        del table
        await self._between_steps(lambda engine: self._adopt_between_steps(engine, snap, version))
        self._adopted_version = version
        self._adopted_published_at = float(box["published_at"])
        self.adoptions += 1
        return version

    async def _adopt_tenants(self, actor) -> int | None:
        """Fetch every named tenant's merged rows and write them into this replica's overlays
        between steps; the tenant version adopted, or None on a failure (logged)."""
        box = await self._box(actor.tenant_snapshot)
        if box is None:
            return None
        version = int(box["tenant_version"])
        if version <= self._adopted_tenant_version:
            return self._adopted_tenant_version
        table = await self._fetch_published(box)
        if table is None:
            return None
        if not isinstance(table, dict):
            self._fail("bad_snapshot", ValueError(f"tenant rows of type {type(table).__name__}, expected a dict"))
            return None
        table = {t: (np.array(i, dtype=np.int64), np.array(r, dtype=np.int32)) for t, (i, r) in table.items()}
        await self._between_steps(lambda engine: self._adopt_tenants_between_steps(engine, table))
        self._adopted_tenant_version = version
        return version

    async def _fetch_published(self, box: dict):
        """The object an actor published (``box["ref"]``: the matrix snapshot or the suffix corpus),
        or None when it is lost or unreachable (logged); the reference is dropped either way."""
        import ray

        ref = box.pop("ref")[0]
        try:
            return await self._rpc(ref)
        except (ray.exceptions.ObjectLostError, ray.exceptions.RayActorError) as e:  # owner died: lost
            self._fail("snapshot_lost", e, drop_actor=True)
            return None
        except Exception as e:
            self._fail("snapshot_fetch", e)
            return None
        finally:
            del ref

    async def _import_corpus(self, actor) -> int | None:
        """Fetch the fleet's suffix corpus and index the documents of other replicas this one has
        not, between steps; returns how many were indexed (None: failed, logged)."""
        box = await self._box(actor.corpus_snapshot)
        if box is None:
            return None
        corpus = await self._fetch_published(box)
        if corpus is None:
            return None
        try:
            job = self.suffix.plan(corpus)  # checks it (a DocumentBatch, consistent, in the vocabulary)
        except (ValueError, TypeError, AttributeError) as e:
            self._fail("bad_corpus", ValueError(f"suffix corpus refused: {e}"))
            return None
        del corpus
        while not job.done:
            await self._between_steps(lambda engine: self._import_between_steps(engine, job))
        self.suffix.imported(job, int(box["corpus_seq"]))
        self.metrics.documents_imported.inc(job.documents)
        return job.documents

    # ---- between steps (engine thread) ----------------------------------------------------------
    def _take_locked(self, engine) -> None:
        ids = engine.matrix.take_dirty_rows()
        if ids.numel():
            rows = engine.matrix.rows(ids).to("cpu")
            ids = ids.to("cpu")
            with self._lock:
                self._shadow_rows[ids] = rows
                self._shadow_ver[ids] = PENDING

        overlays = getattr(engine, "tenant_matrices", None)
        if overlays is not None:
            taken = overlays.take_changed()
            with self._lock:
                for tenant, (t_ids, t_rows) in taken.items():
                    self._tenant_pending.setdefault(tenant, {}).update(zip(t_ids.tolist(), t_rows))

    def _adopt_tenants_between_steps(self, engine, table: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        t0 = time.perf_counter()
        self._take_locked(engine)  # rows changed here since the last take stay (they are newer)
        overlays = getattr(engine, "tenant_matrices", None)
        if overlays is not None:
            for tenant, (t_ids, t_rows) in table.items():
                if len(t_ids):
                    self.tenant_rows_adopted += overlays.adopt(tenant, t_ids, t_rows)
        self.token_path_s += time.perf_counter() - t0
        self.token_path_calls += 1

    def _take_between_steps(self, engine) -> None:
        t0 = time.perf_counter()
        self._take_locked(engine)
        if self._shares_suffix:
            self.suffix.take(engine)
        self.token_path_s += time.perf_counter() - t0
        self.token_path_calls += 1

    def _import_between_steps(self, engine, job: CorpusImport) -> None:
        t0 = time.perf_counter()
        index = getattr(engine, "suffix", None)
        if index is None:
            job.drop()
        else:
            job.run(index, IMPORT_TOKENS_PER_STEP)
        dt = time.perf_counter() - t0
        self.token_path_s += dt
        self.token_path_calls += 1
        self.import_s.append(dt)

    def _adopt_between_steps(self, engine, snap: torch.Tensor, version: int) -> None:
        t0 = time.perf_counter()
        self._take_locked(engine)
        with self._lock:
            keep = self._shadow_ver > version  # pending, in flight, or merged after the snapshot
            ids = keep.nonzero().flatten()
            rows = self._shadow_rows[ids]
            self._shadow_ver[(self._shadow_ver > CLEAN) & ~keep] = CLEAN  # the snapshot has them
        engine.matrix.adopt(snap, keep_ids=ids, keep_rows=rows)
        dt = time.perf_counter() - t0
        self.token_path_s += dt
        self.token_path_calls += 1
        self.adopt_s.append(dt)
        self.metrics.adopt_latency.observe(dt)

    # ---- shadow bookkeeping (event loop) ------------------------------------------------------------
    def _begin_push(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            ids = (self._shadow_ver == PENDING).nonzero().flatten()
            rows = self._shadow_rows[ids].clone()
            self._shadow_ver[ids] = IN_FLIGHT
        return ids.numpy(), rows.numpy()

    def _begin_tenant_push(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        with self._lock:
            pending, self._tenant_pending = self._tenant_pending, {}
        return {t: (np.fromiter(rows.keys(), dtype=np.int64, count=len(rows)), np.stack(list(rows.values())))
                for t, rows in pending.items() if rows}

    def _tenant_push_failed(self, tenants: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Tenant rows that did not reach the actor go out with the next push (unless taken again since)."""
        with self._lock:
            for tenant, (t_ids, t_rows) in tenants.items():
                again = self._tenant_pending.setdefault(tenant, {})
                for token, row in zip(t_ids.tolist(), t_rows):
                    again.setdefault(token, row)

    def _push_failed(self, ids: np.ndarray) -> None:
        """The push did not reach the actor: its rows and documents go out with the next one."""
        if ids.size:
            self._end_push(ids, None)
        if self.suffix is not None:
            self.suffix.pushed(None)

    def _end_push(self, ids: np.ndarray, merged_version: int | None) -> None:
        """Rows still in flight (not changed again meanwhile) become merged at ``merged_version``,
        or pending again when the push failed."""
        t = torch.from_numpy(ids)
        with self._lock:
            still = self._shadow_ver[t] == IN_FLIGHT
            self._shadow_ver[t[still]] = PENDING if merged_version is None else merged_version

    def _check_epoch(self, epoch: str) -> None:
        if self._epoch is None:
            self._epoch = epoch
            return
        if epoch == self._epoch:
            return
        logger.info("matrix sync %s: the matrix actor restarted (epoch %s -> %s); re-sending unconfirmed rows "
                    "and adopting its snapshot", self.name, self._epoch[:8], epoch[:8])
        with self._lock:
            merged = (self._shadow_ver > CLEAN) & (self._shadow_ver < IN_FLIGHT)
            self._shadow_ver[merged] = PENDING  # the old actor merged them; the new one may not have
        self._epoch = epoch
        self._adopted_version = -1
        self._adopted_tenant_version = 0
        self.restarts_seen += 1
        if self.suffix is not None:
            self.suffix.restarted()

    # ---- helpers ----------------------------------------------------------------------------------
    @property
    def _shares_suffix(self) -> bool:
        return self.suffix is not None and self._actor_has_corpus is not False

    async def _between_steps(self, fn: Callable) -> Any:
        if not isinstance(self.engine, AsyncEngine) or not self.engine.alive:
            return fn(self.engine)  # a plain Engine, or a stopped one: nothing steps it now
        return await asyncio.wait_for(self.engine.call_between_steps(fn), _BETWEEN_STEPS_TIMEOUT_S)

    async def _rpc(self, ref, timeout_s: float | None = None):
        timeout_s = timeout_s or self.config.rpc_timeout_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no reply within {timeout_s:.1f} s") from None

    async def _connected(self):
        if self._actor is not None:
            return self._actor
        try:
            handle = await asyncio.to_thread(get_or_create_actor, self.spec, self.config.actor_num_cpus)
            # a new actor needs a worker process first: allow more than one call's timeout
            info = await self._rpc(handle.info.remote(), max(self.config.rpc_timeout_s, _CONNECT_TIMEOUT_S))
        except Exception as e:
            self._fail("actor_unreachable", e)
            return None
        mismatch = [f"{k}: actor {info.get(k)!r} vs replica {self.spec[k]!r}" for k in IDENTITY_KEYS
                    if info.get(k) != self.spec[k]]
        if mismatch:
            shown = [m if "fingerprint" not in m else "tokenizer_fingerprint differs" for m in mismatch]
            self._fail("identity_mismatch", RuntimeError(
                f"actor {self.name} serves another matrix ({'; '.join(shown)}); not syncing: give this "
                "deployment its own fleet namespace"))
            return None
        self._actor = handle
        self._actor_has_corpus = "corpus_seq" in info
        if self.suffix is not None and not self._actor_has_corpus:
            logger.warning("matrix sync %s: the matrix actor has no suffix corpus (an older release); sharing "
                           "the matrix only until it is restarted", self.name)
        self._check_epoch(info["epoch"])
        return handle

    def _fail(self, kind: str, e: BaseException, drop_actor: bool = False, log_exc: bool = False) -> None:
        self.errors += 1
        self.last_error = f"{kind}: {type(e).__name__}: {e}".splitlines()[0][:500]
        self.metrics.error(kind)
        if drop_actor:
            self._actor = None  # re-resolve by name next time
        if self._failing != kind:
            logger.warning("matrix sync %s: %s; serving on with the last good matrix, retrying every %.1f s",
                           self.name, self.last_error, self.config.sync_interval_s, exc_info=log_exc)
        else:
            logger.debug("matrix sync %s: %s", self.name, self.last_error)
        self._failing = kind

    def _recovered(self) -> None:
        if self._failing is not None:
            logger.info("matrix sync %s: resumed (version %d)", self.name, max(self._adopted_version, 0))
            self._failing = None

    # ---- figures ------------------------------------------------------------------------------------
    @property
    def adopted_version(self) -> int:
        return self._adopted_version

    @property
    def epoch(self) -> str | None:
        return self._epoch

    def stats(self) -> dict[str, Any]:
        """Sync figures (no matrix contents)."""
        age = None if self._adopted_published_at is None else max(0.0, time.time() - self._adopted_published_at)
        return {"actor": self.name, "connected": self._actor is not None, "epoch": self._epoch,
                "adopted_version": max(self._adopted_version, 0), "pushes": self.pushes,
                "rows_pushed": self.rows_pushed, "adoptions": self.adoptions,
                "tenant_rows_pushed": self.tenant_rows_pushed, "tenant_rows_adopted": self.tenant_rows_adopted, "restarts_seen": self.restarts_seen,
                "errors": self.errors, "last_error": self.last_error, "snapshot_age_s": age,
                "token_path_s": self.token_path_s, "token_path_calls": self.token_path_calls,
                "adopt_ms_last": self.adopt_s[-1] * 1e3 if self.adopt_s else None,
                "adopt_ms_max": max(self.adopt_s) * 1e3 if self.adopt_s else None,
                "import_ms_max": max(self.import_s) * 1e3 if self.import_s else None,
                **(self.suffix.stats() if self.suffix is not None else {"suffix_shared": False})}


async def start_fleet_sync(engine, config: FleetSyncConfig | dict | None, *, model_id: str,
                           tokenizer) -> MatrixSync | None:
    """For a serving replica: a started :class:`MatrixSync` for ``engine`` (an ``AsyncEngine``), or
    ``None`` when fleet sync is off (tensor parallelism included: the replica's engine holds the
    matrix). ``model_id`` keys the fleet: use the id of the weights
    (``LoadedModel.model_id`` == ``EngineConfig.model``), not the served name. Returns at once:
    the actor is resolved (or created) by the background task, so a replica never waits for it."""
    if config is None:
        return None
    if not isinstance(config, FleetSyncConfig):
        config = FleetSyncConfig.model_validate(config)
    if not config.enabled:
        return None
    fingerprint = await asyncio.to_thread(tokenizer_fingerprint, tokenizer)  # ~50k items: off the loop
    sync = MatrixSync(engine, config, model_id=model_id, fingerprint=fingerprint)
    sync.start()
    logger.info("matrix sync %s: started (every %.1f s)", sync.name, config.sync_interval_s)
    return sync
