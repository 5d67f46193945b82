"""Accept the longest drafted path that equals the model's own choices, plus the bonus token."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from tr_serve.tr.argmax import argmax_rows
from tr_serve.tr.draft import DraftBatch, build_draft
from tr_serve.tr.sampling import walk_tree
from tr_serve.tr.tree import CompiledTree


@dataclass(frozen=True)
class Acceptance:
    """What one verification step decided for each row of the batch.

    accepted_nodes[r]  tree node indices kept in the KV cache, root (0) first     list of [len] tensors
    emitted[r]         new tokens for the output: accepted drafts, then the bonus  list of [len] tensors
    """

    accepted_nodes: list[torch.Tensor]
    emitted: list[torch.Tensor]
    choices: torch.Tensor  # [b, q] the model's argmax token after every input (every row: the
    # acceptance statistics read it, for sampled rows as a proxy of the draws)
    accepted_mask: torch.Tensor | None = None  # [b, q] nodes whose whole path equals the argmax choices

    @property
    def num_accepted_drafts(self) -> list[int]:
        return [len(e) - 1 for e in self.emitted]


def longest_accepted_path(draft: torch.Tensor, choice: torch.Tensor, tree: CompiledTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the leaf path with the most leading correct nodes.

    draft:  [b, n+1] drafted tokens (column 0 = root)
    choice: [b, n+1] the model's token after each node (argmax, or a sample)
    returns (best_path [b] index into tree.paths, length [b] accepted nodes on it)
    """
    b = draft.shape[0]
    if tree.num_nodes == 0:
        zeros = torch.zeros(b, dtype=torch.long, device=draft.device)
        return zeros, zeros
    parents = tree.parents.to(draft.device)
    correct = draft == choice[:, parents.clamp(min=0)]  # [b, n+1]; draft EMPTY never matches
    paths = tree.paths.to(draft.device)  # [L, D]
    on_path = correct[:, paths.clamp(min=0)] & (paths >= 0)  # [b, L, D]
    lengths = on_path.to(torch.int8).cumprod(dim=-1).sum(dim=-1)  # [b, L]
    length, best = lengths.max(dim=-1)
    return best, length


def accept_greedy(draft: torch.Tensor, logits: torch.Tensor, tree: CompiledTree) -> Acceptance:
    """Greedy verification of one tree for every row. logits: [b, n+1, V] at every tree input."""
    return accept_choices(draft, logits.argmax(dim=-1), tree)


def accept_choices(draft: torch.Tensor, choice: torch.Tensor, tree: CompiledTree) -> Acceptance:
    return accept_draft(build_draft(draft.cpu(), tree, torch.arange(1, tree.num_nodes + 1)), choice)


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


def accept_draft(batch: DraftBatch, choice: torch.Tensor) -> Acceptance:
    """Per row, the deepest accepted node's path (siblings hold distinct tokens, so the accepted
    nodes form one chain), then the model's token after it: the bonus."""
    choice = choice.cpu()
    choice_np = choice.numpy()
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


@dataclass(frozen=True)
class RowSampling:
    """How a sampled row draws (a greedy row has none): processed as transformers does, with the
    request's own generator on the logits' device."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def verify_batch(batch: DraftBatch, logits: torch.Tensor, sampling: Sequence[RowSampling | None],
                 argmax: torch.Tensor | None = None) -> Acceptance:
    """The one verification entry point for a batch of greedy and sampled rows.

    logits [b, q, V], or packed [sum(lengths), V] at ``batch.real_nodes()`` (the runner's verify
    on padded rows); sampling[r] None for a greedy row. Greedy rows keep the longest path equal
    to the model's argmax, plus the bonus; sampled rows walk their tree with one draw per emitted
    token (tr/sampling.py). The result holds what every row actually keeps and emits. ``argmax``:
    the argmax of every row of ``logits`` as laid out ([b * q] or [sum(lengths)]), when the caller
    already has it (the engine's one-pass top-k, runner/top_k.py)."""
    real = batch.real_nodes() if logits.dim() == 2 else None
    if argmax is None:
        argmax = argmax_rows(logits.reshape(-1, logits.shape[-1]))  # waits for the forward
    if real is None:
        choice = argmax.view(logits.shape[:-1])
    else:  # padding: token 0, never read (a padded node is never accepted and has no children)
        choice = torch.zeros(real.shape, dtype=torch.long)
        choice[real] = argmax.cpu()
    acceptance = accept_draft(batch, choice)
    if all(s is None for s in sampling):
        return acceptance
    accepted, emitted = list(acceptance.accepted_nodes), list(acceptance.emitted)
    starts = [0] + batch.lengths.cumsum(0).tolist() if real is not None else None
    for r, s in enumerate(sampling):
        if s is not None:
            row_logits = logits[r] if real is None else logits[starts[r] : starts[r + 1]]
            accepted[r], emitted[r] = walk_tree(batch.tokens[r], row_logits, batch.children(r), s.temperature,
                                                s.top_k, s.top_p, s.generator)
    return replace(acceptance, accepted_nodes=accepted, emitted=emitted)
