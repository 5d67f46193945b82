"""The runner contract: what the engine sends a model runner each step and what comes back.

Why token ids, not logits: the engine needs, per verified node, the model's next token (its
argmax, or a draw for a sampled request) and, for Token Recycling, the top-K next tokens. At
Llama-3's vocabulary (128,256) and 32 rows of 81 nodes the logits are 1.33 GB a step; these ids
are 93 KB (``[nodes, 1 + K]`` int32). They are computed where the logits are (the runner's device;
rank 0 under tensor parallelism) and reach the host in one copy per step, which is then the
step's only device-to-host synchronisation (runner/sync_audit.py counts them).

``ModelRunner`` (in process, built by runner/factory.py) and ``TPModelRunner`` (tensor-parallel
workers) both subclass :class:`StepRunner`; the engine and the latency calibration cannot tell
them apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class RowSampler:
    """How one sampled request draws its tokens (a greedy request has none). ``seed`` keys the
    noise of each draw together with the position of the token drawn (runner/sampler.py), so a
    seeded request gives the same tokens whatever tree verified them."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


@dataclass(frozen=True)
class StepSampling:
    """What the runner picks after every input of a step.

    rows       per row of the step: None (greedy: the argmax) or its :class:`RowSampler`
    recycle_k  how many top next-token ids per input come back for the matrix (0: none)
    """

    rows: tuple[RowSampler | None, ...]
    recycle_k: int = 0

    @property
    def any_sampled(self) -> bool:
        return any(r is not None for r in self.rows)


@dataclass(frozen=True)
class NextTokens:
    """Host tensors for ``n`` inputs of a step (a verify's real nodes packed in row order, or a
    prefill's picked positions).

    choices  [n] int32: the token each input is followed by: argmax, or the row's draw
    top_k    [n, recycle_k] int32: the most likely next tokens, best first (argmax first); None
             when ``recycle_k`` is 0
    """

    choices: torch.Tensor
    top_k: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        """Bytes of the ids (int32) as they cross from the device."""
        width = 1 + (self.top_k.shape[1] if self.top_k is not None else 0)
        return 4 * int(self.choices.numel()) * width


@dataclass(frozen=True)
class PrefillOutput:
    """last   the prompt chunk's last position of each row: its next token (the request's first
              output token when the chunk completes the prompt) and top-k (recycled then)
    seeds  per row, the top-k ids at the positions asked for (prompt seeding), or None"""

    last: NextTokens
    seeds: list[torch.Tensor] | None = None  # per row [n_i, recycle_k] int32

    @property
    def nbytes(self) -> int:
        return self.last.nbytes + sum(4 * int(s.numel()) for s in (self.seeds or []))


class StepRunner(Protocol):
    """What the engine and the latency calibration use of a model runner (tensor arguments are
    host tensors).

    rows     [b] int64 KV-cache rows of the step's requests
    tokens   [b, q] int64 each row's root (column 0) and draft nodes, EMPTY (-1) as padding
    depths   [q] or [b, q] int64 position offset of each node from the root
    mask     [q, q] or [b, q, q] bool: a node sees its ancestors and itself
    lengths  [b] int64 real inputs per row (padding after them), or None when no row is padded
    """

    device: torch.device  # where the step's ids are computed (the calibration's key)
    dtype: torch.dtype  # the model's
    vocab_size: int
    num_rows: int  # KV-cache rows, each of ``max_len`` tokens
    max_len: int
    kernel_plan: object  # the linear kernels the forwards use, or None (the calibration's key)
    forwards: int  # forwards run so far, whoever asked: each writes KV into its rows

    def length(self, row: int) -> int:
        ...

    def free(self, row: int) -> None:
        ...

    def compact(self, rows: torch.Tensor, keep: list[torch.Tensor]) -> None:
        """Keep the accepted nodes' KV entries (keep[i]: row i's node indices, root first)."""

    def reuse_prefix(self, row: int, source: int, length: int) -> None:
        """``row`` (free) starts with the first ``length`` KV entries of ``source``: kept where
        ``source`` is ``row`` (a freed row's entries stay until overwritten), else copied; its
        length becomes ``length`` (the prefix cache, engine/prefix_cache.py)."""

    def prefill_step(self, rows: torch.Tensor, prompts: list[list[int]], sampling: StepSampling,
                     seed_positions: list[list[int]] | None = None) -> PrefillOutput:
        """Write the prompt chunks into ``rows``; the next token after each chunk's last position."""

    def verify_step(self, rows: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor,
                    lengths: torch.Tensor | None, sampling: StepSampling) -> NextTokens:
        """One forward over every row's tree: the next tokens of the real nodes, packed in row order
        (``sum(lengths)``, or ``b * q`` when no row is padded). The cache lengths stay until
        :meth:`compact`."""


__all__ = ["NextTokens", "PrefillOutput", "RowSampler", "StepRunner", "StepSampling"]
