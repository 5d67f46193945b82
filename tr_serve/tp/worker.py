"""One tensor-parallel rank: a full ``Engine`` over this rank's shard of the model.

Every rank receives the same commands (add / abort) and steps in lockstep. The shards' partial
sums meet in the all-reduces after ``o_proj`` and ``down_proj``, so every rank sees the same
logits; drafting, acceptance, recycling, sampling (per-request seeded generators) and stop rules
are deterministic functions of those logits and of the commands, so every rank's engine takes the
same decisions and issues the same sequence of collectives. Only rank 0's outputs go back to the
caller; every rank returns a digest of its state so that a divergence is caught at the step it
happens instead of as a mismatched collective later.

The class is a plain Python class: ``TPEngine`` wraps it with ``ray.remote``; tests can drive it
directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
from contextlib import contextmanager
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


def engine_digest(engine, outputs) -> str:
    """A short fingerprint of the scheduler state after a step (identical on every rank when the
    ranks agree)."""
    h = hashlib.blake2b(digest_size=12)
    for name, queue in (("w", engine.waiting), ("p", engine.prefilling), ("r", engine.running)):
        for r in queue:
            last = r.output_ids[-1] if r.output_ids else -1
            h.update(f"{name}:{r.request_id}:{r.row}:{r.num_prefilled}:{len(r.output_ids)}:{last};".encode())
    for o in outputs:
        h.update(f"o:{o.request_id}:{len(o.token_ids)}:{o.finished}:{o.finish_reason};".encode())
    h.update(repr(engine.runner.cache.lens.tolist()).encode())
    return h.hexdigest()


@contextmanager
def shared_calibration(rank: int, world_size: int):
    """While an ``Engine`` with ``budget="auto"`` is built: every rank uses rank 0's latency table.

    Each rank would otherwise time its own forwards, get slightly different tables, choose
    different tree budgets and fall out of lockstep. The measurement itself runs on every rank
    together (its forwards are collectives); the table is cached per model, device and world size.
    """
    import torch.distributed as dist

    from tr_serve.disk_cache import load_json, save_json
    from tr_serve.runner import calibration as cal

    original = cal.load_or_measure

    def load_or_measure(runner, model_id: str, max_tokens: int):
        path = cal.cache_root() / "calibration" / f"{cal.calibration_key(f'{model_id}|tp{world_size}', runner)}.json"
        box: list[Any] = [None]
        if rank == 0:
            box[0] = load_json(path, lambda data: cal.parse_table(data, max_tokens), "calibration")
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            box = [cal.measure(runner, max_tokens)]
            dist.broadcast_object_list(box, src=0)  # every rank adopts rank 0's timings
            if rank == 0:
                save_json(path, {"tokens": box[0].tokens, "seconds": box[0].seconds, "model": model_id,
                                 "tensor_parallel_size": world_size}, "calibration")
        return box[0]

    cal.load_or_measure = load_or_measure
    try:
        yield
    finally:
        cal.load_or_measure = original


class TPWorker:
    """Rank ``rank`` of ``world_size``. Call order: ``rendezvous`` (rank 0 only), ``setup`` on
    every rank at once (it blocks until all ranks joined), then ``step`` on every rank per step."""

    def __init__(self, rank: int, world_size: int, cpu_threads: int | None = None):
        self.rank = rank
        self.world_size = world_size
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        self.engine = None

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
        """Load (``model`` is a path / alias, or a ``LoadedModel``), join the group, shard, and
        build this rank's ``Engine``. Returns what the driver needs to know."""
        import torch.distributed as dist

        from tr_serve.engine.engine import Engine
        from tr_serve.model_loader import LoadedModel, parse_dtype
        from tr_serve.tp.shard import check_shardable, shard_model

        cuda = config.device.startswith("cuda")
        device = "cuda" if cuda else config.device  # Ray gives each worker its GPU as cuda:0
        config = dataclasses.replace(config, device=device)
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
            loaded, model_ = sharded, sharded.model
        with shared_calibration(self.rank, self.world_size):
            # ranks must choose the same tree budget: no per-rank timing corrections online
            self.engine = Engine(loaded, dataclasses.replace(config, online_latency=False))
        cfg = model_.config
        return {"rank": self.rank, "pid": os.getpid(), "num_rows": self.engine.num_rows,
                "vocab_size": int(cfg.vocab_size), "eos_token_ids": tuple(loaded.eos_token_ids),
                "model_id": loaded.model_id, "heads_per_rank": cfg.num_attention_heads,
                "kv_heads_per_rank": cfg.num_key_value_heads, "backend": backend}

    def tokenizer(self):
        return self.engine.tokenizer

    # ---- serving ------------------------------------------------------------------------------
    def step(self, commands: list[tuple]) -> dict:
        """Apply ``commands`` (``("add", id, prompt_ids, params)`` / ``("abort", id)``), step once.
        Rank 0 returns the outputs and the scheduler's state; every rank returns its digest."""
        engine = self.engine
        for cmd in commands:
            if cmd[0] == "add":
                _, request_id, prompt_ids, params = cmd
                engine.add_request(prompt_ids, params, request_id=request_id)
            elif cmd[0] == "abort":
                engine.abort(cmd[1])
            else:
                raise ValueError(f"unknown command {cmd[0]!r}")
        outputs = engine.step() if engine.has_unfinished() else []
        reply: dict[str, Any] = {"digest": engine_digest(engine, outputs)}
        if self.rank == 0:
            reply["outputs"] = outputs
            reply["state"] = {"waiting": [r.request_id for r in engine.waiting],
                              "prefilling": [r.request_id for r in engine.prefilling],
                              "running": [r.request_id for r in engine.running],
                              "free_rows": list(engine.free_rows),
                              "unfinished": engine.has_unfinished()}
        return reply

    def call(self, fn: Callable[[Any], Any]):
        """``fn(engine)`` on this rank (between steps; must act identically on every rank)."""
        return fn(self.engine)

    def ping(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
