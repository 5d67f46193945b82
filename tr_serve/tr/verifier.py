"""Accept the longest drafted path that equals the model's own choices, plus the bonus token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tr_serve.tr.draft import DraftBatch


@dataclass(frozen=True)
class Acceptance:
    """What one verification step decided for each row of the batch.

    accepted_nodes[r]  tree node indices kept in the KV cache, root (0) first     list of [len] tensors
    emitted[r]         new tokens for the output: accepted drafts, then the bonus  list of [len] tensors
    """

    accepted_nodes: list[torch.Tensor]
    emitted: list[torch.Tensor]
    choices: torch.Tensor  # [b, q] the model's token after every input: its argmax, or a sampled
    # row's draw (runner/sampler.py); the acceptance statistics read it
    accepted_mask: torch.Tensor | None = None  # [b, q] nodes whose whole path equals the argmax choices

    @property
    def num_accepted_drafts(self) -> list[int]:
        return [len(e) - 1 for e in self.emitted]

    def of_rows(self, rows: Sequence[int], width: int) -> "Acceptance":
        """The acceptance of ``rows`` alone, cut to their first ``width`` columns: what one part of a
        merged batch (tr/draft.py merge_parts) decided, in the columns of its own draft."""
        index = torch.tensor(list(rows), dtype=torch.long)
        mask = self.accepted_mask[index, :width] if self.accepted_mask is not None else None
        return Acceptance([self.accepted_nodes[r] for r in rows], [self.emitted[r] for r in rows],
                          self.choices[index, :width], mask)


def choices_grid(batch: DraftBatch, choices: torch.Tensor) -> np.ndarray:
    """[b, q] int64 on the host: the runner's ``choices`` (one per real node, packed in row order,
    runner/step_io.py) laid out as the batch's nodes; padding gets token 0, never read (a padded
    node is never accepted and has no children).

    Example: rows of 3 and 1 real nodes (q = 3), choices [7, 8, 9, 4] -> [[7, 8, 9], [4, 0, 0]]."""
    values = choices.numpy() if isinstance(choices, torch.Tensor) else np.asarray(choices)
    b, q = batch.tokens.shape
    real = batch.real_nodes()
    if real is None:
        return values.reshape(b, q)
    grid = np.zeros((b, q), dtype=np.int64)
    grid[real.numpy()] = values
    return grid


def accepted_mask(batch: DraftBatch, choice: np.ndarray) -> np.ndarray:
    """[b, q] True where the node's whole path from the root equals the model's choices.

    choice: [b, q] the model's token after every input. A node is right when its token is the
    choice after its parent; it is accepted when it and every ancestor are right. Padding and
    EMPTY nodes never are. In numpy: a handful of small [b, q] tables every step, where each torch
    call cost several microseconds more (right after a forward, with the caches cold)."""
    parents = np.maximum(batch.parents.cpu().numpy(), 0)
    correct = batch.tokens.cpu().numpy() == np.take_along_axis(choice, parents, axis=1)  # [b, q]
    correct[:, 0] = True
    ok = correct
    for _ in range(batch.max_depth):  # after d rounds every node of depth <= d is resolved
        ok = correct & np.take_along_axis(ok, parents, axis=1)
    return ok


def accept_draft(batch: DraftBatch, choice: torch.Tensor | np.ndarray) -> Acceptance:
    """Per row, the deepest accepted node's path (siblings hold distinct tokens, so the accepted
    nodes form one chain), then the model's token after it: the bonus. choice [b, q] on the host."""
    choice_np = choice.numpy() if isinstance(choice, torch.Tensor) else np.ascontiguousarray(choice)
    choice = torch.from_numpy(choice_np)
    ok = accepted_mask(batch, choice_np)
    best = np.where(ok, batch.row_depths().cpu().numpy(), -1).argmax(axis=1).tolist()
    parents = batch.parents.cpu().numpy().tolist()
    tokens = batch.tokens.cpu().numpy().tolist()
    accepted, emitted = [], []
    for r, node in enumerate(best):
        path = [node]
        while path[-1] != 0:
            path.append(parents[r][path[-1]])
        path.reverse()
        accepted.append(torch.tensor(path))
        emitted.append(torch.tensor([tokens[r][i] for i in path[1:]] + [int(choice_np[r, node])]))
    return Acceptance(accepted, emitted, choice, torch.from_numpy(ok))
