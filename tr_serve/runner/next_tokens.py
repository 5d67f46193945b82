"""From a step's logits to the ids the engine needs, where the logits are.

Per input: the model's choice (argmax; a draw for a sampled row, runner/sampler.py) and the top-K
ids the matrix recycles, packed as one ``[n, 1 + K]`` int32 tensor on the device, so that the step
copies one small tensor to the host (runner/step_io.py says why).
"""

from __future__ import annotations

import numpy as np
import torch

from tr_serve.runner.sampler import sample_rows
from tr_serve.runner.step_io import NextTokens, StepSampling
from tr_serve.kernels.top_k import top_k_indices, top_k_rows


def on_host(device: torch.device) -> bool:
    """Whether ``device`` is the host's own memory (the CPU fast paths apply). The sync audit's
    ``cpu:0`` (runner/sync_audit.py) computes on the CPU but stands for an accelerator: no."""
    return device.type == "cpu" and device.index is None


def next_token_ids(logits: torch.Tensor, sampling: StepSampling, node_rows: np.ndarray | None = None,
                   node_positions: np.ndarray | None = None, host: bool = False) -> torch.Tensor:
    """[n, 1 + recycle_k] int32 on the logits' device: column 0 the choice after each row of
    ``logits`` [n, V], then the top ``recycle_k`` ids, best first.

    node_rows [n] / node_positions [n] (host): the step row of each input and the position of
    the token that follows it; needed only when a row samples. ``host``: the logits are in host
    memory (the runner's device, :func:`on_host`), where a native one-pass top-k applies.

    Example: two greedy inputs, recycle_k=2, logits [[0, 3, 1], [5, 0, 4]] -> [[1, 1, 2], [0, 0, 2]].
    """
    k = sampling.recycle_k
    top = None
    if host:
        top = top_k_rows(logits, max(k, 1))  # one pass for both on CPU in float32; None elsewhere
    if top is not None:
        choices = top[:, 0]
        top = top[:, :k] if k else None
    else:
        choices = logits.argmax(dim=-1)
        if k:  # two short passes on the host, torch's top-k elsewhere
            top = top_k_indices(logits, k) if host else torch.topk(logits, k, dim=-1).indices
    if sampling.any_sampled:
        drawn = sample_rows(logits, node_rows, node_positions, sampling.rows)
        if drawn is not None:
            choices = choices.index_copy(0, drawn[0], drawn[1])
    columns = [choices[:, None]] if top is None else [choices[:, None], top]
    return torch.cat(columns, dim=1).to(torch.int32)


def unpack(ids: torch.Tensor, recycle_k: int) -> NextTokens:
    """:class:`NextTokens` (int32 host tensors, as they crossed) from :func:`next_token_ids`' packing."""
    return NextTokens(ids[:, 0], ids[:, 1 : 1 + recycle_k] if recycle_k else None)


def top_ids(logits: torch.Tensor, k: int, host: bool = False) -> torch.Tensor:
    """[n, k] int32 on the logits' device: the k most likely next tokens of each row of ``logits``
    [n, V] (prompt seeding: these only feed drafts); ``host`` as for :func:`next_token_ids`."""
    top = top_k_rows(logits, k) if host and logits.dtype == torch.float32 else None
    if top is None:
        top = top_k_indices(logits, k) if host else torch.topk(logits, k, dim=-1).indices
    return top.to(torch.int32)


__all__ = ["next_token_ids", "on_host", "top_ids", "unpack"]
