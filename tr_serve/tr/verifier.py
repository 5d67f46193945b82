"""Accept the longest drafted path that equals the model's own choices, plus the bonus token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tr_serve.tr.tree import CompiledTree


@dataclass(frozen=True)
class Acceptance:
    """What one verification step decided for each row of the batch.

    accepted_nodes[r]  tree node indices kept in the KV cache, root (0) first     list of [len] tensors
    emitted[r]         new tokens for the output: accepted drafts, then the bonus  list of [len] tensors
    """

    accepted_nodes: list[torch.Tensor]
    emitted: list[torch.Tensor]
    choices: torch.Tensor  # [b, n+1] the model's token after every input (argmax or sample)

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
    """Greedy verification. logits: [b, n+1, V] the model's logits at every tree input."""
    choice = logits.argmax(dim=-1)  # [b, n+1]
    return accept_choices(draft, choice, tree)


def accept_choices(draft: torch.Tensor, choice: torch.Tensor, tree: CompiledTree) -> Acceptance:
    best, length = longest_accepted_path(draft, choice, tree)
    accepted, emitted = [], []
    for r in range(draft.shape[0]):
        n = int(length[r])
        nodes = torch.cat([torch.zeros(1, dtype=torch.long), tree.paths[int(best[r]), :n].cpu()])
        accepted.append(nodes)
        emitted.append(torch.cat([draft[r, nodes[1:]].cpu(), choice[r, nodes[-1:]].cpu()]))
    return Acceptance(accepted, emitted, choice)
