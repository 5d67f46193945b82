"""One tensor-parallel rank: this rank's shard of the weights and of the KV cache, and nothing else.

A ``TPWorker`` holds a local ``ModelRunner`` over its shard (``tr_serve.tp.loading`` /
``tr_serve.tp.shard``: a third of the heads and of the MLP at tp=3, replicated embeddings, norms and
``lm_head``) and runs the runner calls that ``TPModelRunner`` (``tr_serve/tp/runner.py``) sends it:
``prefill`` / ``verify`` after the queued ``free`` / ``compact`` calls, in the order the engine
made them. Every rank gets the same calls; the shards' partial sums meet in the all-reduces after
``o_proj`` and ``down_proj``, so every rank computes the same hidden states and logits, and only
rank 0 sends its result back. There is no scheduler, matrix, sampler or request here: the
replica's one ``Engine`` decides everything, so the ranks cannot diverge.

The class is a plain Python class: ``TPModelRunner`` wraps it with ``ray.remote``; tests can drive
it directly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch

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
    """Rank ``rank`` of ``world_size``. Call order: ``rendezvous`` (rank 0 only), ``setup`` on
    every rank at once (it blocks until all ranks joined), ``allocate`` on every rank, then
    ``run`` on every rank for each forward the engine asks for."""

    def __init__(self, rank: int, world_size: int, cpu_threads: int | None = None):
        self.rank = rank
        self.world_size = world_size
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        self.loaded = None
        self.runner = None
        self.audit = None  # a SyncAudit when allocate(sync_audit=True)
        self.sync_counts: list[int] = []  # forced device-to-host syncs per run(), when audited

    # ---- start-up -----------------------------------------------------------------------------
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def rendezvous(self, loopback: bool) -> str:
        """``tcp://ip:port`` on this node for ``init_process_group`` (rank 0 listens there)."""
        import ray

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def setup(self, init_method: str, model, config, loopback: bool, timeout_s: float = 600.0) -> dict:
        """Load this rank's shard (``model`` is a path / alias, read slice by slice, or a
        ``LoadedModel`` shipped whole and sliced here) and join the process group. Returns what
        the driver needs to know."""
        import torch.distributed as dist

        from tr_serve.model_loader import LoadedModel, parse_dtype
        from tr_serve.tp.shard import check_shardable, shard_model

        cuda = config.device.startswith("cuda")
        device = "cuda" if cuda else config.device  # Ray gives each worker its GPU as cuda:0
        if cuda:
            torch.cuda.set_device(0)
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
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=timeout_s))
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

    def tokenizer(self):
        return self.loaded.tokenizer

    def allocate(self, max_len: int, max_rows: int, kv_cache_memory_gb: float | None, cpu_kernels: str,
                 sync_audit: bool = False) -> dict:
        """This rank's ``ModelRunner``: its KV-cache shard of ``num_rows`` rows of ``max_len``
        tokens. The rows follow the engine's rule (``max_num_seqs``, fewer if the KV memory budget
        says so) for this rank's kv heads: the budget is per device, like the cache shard.
        ``sync_audit``: run on the sync audit's stand-in accelerator and count, per :meth:`run`,
        what would wait for the device (runner/sync_audit.py; tests)."""
        from tr_serve.runner.cpu_kernels import select_plan
        from tr_serve.runner.model_runner import ModelRunner, rows_within_budget

        model = self.loaded.model
        dtype = next(model.parameters()).dtype
        num_rows = rows_within_budget(model.config, max_len, dtype, max_rows, kv_cache_memory_gb)
        plan = select_plan(model) if cpu_kernels == "auto" else None  # None unless fp32 on CPU
        device = None
        if sync_audit:
            from tr_serve.runner.sync_audit import AUDIT_DEVICE, SyncAudit

            self.audit, device = SyncAudit(), AUDIT_DEVICE
        with self.audit if self.audit is not None else contextlib.nullcontext():  # the cache on the audited device
            self.runner = ModelRunner(model, num_rows, max_len, kernel_plan=plan, device=device,
                                      tree_attention_enabled=cpu_kernels == "auto", emits=self.rank == 0)
        from tr_serve.runner.calibration import device_name

        return {"num_rows": num_rows, "kernel_plan": repr(plan), "device_name": device_name(self.runner.device)}

    # ---- serving ------------------------------------------------------------------------------
    def run(self, ops: list[tuple]) -> Any:
        """Apply ``ops`` in order: ``("free", row)``, ``("compact", rows, keep)``, then at most one
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
        return self.runner.cache.lens.tolist()

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
