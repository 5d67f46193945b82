"""One step's draft trees: the metadata the proposer hands to the runner and the verifier.

Every row verifies the same template nodes (columns ``1..n``, drafted from the adjacency matrix)
plus, where the row's context has a match, a branch of its own: the retrieved continuation is hung
under the root, reusing template nodes while its tokens equal theirs, and the rest becomes one
chain (deeper than the template where the match is long). Rows are padded to one width with dead
nodes (EMPTY token, under the root) that can never be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tr_serve.tr.matrix import EMPTY
from tr_serve.tr.tree import CompiledTree


@dataclass(frozen=True)
class DraftBatch:
    """tokens   [b, q] column 0 = the root (last accepted token), EMPTY for padding
    parents  [b, q] column of each node's parent (root: -1, padding: 0)
    depths   [q] (one tree for every row) or [b, q]: position offset from the root
    mask     [q, q] or [b, q, q]: True where a node sees another (its ancestors and itself)
    template_nodes  [n] index in the full template of columns 1..n (every row)
    chain_columns   per row, the column of each context-branch token (merged ones included)
    match_lengths   per row, the n-gram match length that retrieved the branch (0: none)
    max_depth       the deepest node of any row
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    template_nodes: torch.Tensor
    chain_columns: tuple[tuple[int, ...], ...]
    match_lengths: tuple[int, ...]
    max_depth: int
    template_draft: torch.Tensor | None = None  # [b, N+1] the whole template drafted (acceptance statistics)

    @property
    def num_nodes(self) -> int:
        """Drafted nodes per row, padding included (the step verifies 1 + this per row)."""
        return self.tokens.shape[1] - 1

    @property
    def num_template_nodes(self) -> int:
        return int(self.template_nodes.numel())

    def row_depths(self) -> torch.Tensor:
        return self.depths if self.depths.dim() == 2 else self.depths[None].expand_as(self.tokens)

    def children(self, row: int) -> list[list[int]]:
        """children[i]: columns whose parent is column i, in row ``row``."""
        par = self.parents[row].tolist()
        out: list[list[int]] = [[] for _ in par]
        for i, p in enumerate(par):
            if i > 0:
                out[p].append(i)
        return out


def build_draft(template_tokens: torch.Tensor, tree: CompiledTree, template_nodes: torch.Tensor,
                chains: list[list[int]] | None = None, match_lengths: list[int] | None = None) -> DraftBatch:
    """template_tokens [b, n+1]: the root and the drafted tokens of ``tree``'s n nodes (which are
    the full template's nodes ``template_nodes``); chains: per row, a retrieved continuation of the
    root (may be empty)."""
    b, width = template_tokens.shape
    n = width - 1
    chains = chains or [[] for _ in range(b)]
    match_lengths = match_lengths or [0] * b
    # hang each chain under the root: follow template nodes while the tokens agree
    extras: list[tuple[int, list[int]]] = []  # (column the rest hangs under, the rest)
    chain_cols: list[tuple[int, ...]] = []
    rows_tokens = template_tokens.tolist() if any(chains) else None
    for r, chain in enumerate(chains):
        node, cols = 0, []
        for j, tok in enumerate(chain):
            nxt = next((c for c in tree.children[node] if rows_tokens[r][c] == tok), None)
            if nxt is None:
                extras.append((node, chain[j:]))
                break
            node = nxt
            cols.append(nxt)
        else:
            extras.append((node, []))
        chain_cols.append(tuple(cols))
    extra = max((len(rest) for _, rest in extras), default=0)
    parents_1d = tree.parents.clamp(min=0)
    parents_1d[0] = -1
    if extra == 0:
        return DraftBatch(template_tokens, parents_1d[None].expand(b, width).clone(), tree.depths, tree.mask,
                          template_nodes, tuple(chain_cols), tuple(match_lengths), tree.max_depth)
    q = width + extra
    tokens = torch.full((b, q), EMPTY, dtype=torch.long)
    tokens[:, :width] = template_tokens
    parents = torch.zeros(b, q, dtype=torch.long)
    parents[:, :width] = parents_1d
    depths = torch.ones(b, q, dtype=torch.long)
    depths[:, :width] = tree.depths
    mask = torch.zeros(b, q, q, dtype=torch.bool)
    mask[:, :width, :width] = tree.mask
    pad = torch.arange(width, q)
    mask[:, pad, 0] = True  # padding: a dead child of the root
    mask[:, pad, pad] = True
    tree_depths = tree.depths.tolist()
    max_depth = tree.max_depth
    for r, (under, rest) in enumerate(extras):
        m = len(rest)
        if m == 0:
            continue
        cols = torch.arange(width, width + m)
        tokens[r, cols] = torch.tensor(rest, dtype=torch.long)
        parents[r, cols] = torch.tensor([under] + list(range(width, width + m - 1)), dtype=torch.long)
        depths[r, cols] = torch.arange(tree_depths[under] + 1, tree_depths[under] + m + 1)
        mask[r, width : width + m, :width] = tree.mask[under]  # the merge node and its ancestors
        mask[r, width : width + m, width : width + m] = torch.ones(m, m, dtype=torch.bool).tril()
        max_depth = max(max_depth, tree_depths[under] + m)
        chain_cols[r] = chain_cols[r] + tuple(range(width, width + m))
    return DraftBatch(tokens, parents, depths, mask, template_nodes, tuple(chain_cols), tuple(match_lengths),
                      max_depth)
