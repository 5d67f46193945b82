"""The one way a process builds its local model runner: the engine over a whole model, and each
tensor-parallel rank over its shard (tp/worker.py), sized and given kernels by the same rules."""

from __future__ import annotations

import contextlib

import torch

from tr_serve.model.decoder import from_hf
from tr_serve.model.family import features_of
from tr_serve.model.vocab_parallel import VocabShard
from tr_serve.runner.decoder_runner import DecoderRunner
from tr_serve.kernels.kernel_autotune import select_plan
from tr_serve.runner.model_runner import ModelRunner, rows_within_budget
from tr_serve.runner.sync_audit import AUDIT_DEVICE, SyncAudit


def local_runner(model: torch.nn.Module, max_len: int, max_rows: int, kv_cache_memory_gb: float | None = None,
                 cpu_kernels: str = "auto", *, emits: bool = True, audit: SyncAudit | None = None,
                 decoder: str = "transformers", compile: bool = False) -> ModelRunner | DecoderRunner:
    """A ``ModelRunner`` over ``model`` with a KV cache of rows of ``max_len`` tokens: ``max_rows``
    of them, fewer if ``kv_cache_memory_gb`` says so (per device: a rank's budget is its shard's).
    ``cpu_kernels`` "auto": the measured linear kernels and the native tree attention where the
    model is fp32 on a CPU; "torch": torch's own. ``emits``: False on a tensor-parallel rank whose
    results nobody reads. ``audit``: the runner lives on the sync audit's stand-in accelerator and
    its cache is made there (runner/sync_audit.py). ``decoder``: "compact" runs tr_serve's own
    decoder (runner/decoder_runner.py, ``compile`` its graphs), "transformers" the model's layers,
    "auto" compact on CUDA where it serves the model's family, transformers elsewhere; on a
    tensor-parallel rank's shard the compact decoder all-reduces its row-parallel results."""
    dtype = next(model.parameters()).dtype
    num_rows = rows_within_budget(model.config, max_len, dtype, max_rows, kv_cache_memory_gb)
    device = next(model.parameters()).device
    if decoder == "compact" or (decoder == "auto" and device.type == "cuda" and _compact_serves(model)):
        tensor_parallel = getattr(model.config, "tp_world_size", 1) > 1  # a rank's shard (tp/shard.py)
        if tensor_parallel and compile:
            raise ValueError("compile is not supported under tensor parallelism yet: the ranks' compact decoder runs eagerly")
        with audit if audit is not None else contextlib.nullcontext():
            shard = None
            if tensor_parallel:  # each rank computes its slice of the LM head
                shard = VocabShard(model.config.tp_rank, model.config.tp_world_size, model.config.vocab_size,
                                   all_gather_stacked)
            compact = from_hf(model, max_positions=max_len, reduce=all_reduce_sum if tensor_parallel else None,
                              vocab_shard=shard)
            return DecoderRunner(compact, num_rows, max_len, compile=compile,
                                 device=AUDIT_DEVICE if audit is not None else None, emits=emits)
    plan = select_plan(model) if cpu_kernels == "auto" else None  # None unless fp32 on CPU
    with audit if audit is not None else contextlib.nullcontext():
        return ModelRunner(model, num_rows, max_len, kernel_plan=plan, tree_attention_enabled=cpu_kernels == "auto",
                           device=AUDIT_DEVICE if audit is not None else None, emits=emits)


def all_reduce_sum(partial: torch.Tensor) -> torch.Tensor:
    """The sum over the default process group's ranks of a row-parallel layer's partial result."""
    import torch.distributed as dist

    dist.all_reduce(partial, op=dist.ReduceOp.SUM)
    return partial


def all_gather_stacked(local: torch.Tensor) -> torch.Tensor:
    """[world, ...]: ``local`` of every rank of the default process group, in rank order."""
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return torch.stack(parts)


def _compact_serves(model: torch.nn.Module) -> bool:
    """Whether the compact decoder serves ``model``'s family (tr_serve/model/family.py)."""
    try:
        features_of(model.config)
    except ValueError:
        return False
    return True
