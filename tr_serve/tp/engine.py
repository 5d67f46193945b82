"""``TPEngine``: a drop-in for ``Engine`` (as ``AsyncEngine`` and the server use it) that runs the
model tensor-parallel over ``N`` Ray actors.

Each ``TPWorker`` runs a full ``Engine`` over its shard of the model (see ``tr_serve.tp.shard``);
all of them apply the same commands and step in lockstep, and only rank 0's outputs come back.
``add_request`` / ``abort`` are queued here and travel with the next ``step()``; the scheduler
state that ``AsyncEngine.stats()`` reads (``running``, ``prefilling``, ``waiting``, ``free_rows``,
``num_rows``) is mirrored from rank 0's reply to each step.

Placement: inside a placement group (a Serve replica deployed with ``placement_group_bundles``)
the workers take the group's last ``N`` bundles, so ``N + 1`` bundles leave bundle 0 to the
replica itself; otherwise the engine reserves its own ``STRICT_PACK`` group of ``N`` bundles
(``{"CPU": 1}`` each, or ``{"GPU": 1}`` on CUDA) and removes it on ``shutdown()``. The workers are
owned by the process that built the engine: when it dies (Serve replacing the replica), they die.

Failure: a worker that dies, raises or does not answer a step within ``step_timeout_s`` makes
``step()`` raise ``TPWorkerError``; the engine is then dead (every worker is killed, later calls
raise), ``AsyncEngine`` fails the requests in flight, and ``check_health()`` (which also pings
every worker with ``ping_timeout_s`` while idle) raises, so Serve replaces the replica.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import time
import uuid
from typing import Any, Callable

from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import check_prompt
from tr_serve.engine.request import RequestOutput
from tr_serve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WORKER_NAME_PREFIX = "tr_tp_worker"
_ids = itertools.count()


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker died, failed or hung; the engine serves nothing more."""


def worker_name(tag: str, rank: int) -> str:
    return f"{WORKER_NAME_PREFIX}:{tag}:{rank}"


def _serve_replica_tag() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # not inside a Serve replica
        return None


class TPEngine:
    def __init__(self, model, config: EngineConfig, tensor_parallel_size: int, *,
                 cpu_threads: int | None = None, step_timeout_s: float = 60.0, ping_timeout_s: float = 10.0,
                 init_timeout_s: float = 600.0, tag: str | None = None, placement_group=None):
        """``model``: a path / hub id / the embedded alias (each worker loads it), or a
        ``LoadedModel`` (shipped to the workers through the object store; small models, tests)."""
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.placement_group import placement_group as make_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tr_serve.tp.worker import TPWorker

        if tensor_parallel_size < 2:
            raise ValueError(f"TPEngine needs tensor_parallel_size >= 2, got {tensor_parallel_size} (use Engine)")
        if not ray.is_initialized():
            ray.init()
        n = tensor_parallel_size
        self.config = config
        self.world_size = n
        self.step_timeout_s = step_timeout_s
        self.ping_timeout_s = ping_timeout_s
        self.tag = tag or _serve_replica_tag() or uuid.uuid4().hex[:10]
        cuda = config.device.startswith("cuda")
        self._error: BaseException | None = None
        self._commands: list[tuple] = []
        self._pending_adds: list[str] = []
        self._known: set[str] = set()  # request ids rank 0's engine holds, plus queued adds
        self._waiting: list[str] = []
        self.prefilling: list[str] = []
        self.running: list[str] = []
        self._unfinished = False
        self.workers: list = []
        self.worker_names: list[str] = []
        self._own_pg = None

        pg = placement_group if placement_group is not None else get_current_placement_group()
        try:
            if pg is None:
                bundle = {"GPU": 1} if cuda else {"CPU": 1}
                pg = self._own_pg = make_placement_group([dict(bundle) for _ in range(n)], strategy="STRICT_PACK",
                                                         name=f"tr_tp:{self.tag}")
                try:
                    ray.get(pg.ready(), timeout=init_timeout_s)
                except ray.exceptions.GetTimeoutError:
                    raise TPWorkerError(f"could not reserve {n} x {bundle} on one node within {init_timeout_s:.0f} s "
                                        f"(cluster resources: {ray.cluster_resources()})") from None
            specs = pg.bundle_specs
            if len(specs) < n:
                raise ValueError(f"tensor_parallel_size={n} needs {n} placement group bundles for its workers "
                                 f"(plus one for the replica); the current placement group has {len(specs)}: {specs}")
            first = len(specs) - n
            worker_cls = ray.remote(TPWorker)
            for rank in range(n):
                index = first + rank
                spec = specs[index]
                shared = self._own_pg is None and index == 0  # the caller lives in bundle 0
                if cuda:
                    if spec.get("GPU", 0) < 1:
                        raise ValueError(f"bundle {index} {spec} has no GPU for tensor-parallel rank {rank}")
                    num_cpus, num_gpus = 0, 1
                else:
                    num_cpus, num_gpus = (0 if shared else min(1, spec.get("CPU", 0))), 0
                threads = cpu_threads or (max(1, int(spec.get("CPU", 1))) if not cuda else None)
                name = worker_name(self.tag, rank)
                self.worker_names.append(name)
                self.workers.append(worker_cls.options(
                    name=name, max_concurrency=2,  # ping answers while a step runs
                    num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index,
                        placement_group_capture_child_tasks=True),
                ).remote(rank, n, threads))
            nodes = ray.get([w.node_id.remote() for w in self.workers], timeout=init_timeout_s)
            loopback = len(set(nodes)) == 1
            init_method = ray.get(self.workers[0].rendezvous.remote(loopback), timeout=init_timeout_s)
            shipped = ray.put(model) if not isinstance(model, str) else model
            infos = ray.get([w.setup.remote(init_method, shipped, config, loopback, init_timeout_s)
                             for w in self.workers], timeout=init_timeout_s)
            self.tokenizer = ray.get(self.workers[0].tokenizer.remote(), timeout=init_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        info = infos[0]
        self.info = info
        self.num_rows: int = info["num_rows"]
        self.free_rows: list[int] = list(range(self.num_rows))
        self.vocab_size: int = info["vocab_size"]
        self.eos_ids = frozenset(info["eos_token_ids"])
        self.model_id: str = info["model_id"]
        logger.info("tensor parallel x%d (%s, %s init %s): %d heads / %d kv heads per rank; workers %s",
                    n, info["backend"], "loopback" if loopback else "node ip", init_method,
                    info["heads_per_rank"], info["kv_heads_per_rank"], self.worker_names)

    # ---- requests (queued; applied on every rank before the next step) ---------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        self._raise_if_dead()
        check_prompt(prompt_ids, self.config.max_model_len)
        request_id = request_id or f"tp-req-{next(_ids)}"
        if request_id in self._known:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not params.greedy and params.seed is None:
            # every rank must draw the same samples: one seed for all of them
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        self._commands.append(("add", request_id, list(prompt_ids), params))
        self._pending_adds.append(request_id)
        self._known.add(request_id)
        return request_id

    def abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))

    @property
    def waiting(self) -> list[str]:
        """Ids of requests not yet admitted (rank 0's queue after the last step, then the adds
        queued here since)."""
        return self._waiting + self._pending_adds

    def has_unfinished(self) -> bool:
        return bool(self._commands) or self._unfinished

    @property
    def matrix(self):
        raise AttributeError("the adjacency matrix lives in the tensor-parallel workers (one copy per rank); "
                             "use TPEngine.run_on_ranks(fn) to act on it")

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._raise_if_dead()
        commands, self._commands = self._commands, []
        self._pending_adds = []
        replies = self._gather([w.step.remote(commands) for w in self.workers], self.step_timeout_s, "step")
        digests = [r["digest"] for r in replies]
        if len(set(digests)) != 1:
            self._fail(TPWorkerError(f"tensor-parallel ranks diverged (state digests {digests})"))
        state = replies[0]["state"]
        self._waiting, self.prefilling, self.running = state["waiting"], state["prefilling"], state["running"]
        self.free_rows = state["free_rows"]
        self._unfinished = state["unfinished"]
        self._known = set(self._waiting) | set(self.prefilling) | set(self.running)
        return replies[0]["outputs"]

    def run_on_ranks(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> list:
        """``fn(engine)`` on every rank's ``Engine`` (call it between steps, e.g. through
        ``AsyncEngine.call_between_steps``); it must act identically on every rank."""
        self._raise_if_dead()
        return self._gather([w.call.remote(fn) for w in self.workers], timeout_s or self.step_timeout_s, "call")

    # ---- health -------------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise unless every worker answers a ping within ``ping_timeout_s``."""
        self._raise_if_dead()
        import ray

        refs = [w.ping.remote() for w in self.workers]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=self.ping_timeout_s)
        for rank, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    raise TPWorkerError(f"tensor-parallel worker {self.worker_names[rank]} is dead: {e}") from e
        if pending:
            hung = [self.worker_names[refs.index(r)] for r in pending]
            raise TPWorkerError(f"tensor-parallel worker(s) {hung} did not answer a ping in {self.ping_timeout_s} s")

    @property
    def alive(self) -> bool:
        return self._error is None

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        if self._own_pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._own_pg)
            except Exception:
                pass
            self._own_pg = None

    # ---- internals ----------------------------------------------------------------------------
    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise TPWorkerError(f"tensor-parallel engine is dead: {self._error}")

    def _fail(self, error: BaseException):
        """Mark the engine dead, kill the workers (peers of a dead rank may block in a collective)
        and raise ``error``."""
        self._error = error
        logger.error("tensor-parallel engine failed: %s", error)
        self.shutdown()
        raise error

    def _gather(self, refs: list, timeout_s: float, what: str) -> list:
        """Results of one call per rank; fails fast when any rank fails, and after ``timeout_s``."""
        import ray

        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                hung = [self.worker_names[refs.index(r)] for r in pending]
                self._fail(TPWorkerError(f"tensor-parallel {what} timed out after {timeout_s:.0f} s; no answer "
                                         f"from {hung}"))
            try:
                ray.get(ready[0])
            except Exception as e:
                rank = refs.index(ready[0])
                self._fail(TPWorkerError(f"tensor-parallel worker {self.worker_names[rank]} failed in {what}: "
                                         f"{type(e).__name__}: {e}"))
        return ray.get(refs)
