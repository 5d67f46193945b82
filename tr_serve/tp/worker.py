"""One tensor-parallel rank: this rank's shard of the weights and of the KV cache, and nothing else.

A ``TPWorker`` holds a local ``ModelRunner`` over its shard (``tr_serve.tp.loading`` /
``tr_serve.tp.shard``: a third of the heads and of the MLP at tp=3, replicated embeddings, norms and
``lm_head``) and runs the runner calls that ``TPModelRunner`` (``tr_serve/tp/runner.py``) sends it:
``prefill`` / ``verify`` after the queued ``free`` / ``compact`` calls, in the order the engine
made them. Every rank gets the same calls; the shards' partial sums meet in the all-reduces after
``o_proj`` and ``down_proj``, so every rank computes the same hidden states and logits, and only
rank 0 sends its result back. There is no scheduler, matrix, sampler or request here: the
replica's one ``Engine`` decides everything, so the ranks cannot diverge.

On CUDA the worker is placed before anything touches CUDA (``place``): every worker of a node sees
the node's GPUs of the group and selects its own (``tr_serve/tp/placement.py`` says why), and
``setup`` creates the NCCL communicator and runs one warm-up all-reduce, so the first timed forward
creates nothing.

The class is a plain Python class: ``TPModelRunner`` wraps it with ``ray.remote``; tests can drive
it directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Callable

import torch

from tr_serve.tp.placement import (DEFAULT_INIT_TIMEOUT_S, WARM_UP_ELEMENTS, GPUPlacement, apply_gpu_placement,
                                   process_group_options)

logger = logging.getLogger(__name__)


def loopback_interface() -> str | None:
    """Name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in names:
        if name == "lo" or name.startswith("lo0"):
            return name
    return next((n for n in names if n.startswith("lo")), None)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TPWorker:
    """Rank ``rank`` of ``world_size``. Call order: ``placement_info`` on every rank, ``place``
    on every rank (CUDA only), ``rendezvous`` (rank 0 only), ``setup`` on every rank at once (it
    blocks until all ranks joined), ``allocate`` on every rank, then ``run`` on every rank for
    each forward the engine asks for."""

    def __init__(self, rank: int, world_size: int, cpu_threads: int | None = None):
        self.rank = rank
        self.world_size = world_size
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        self.placement: GPUPlacement | None = None
        self.loaded: Any = None  # set by load()
        self.runner: Any = None  # set by allocate()
        self.audit = None  # a SyncAudit when allocate(sync_audit=True)
        self.sync_counts: list[int] = []  # forced device-to-host syncs per run(), when audited
        from tr_serve.runner.startup_work import StartupWork

        self.startup = StartupWork()  # this rank's kernel plan measurement, when allocate(defer=True) left it for later

    # ---- start-up -----------------------------------------------------------------------------
    def placement_info(self) -> tuple[str, list[str]]:
        """(Ray node id, the GPU ids Ray gave this worker): what ``gpu_placements`` maps."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), list(context.get_accelerator_ids().get("GPU", []))

    def place(self, placement: GPUPlacement) -> None:
        """See the node's GPUs of the group (``CUDA_VISIBLE_DEVICES``), before any CUDA call; ``setup``
        then selects ``placement.local_rank``."""
        apply_gpu_placement(placement, os.environ, cuda_initialized=torch.cuda.is_initialized())
        self.placement = placement

    def rendezvous(self, loopback: bool) -> str:
        """``tcp://ip:port`` on this node for ``init_process_group`` (rank 0 listens there)."""
        import ray

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def setup(self, init_method: str, model, config, loopback: bool, timeout_s: float = DEFAULT_INIT_TIMEOUT_S) -> dict:
        """Load this rank's shard (``model`` is a path / alias, read slice by slice, or a
        ``LoadedModel`` shipped whole and sliced here), join the process group (NCCL: its
        communicator created here, on this rank's GPU) and run one warm-up all-reduce, all within
        the driver's start-up timeout. Returns what the driver needs to know."""
        import torch.distributed as dist

        from tr_serve.model_loader import LoadedModel, parse_dtype
        from tr_serve.tp.shard import check_shardable, shard_model

        cuda = config.device.startswith("cuda")
        local_rank = None
        if cuda:
            local_rank = self._select_gpu()
            device = f"cuda:{local_rank}"
        else:
            device = config.device
        sharded = None
        if isinstance(model, LoadedModel):  # shipped whole (small models, tests): sliced below
            loaded = model
            check_shardable(loaded.model.config, self.world_size)
        else:  # only this rank's slices are read, straight to the device (tr_serve/tp/loading.py)
            from tr_serve.tp.loading import load_sharded_model

            sharded = load_sharded_model(model, self.rank, self.world_size, parse_dtype(config.dtype, device),
                                         device)
        backend = "nccl" if cuda else "gloo"
        if backend == "gloo" and loopback:
            lo = loopback_interface()
            if lo:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
        dist.init_process_group(**process_group_options(backend, init_method, self.rank, self.world_size, timeout_s,
                                                        local_rank))
        self._warm_up(device)
        if sharded is None:
            model_ = shard_model(loaded.model, self.rank, self.world_size)
            model_.to(device)
            loaded = LoadedModel(model_, loaded.tokenizer, loaded.model_id, loaded.eos_token_ids)
        else:
            loaded = sharded
        self.loaded = loaded
        from tr_serve.engine.gc_heap import freeze_long_lived_heap

        freeze_long_lived_heap()  # this rank's steps allocate too (engine/gc_heap.py)
        cfg = loaded.model.config
        dtype = next(loaded.model.parameters()).dtype
        return {"rank": self.rank, "pid": os.getpid(), "vocab_size": int(cfg.vocab_size),
                "eos_token_ids": tuple(loaded.eos_token_ids), "model_id": loaded.model_id,
                "heads_per_rank": cfg.num_attention_heads, "kv_heads_per_rank": cfg.num_key_value_heads,
                "backend": backend, "dtype": str(dtype).removeprefix("torch.")}

    def _select_gpu(self) -> int:
        """``torch.cuda.set_device`` to this worker's GPU among the node's visible ones (the first CUDA
        call of the worker); returns its local rank."""
        if self.placement is None:
            raise RuntimeError(f"tensor-parallel rank {self.rank} was not placed on a GPU (TPWorker.place)")
        visible = torch.cuda.device_count()
        if visible != self.placement.visible_count:  # e.g. CUDA initialised before place(): the variable was ignored
            raise RuntimeError(f"tensor-parallel rank {self.rank} sees {visible} GPU(s), CUDA_VISIBLE_DEVICES="
                               f"{self.placement.cuda_visible_devices} names {self.placement.visible_count}")
        torch.cuda.set_device(self.placement.local_rank)
        return self.placement.local_rank

    def _warm_up(self, device: str) -> None:
        """One small all-reduce, checked: whatever the backend still sets up on a first collective
        happens here, under the start-up timeout, not in the first timed forward."""
        import torch.distributed as dist

        ones = torch.ones(WARM_UP_ELEMENTS, device=device)
        dist.all_reduce(ones)
        total = float(ones.min()), float(ones.max())  # waits for the collective
        if total != (self.world_size, self.world_size):
            raise RuntimeError(f"tensor-parallel rank {self.rank}: warm-up all-reduce of ones over {self.world_size} "
                               f"ranks gave values in {total}")

    def tokenizer(self):
        return self.loaded.tokenizer

    def allocate(self, max_len: int, max_rows: int, kv_cache_memory_gb: float | None, cpu_kernels: str,
                 sync_audit: bool = False, defer: bool = False, decoder: str = "transformers") -> dict:
        """This rank's ``ModelRunner`` (runner/factory.py, as the engine builds its own): its
        KV-cache shard of ``num_rows`` rows of ``max_len`` tokens, for this rank's kv heads.
        ``sync_audit``: run on the sync audit's stand-in accelerator and count, per :meth:`run`,
        what would wait for the device (runner/sync_audit.py; tests). ``defer``: a kernel plan that
        is not cached is measured after the replica is ready (:meth:`advance_startup`), torch's
        kernels until then (runner/startup_work.py). ``decoder``: the engine's setting (runner/factory.py)."""
        from tr_serve.runner.calibration import device_name
        from tr_serve.runner.factory import local_runner
        from tr_serve.runner.startup_work import deferring
        from tr_serve.runner.sync_audit import SyncAudit

        self.audit = SyncAudit() if sync_audit else None
        with deferring(self.startup) if defer else contextlib.nullcontext():
            self.runner = local_runner(self.loaded.model, max_len, max_rows, kv_cache_memory_gb, cpu_kernels,
                                       emits=self.rank == 0, audit=self.audit, decoder=decoder)
        return {"num_rows": self.runner.num_rows, "kernel_plan": repr(self.runner.kernel_plan),
                "device_name": device_name(self.runner.device), "startup_pending": self.startup.pending}

    def advance_startup(self, seconds: float) -> dict:
        """This rank's deferred start-up work for about ``seconds``, between two steps (the driver
        calls it between its forwards); the plan it installs runs from the next step."""
        done = self.startup.advance(seconds, self.runner, None)
        return {"done": done, "kernel_plan": repr(self.runner.kernel_plan)}

    # ---- serving ------------------------------------------------------------------------------
    def run(self, ops: list[tuple]) -> Any:
        """Apply ``ops`` in order: ``("free", row)``, ``("compact", rows, keep)``,
        ``("reuse_prefix", row, source, length)``, then at most one
        forward, ``("prefill_step", rows, prompts, sampling, seed_positions)`` or ``("verify_step",
        rows, tokens, depths, tree_mask, lengths, sampling)``. Rank 0 returns the forward's token
        ids (host tensors, runner/step_io.py), the others None."""
        if self.audit is None:
            return self._run(ops)
        with self.audit:
            self.audit.reset()
            result = self._run(ops)
        self.sync_counts.append(self.audit.count)
        return result

    def _run(self, ops: list[tuple]) -> Any:
        runner = self.runner
        result = None
        for op in ops:
            kind = op[0]
            if kind == "free":
                runner.free(op[1])
            elif kind == "compact":
                runner.compact(op[1], op[2])
            elif kind == "reuse_prefix":
                runner.reuse_prefix(op[1], op[2], op[3])
            elif kind == "prefill_step":
                _, rows, prompts, sampling, seed_positions = op
                result = runner.prefill_step(rows, prompts, sampling, seed_positions=seed_positions)
            elif kind == "verify_step":
                _, rows, tokens, depths, mask, lengths, sampling = op
                result = runner.verify_step(rows, tokens, depths, mask, lengths, sampling)
            else:
                raise ValueError(f"unknown runner call {kind!r}")
        return result if self.rank == 0 else None

    def lengths(self) -> list[int]:
        """This rank's KV-cache lengths (tests: every rank agrees with the driver's mirror)."""
        return [self.runner.length(row) for row in range(self.runner.num_rows)]

    def call(self, fn: Callable[[Any], Any]):
        """``fn(worker)`` on this rank (tests, debugging)."""
        return fn(self)

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["TPWorker", "free_port", "loopback_interface"]
