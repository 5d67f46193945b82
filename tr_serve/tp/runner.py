"""``TPModelRunner``: the runner contract of ``ModelRunner`` (``tr_serve/runner/model_runner.py``)
over ``N`` tensor-parallel Ray actors, so that the replica's one ordinary ``Engine`` drives them.

The driver-worker shape of nano-vllm and vLLM: the replica's ``Engine`` schedules, drafts, accepts,
samples, recycles, keeps the budget and the stop rules once, on the replica; each call of the
runner contract goes to every ``TPWorker`` (``tr_serve/tp/worker.py``), which holds only its weight
shard and its KV-cache shard and runs the forward (all-reducing with the other ranks); rank 0 sends
back what the engine needs. Nothing else of the engine is replicated, so there is no lockstep to
keep and nothing for the ranks to disagree on: fleet sync and the budget's online latency
correction work under TP unchanged, and the budget's latency table is measured through this
runner (its forwards include the round trip to the workers, which is what a step costs).

What comes back: token ids, exactly what ``ModelRunner.prefill_step`` / ``verify_step`` return
(runner/step_io.py): rank 0 reduces its logits where they are (argmax, the matrix's top-k, the
sampled rows' draws) and sends ``[nodes, 1 + K]`` ids, about 93 KB for 32 rows of 81 nodes at
K = 8 whatever the vocabulary (full float32 logits were 1.33 GB at Llama-3's). The other ranks run
the layers (their all-reduces) and skip the LM head. ``tr_serve/bench/tp.py`` reports the bytes
(``bytes_back_per_step``).

Messages: each forward is one Ray call per rank plus its reply (``2 N`` per step); ``free`` and
``compact`` do not cost a message of their own: they are queued and travel, in order, with the
next forward (``length()`` answers from a mirror of the cache lengths kept here, exactly as the
ranks' caches will have them).

Placement (the rules: ``tr_serve/tp/placement.py``): inside a placement group (a Serve replica
deployed with ``placement_group_bundles``) the workers take the group's last ``N`` bundles, so
``N + 1`` bundles leave bundle 0 to the replica itself; otherwise the runner reserves its own
``STRICT_PACK`` group of ``N`` bundles (``{"CPU": worker_cpus}`` each, or ``{"GPU": 1, "CPU":
worker_cpus}`` on CUDA) and removes it on ``shutdown()``. Each worker reserves ``worker_cpus``
(default: its bundle's CPUs) and runs that many torch threads. On CUDA every worker of a node sees
the node's GPUs of the group and selects its own by local rank, as vLLM and Ray Train place them;
NCCL's communicator is created, and warmed up by one all-reduce, during start-up. The workers are
owned by the process that built the runner: when it dies (Serve replacing the replica), they die.

Failure: a worker that dies, raises or does not answer a call within ``step_timeout_s`` makes the
call raise ``TPWorkerError``; the runner is then dead (every worker is killed, later calls raise),
the engine's step raises, ``AsyncEngine`` fails the requests in flight, and ``check_health()``
(which also pings every worker within ``ping_timeout_s``) raises, so Serve replaces the replica.
Start-up (placement, loading each rank's shard, the process group and its warm-up all-reduce, the
kernel plan) must finish within ``init_timeout_s``; each forward within ``step_timeout_s`` (both in
the Serve config).
"""

from __future__ import annotations

import logging
import pickle
import time
import uuid
from dataclasses import dataclass

import torch

from tr_serve.engine.config import EngineConfig
from tr_serve.runner.step_io import NextTokens, PrefillOutput, StepRunner, StepSampling
from tr_serve.tp.placement import (DEFAULT_INIT_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S, GPUPlacement, gpu_placements,
                                   own_group_bundle, worker_resources)

logger = logging.getLogger(__name__)

WORKER_NAME_PREFIX = "tr_tp_worker"


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker died, failed or hung; the runner serves nothing more."""


def worker_name(tag: str, rank: int) -> str:
    return f"{WORKER_NAME_PREFIX}:{tag}:{rank}"


def _serve_replica_tag() -> str | None:
    try:
        from ray import serve

        return serve.get_replica_context().replica_tag
    except Exception:  # not inside a Serve replica
        return None


@dataclass(frozen=True)
class TPKernels:
    """The runner's ``kernel_plan``: it keys the latency calibration (``calibration_key``), so a
    table measured at one world size or kernel plan is never used at another."""

    world_size: int
    backend: str
    rank_plan: str  # repr of rank 0's KernelPlan (None when torch's own linears)


@dataclass
class TransferStats:
    """What the driver exchanged with the workers (``tr_serve/bench/tp.py`` reports it)."""

    forwards: int = 0
    messages: int = 0  # Ray calls + replies
    bytes_out: int = 0  # pickled call payload (put once in the object store, read by every rank)
    bytes_back: int = 0  # tensor bytes of rank 0's reply
    seconds: float = 0.0  # wall time of the forwards, round trip included


class TPModelRunner(StepRunner):
    def __init__(self, model, config: EngineConfig, tensor_parallel_size: int, *, cpu_threads: int | None = None,
                 worker_cpus: float | None = None, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 ping_timeout_s: float = 10.0, init_timeout_s: float = DEFAULT_INIT_TIMEOUT_S,
                 tag: str | None = None, placement_group=None, measure_bytes: bool = False,
                 sync_audit: bool = False):
        """``model``: a path / hub id / the embedded alias (each worker reads its own slices), or a
        ``LoadedModel`` (shipped to the workers through the object store; small models, tests).
        ``worker_cpus``: CPUs each worker reserves in its bundle (default: the bundle's); ``cpu_threads``:
        the workers' torch threads (default: from their CPUs)."""
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.placement_group import placement_group as make_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tr_serve.tp.worker import TPWorker

        if tensor_parallel_size < 2:
            raise ValueError(f"TPModelRunner needs tensor_parallel_size >= 2, got {tensor_parallel_size} "
                             "(use ModelRunner)")
        if not ray.is_initialized():
            ray.init()
        n = tensor_parallel_size
        self.config = config
        self.world_size = n
        self.step_timeout_s = step_timeout_s
        self.ping_timeout_s = ping_timeout_s
        self.init_timeout_s = init_timeout_s
        self.measure_bytes = measure_bytes
        self.sync_audit = sync_audit  # the workers count forced device syncs per step (tests)
        self.tag = tag or _serve_replica_tag() or uuid.uuid4().hex[:10]
        cuda = config.device.startswith("cuda")
        self._error: BaseException | None = None
        self._pending: list[tuple] = []  # free / compact calls, sent with the next forward
        self.workers: list = []
        self.worker_names: list[str] = []
        self._own_pg = None
        self.transfer = TransferStats()
        # the runner contract; num_rows, max_len, kernel_plan once allocate() ran
        self.device = torch.device("cpu")  # where the logits arrive: the replica's host memory
        self.num_rows: int | None = None
        self.max_len: int | None = None
        self.kernel_plan: TPKernels | None = None
        self.forwards = 0
        self.device_name: str | None = None
        self._lens: torch.Tensor | None = None
        self.gpu_placements: list[GPUPlacement] = []  # per rank, on CUDA

        pg = placement_group if placement_group is not None else get_current_placement_group()
        try:
            if pg is None:
                bundle = own_group_bundle(cuda, worker_cpus)
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
                shared = self._own_pg is None and index == 0  # the caller lives in bundle 0
                res = worker_resources(specs[index], index=index, rank=rank, cuda=cuda, worker_cpus=worker_cpus,
                                       shared=shared, threads=cpu_threads)
                name = worker_name(self.tag, rank)
                self.worker_names.append(name)
                self.workers.append(worker_cls.options(
                    name=name, max_concurrency=2,  # ping answers while a forward runs
                    num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=index,
                        placement_group_capture_child_tasks=True),
                ).remote(rank, n, res.threads))
            where = self._gather([w.placement_info.remote() for w in self.workers], init_timeout_s, "start-up")
            loopback = len({node for node, _ in where}) == 1
            if cuda:  # before any CUDA call in the workers: each sees its node's GPUs of the group
                self.gpu_placements = gpu_placements(where)
                self._gather([w.place.remote(p) for w, p in zip(self.workers, self.gpu_placements)],
                             init_timeout_s, "start-up")
            init_method = self._gather([self.workers[0].rendezvous.remote(loopback)], init_timeout_s,
                                       "start-up", ranks=[0])[0]
            shipped = ray.put(model) if not isinstance(model, str) else model
            infos = self._gather([w.setup.remote(init_method, shipped, config, loopback, init_timeout_s)
                                  for w in self.workers], init_timeout_s, "start-up")
            self.tokenizer = self._gather([self.workers[0].tokenizer.remote()], init_timeout_s, "start-up",
                                          ranks=[0])[0]
        except BaseException:
            self.shutdown()
            raise
        info = infos[0]
        self.info = info
        self.loopback = loopback
        self.init_method = init_method
        self.vocab_size: int = info["vocab_size"]
        self.dtype: torch.dtype = getattr(torch, info["dtype"])
        self.eos_token_ids: tuple[int, ...] = tuple(info["eos_token_ids"])
        self.model_id: str = info["model_id"]
        logger.info("tensor parallel x%d (%s, %s init %s): %d heads / %d kv heads per rank; workers %s%s",
                    n, info["backend"], "loopback" if loopback else "node ip", init_method,
                    info["heads_per_rank"], info["kv_heads_per_rank"], self.worker_names,
                    "".join(f"; rank {r}: CUDA_VISIBLE_DEVICES={p.cuda_visible_devices} local rank {p.local_rank}"
                            for r, p in enumerate(self.gpu_placements)))

    # ---- building the engine -------------------------------------------------------------------
    @property
    def loaded(self):
        """A ``LoadedModel`` for ``Engine`` (tokenizer, ids); its ``model`` is None: the weights
        live in the workers, and the engine only reaches them through this runner."""
        from tr_serve.model_loader import LoadedModel

        return LoadedModel(None, self.tokenizer, self.model_id, self.eos_token_ids)

    def allocate(self, max_len: int) -> "TPModelRunner":
        """``Engine``'s runner factory: every rank builds its ``ModelRunner`` (runner/factory.py:
        KV-cache shard of rows of ``max_len`` tokens, kernel plan); returns this runner."""
        from tr_serve.runner import startup_work

        self._raise_if_dead()
        c = self.config
        work = startup_work.current()  # a deferring start-up: the ranks measure an uncached plan after ready
        replies = self._gather([w.allocate.remote(max_len, c.max_num_seqs, c.kv_cache_memory_gb, c.cpu_kernels,
                                                  self.sync_audit, work is not None, c.decoder) for w in self.workers],
                               self.init_timeout_s, "start-up")
        rows = {r["num_rows"] for r in replies}
        if len(rows) != 1:
            self._fail(TPWorkerError(f"tensor-parallel ranks allocated different KV-cache rows: {sorted(rows)}"))
        self.num_rows = replies[0]["num_rows"]
        self.max_len = max_len
        self.kernel_plan = TPKernels(self.world_size, self.info["backend"], replies[0]["kernel_plan"])
        # the budget's latency table is keyed by where the forwards run: the workers' device, x world size
        self.device_name = f"{replies[0]['device_name']} x tp{self.world_size}"
        self._lens = torch.zeros(self.num_rows, dtype=torch.long)
        if work is not None and any(r["startup_pending"] for r in replies):
            work.add(_WorkersStartup(self))
        return self

    def advance_startup(self, seconds: float) -> bool:
        """Every rank's deferred start-up work (its kernel plan's measurement) for about ``seconds``,
        the ranks at once; called between steps. True once every rank is done; ``kernel_plan``
        then names rank 0's plan."""
        self._raise_if_dead()
        replies = self._gather([w.advance_startup.remote(seconds) for w in self.workers],
                               self.step_timeout_s + seconds, "start-up work")
        done = all(r["done"] for r in replies)
        if done:
            self.kernel_plan = TPKernels(self.world_size, self.info["backend"], replies[0]["kernel_plan"])
        return done

    # ---- the runner contract ---------------------------------------------------------------------
    def length(self, row: int) -> int:
        return int(self._lens[row])

    def free(self, row: int) -> None:
        self._raise_if_dead()
        self._pending.append(("free", int(row)))
        self._lens[row] = 0

    def reuse_prefix(self, row: int, source: int, length: int) -> None:
        self._raise_if_dead()
        self._pending.append(("reuse_prefix", int(row), int(source), int(length)))
        self._lens[row] = length

    def compact(self, rows: torch.Tensor, keep: list[torch.Tensor]) -> None:
        self._raise_if_dead()
        rows = rows.cpu()
        keep = [k.cpu() for k in keep]
        self._pending.append(("compact", rows, keep))
        for row, k in zip(rows.tolist(), keep):
            self._lens[row] += len(k)

    def prefill_step(self, rows: torch.Tensor, prompts: list[list[int]], sampling: StepSampling,
                     seed_positions: list[list[int]] | None = None) -> PrefillOutput:
        """As ``ModelRunner.prefill_step``: rank 0 reduces its logits to ids and sends those back."""
        rows = rows.cpu()
        result = self._forward(("prefill_step", rows, [list(p) for p in prompts], sampling, seed_positions))
        for row, p in zip(rows.tolist(), prompts):
            self._lens[row] += len(p)
        return result

    def verify_step(self, rows: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor,
                    lengths: torch.Tensor | None, sampling: StepSampling) -> NextTokens:
        """As ``ModelRunner.verify_step``: every real node's next token and top-k ids, from rank 0."""
        lengths = lengths.cpu() if lengths is not None else None
        return self._forward(("verify_step", rows.cpu(), tokens.cpu(), depths.cpu(), tree_mask.cpu(), lengths,
                              sampling))

    # ---- health ---------------------------------------------------------------------------------
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
    def _forward(self, op: tuple):
        """The queued free / compact calls and ``op`` on every rank: one Ray call each (the payload
        put once in the object store); rank 0's result."""
        import ray

        self._raise_if_dead()
        ops, self._pending = self._pending + [op], []
        self.forwards += 1
        t0 = time.perf_counter()
        payload = ray.put(ops)
        result = self._gather([w.run.remote(payload) for w in self.workers], self.step_timeout_s, "step",
                              detail=op[0])[0]
        t = self.transfer
        t.seconds += time.perf_counter() - t0
        t.forwards += 1
        t.messages += 2 * self.world_size
        if self.measure_bytes:
            t.bytes_out += len(pickle.dumps(ops))
            t.bytes_back += len(pickle.dumps(result))
        return result

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise TPWorkerError(f"tensor-parallel runner is dead: {self._error}")

    def _fail(self, error: BaseException):
        """Mark the runner dead, kill the workers (peers of a dead rank may block in a collective)
        and raise ``error``."""
        self._error = error
        logger.error("tensor-parallel runner failed: %s", error)
        self.shutdown()
        raise error

    def _gather(self, refs: list, timeout_s: float, what: str, ranks: list[int] | None = None,
                detail: str | None = None) -> list:
        """Results of one call per rank; fails fast when any rank fails, and after ``timeout_s``."""
        import ray

        names = [self.worker_names[r] for r in (ranks if ranks is not None else range(len(refs)))]
        where = f"{what} ({detail})" if detail else what
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                hung = [names[refs.index(r)] for r in pending]
                self._fail(TPWorkerError(f"tensor-parallel {what} timed out after {timeout_s:.0f} s; no answer "
                                         f"from {hung}" + (f" ({detail})" if detail else "")))
            try:
                ray.get(ready[0])
            except Exception as e:
                rank = refs.index(ready[0])
                self._fail(TPWorkerError(f"tensor-parallel worker {names[rank]} failed in {where}: "
                                         f"{type(e).__name__}: {e}"))
        return ray.get(refs)


class _WorkersStartup:
    """The replica's side of its workers' deferred start-up work (runner/startup_work.py)."""

    name = "tensor-parallel ranks' kernel plans"

    def __init__(self, runner: TPModelRunner):
        self.runner = runner

    def advance(self, seconds: float, runner=None, matrix=None) -> bool:
        return self.runner.advance_startup(seconds)


def tp_engine(model, config: EngineConfig, tensor_parallel_size: int, *, matrix=None, timer=None, **runner_options):
    """The replica's ordinary ``Engine`` (``matrix``, ``timer`` as there) over a ``TPModelRunner``
    (``runner_options`` go to it). The runner is ``engine.runner``; ``engine.shutdown()`` (the
    ``EngineCore`` contract, engine/core.py) releases the workers."""
    from tr_serve.engine.engine import Engine

    runner = TPModelRunner(model, config, tensor_parallel_size, **runner_options)
    try:
        return Engine(runner.loaded, config, matrix=matrix, timer=timer, runner=runner.allocate)
    except BaseException:
        runner.shutdown()
        raise


__all__ = ["TPKernels", "TPModelRunner", "TPWorkerError", "TransferStats", "tp_engine", "worker_name"]
