"""Lossless speculative sampling on a draft tree, and the logits processing it samples from.

At each node on the path, one token is drawn from the target's processed distribution at that
node; if it is one of the node's drafted children the walk moves there and goes on, otherwise the
drawn token is emitted and the walk stops. Every emitted token is a draw from exactly the
distribution plain sampling would use, with one draw per emitted token, so a seeded request gives
the same output with or without the tree.
"""

from __future__ import annotations

import torch

from tr_serve.tr.tree import CompiledTree


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities [.., V] after temperature, top-k, then top-p (transformers' warper order and
    rules: top-p removes the low tail whose cumulative mass is <= 1 - top_p, keeping at least one)."""
    scores = logits.float() / temperature
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def sample_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from ``probs`` on its own device; ``generator`` must live on that device."""
    return int(torch.multinomial(probs, 1, generator=generator))


def walk_tree(draft: torch.Tensor, logits: torch.Tensor, tree: CompiledTree | list[list[int]], temperature: float,
              top_k: int, top_p: float, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: draft [n+1] tokens, logits [n+1, V], and the tree (or its children lists,
    ``children[i]`` = nodes under node i). Returns (accepted node indices with the root first,
    emitted tokens: one draw per accepted node). Every draw runs on the logits' device with
    ``generator`` (which must live there); the two results are host index tensors built from the
    drawn ints, like greedy acceptance's (the KV compaction and the output read them on the host)."""
    children = tree.children if isinstance(tree, CompiledTree) else tree
    node, nodes, emitted = 0, [0], []
    draft_list = draft.tolist()
    while True:
        token = sample_token(process_logits(logits[node], temperature, top_k, top_p), generator)
        emitted.append(token)
        child = next((c for c in children[node] if draft_list[c] == token), None)
        if child is None:
            return torch.tensor(nodes, device="cpu"), torch.tensor(emitted, device="cpu")
        node = child
        nodes.append(child)
