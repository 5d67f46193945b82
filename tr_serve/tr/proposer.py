"""Draft a static tree from the adjacency matrix: one gather per tree level, no search."""

from __future__ import annotations

import torch

from tr_serve.tr.matrix import EMPTY, AdjacencyMatrix
from tr_serve.tr.tree import CompiledTree


def propose(matrix: AdjacencyMatrix, roots: torch.Tensor, tree: CompiledTree, max_depth: int | None = None) -> torch.Tensor:
    """Fill ``tree`` for each row from its last accepted token.

    roots: [b] last accepted token of each row (not yet in the KV cache)
    max_depth: fill only nodes up to this depth (deeper ones stay EMPTY)
    returns: [b, n+1] tokens, column 0 = root, column i = node i (EMPTY where the parent's row
    has no candidate at that rank).
    """
    table = matrix.table
    b = roots.shape[0]
    tokens = torch.full((b, tree.num_nodes + 1), EMPTY, dtype=torch.long, device=table.device)
    tokens[:, 0] = roots.to(table.device)
    for start, stop in tree.level_slices[:max_depth]:
        nodes = tree.level_order[start:stop]  # [m] node indices of this depth
        parent_tok = tokens[:, tree.parents[nodes]]  # [b, m]
        drafted = table[parent_tok.clamp(min=0), tree.ranks[nodes]].long()  # [b, m]
        tokens[:, nodes] = torch.where(parent_tok >= 0, drafted, EMPTY)
    return tokens
