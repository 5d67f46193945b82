"""One step's draft trees: the metadata the proposer hands to the runner and the verifier.

Each row verifies a prefix of the same template nodes (columns ``1..n_r``, drafted from the
adjacency matrix; rows with nothing promising verify none) plus, where the row's context has a
match, a branch of its own: the retrieved continuation is hung under the root, reusing template
nodes while its tokens equal theirs, and the rest becomes one chain (deeper than the template where
the match is long). Rows are padded to one width with dead nodes (EMPTY token, under the root) that
can never be accepted; ``lengths`` lets the runner skip them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from tr_serve.tr.matrix import EMPTY
from tr_serve.tr.tree import CompiledTree


@dataclass(frozen=True)
class DraftBatch:
    """tokens   [b, q] column 0 = the root (last accepted token), EMPTY for padding
    parents  [b, q] column of each node's parent (root: -1, padding: 0)
    depths   [q] (one tree for every row) or [b, q]: position offset from the root
    mask     [q, q] or [b, q, q]: True where a node sees another (its ancestors and itself)
    template_nodes  [n] index in the full template of columns 1..n (the widest row's); empty in a
                    batch merged from parts (merge_parts): each part's own batch holds its own
    row_nodes       per row, how many of those columns it verifies (a prefix: 1..row_nodes[r])
    chain_columns   per row, the column of each context-branch token (merged ones included)
    chain_next      per row, the first retrieved token the row does not verify (EMPTY: none): its
                    acceptance is still known when the branch's verified tokens all are (the
                    model's token after the last of them), which keeps the estimates of branch
                    tokens past the budget's cap learning
    match_lengths   per row, the n-gram match length that retrieved the branch (0: none)
    chain_agreement per row, for each branch token drafted and ``chain_next``: whether the matrix's
                    first candidate of the token before it is that token (tr/acceptance_stats.py ContextStats)
    branch_cells    per row whose branch came from the cross-request suffix index, the
                    tr/acceptance_stats.py SuffixStats cell of each branch token drafted and ``chain_next``;
                    () for any other row (its branch is priced by ContextStats)
    max_depth       the deepest node of any row
    lengths         [b] real inputs per row (root included; padding follows them), None when no
                    row is padded: the runner packs rows by it, so padding costs no compute
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    template_nodes: torch.Tensor
    row_nodes: tuple[int, ...]
    chain_columns: tuple[tuple[int, ...], ...]
    match_lengths: tuple[int, ...]
    max_depth: int
    lengths: torch.Tensor | None = None
    template_draft: torch.Tensor | None = None  # [b, N+1] the template drafted (acceptance statistics; EMPTY below what was verified)
    before_roots: torch.Tensor | None = None  # [b] the token before each root, where a pair table drafted (-1: none)
    chain_next: tuple[int, ...] = ()  # per row (build_draft always sets it)
    chain_agreement: tuple[tuple[bool, ...], ...] = ()  # per row (build_draft always sets it)
    branch_cells: tuple[tuple[int, ...], ...] = ()  # per row (build_draft always sets it)
    # the rows drafted under a named tenant's budget, or by several budgets (merge_parts), each part
    # with its own draft; () when every row was drafted by the shared budget
    parts: tuple["DraftPart", ...] = ()

    @property
    def num_nodes(self) -> int:
        """Drafted nodes per row, padding included (the widest row verifies 1 + this)."""
        return self.tokens.shape[1] - 1

    @property
    def num_inputs(self) -> int:
        """Query tokens the forward computes: every row's real inputs, padding excluded."""
        return self.tokens.numel() if self.lengths is None else int(self.lengths.sum())

    def nodes_per_row(self) -> list[int]:
        """Drafted nodes each row verifies, padding excluded."""
        if self.lengths is None:
            return [self.num_nodes] * self.tokens.shape[0]
        return [n - 1 for n in self.lengths.tolist()]

    def real_nodes(self) -> torch.Tensor | None:
        """[b, q] bool, True at each row's real inputs (the first lengths[r]); None when no row is
        padded. Packed logits ([sum(lengths), V], row order) hold exactly these positions."""
        if self.lengths is None:
            return None
        return torch.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]

    def tokens_before(self) -> torch.Tensor:
        """[b, q] the token before each node: its parent's, :attr:`before_roots` for the roots
        (the pair table's keys, with :attr:`tokens`)."""
        out = self.tokens.gather(1, self.parents.clamp(min=0))
        out[:, 0] = self.before_roots
        return out

    def row_depths(self) -> torch.Tensor:
        return self.depths if self.depths.dim() == 2 else self.depths[None].expand_as(self.tokens)

    def children(self, row: int) -> list[list[int]]:
        """children[i]: columns whose parent is column i, in row ``row`` (padding excluded)."""
        par = self.parents[row].tolist()
        real = len(par) if self.lengths is None else int(self.lengths[row])
        out: list[list[int]] = [[] for _ in par]
        for i in range(1, real):
            out[par[i]].append(i)
        return out


@dataclass(frozen=True)
class DraftPart:
    """Rows of one step drafted under one budget: ``scope`` names it (a tenant id, None: the shared
    budget), ``rows`` are their indices in the step's batch, ``batch`` their own draft (its columns
    are theirs in the step's batch, which only pads them on the right)."""

    scope: str | None
    rows: tuple[int, ...]
    batch: DraftBatch


def merge_parts(parts: Sequence[DraftPart], rows: int) -> DraftBatch:
    """One step's batch of ``rows`` rows from drafts of disjoint row sets (together all of them),
    each padded on the right with dead nodes to the widest part's width; its :attr:`DraftBatch.parts`
    keep each part's own draft, whose template order and node counts are its budget's.

    Example: parts of rows (0, 2) with 3 columns and (1,) with 5 -> a [3, 5] batch whose rows 0
    and 2 hold the first part's rows and 2 dead nodes each, lengths [3, 5, 3] (when no part pads)."""
    q = max(p.batch.tokens.shape[1] for p in parts)
    tokens = np.full((rows, q), EMPTY, dtype=np.int64)
    parents = np.zeros((rows, q), dtype=np.int64)
    depths = np.ones((rows, q), dtype=np.int64)
    mask = np.zeros((rows, q, q), dtype=bool)
    lengths = np.zeros(rows, dtype=np.int64)
    row_nodes, chain_columns, match_lengths = [0] * rows, [()] * rows, [0] * rows
    chain_next, chain_agreement, branch_cells = [EMPTY] * rows, [()] * rows, [()] * rows
    before = np.full(rows, EMPTY, dtype=np.int64) if any(p.batch.before_roots is not None for p in parts) else None
    for part in parts:
        pb, at = part.batch, np.asarray(part.rows, dtype=np.int64)
        w = pb.tokens.shape[1]
        tokens[at, :w] = pb.tokens.numpy()
        parents[at, :w] = pb.parents.numpy()
        depths[at, :w] = pb.row_depths().numpy()
        mask[at, :w, :w] = pb.mask.numpy()  # [w, w] broadcast, or [len(at), w, w]
        lengths[at] = pb.lengths.numpy() if pb.lengths is not None else w
        if before is not None and pb.before_roots is not None:
            before[at] = pb.before_roots.numpy()
        for j, r in enumerate(part.rows):
            row_nodes[r], chain_columns[r], match_lengths[r] = pb.row_nodes[j], pb.chain_columns[j], pb.match_lengths[j]
            chain_next[r], chain_agreement[r] = pb.chain_next[j], pb.chain_agreement[j]
            branch_cells[r] = pb.branch_cells[j] if pb.branch_cells else ()
    col = np.arange(q)
    pad = col[None, :] >= lengths[:, None]  # [rows, q]: a dead child of the root
    mask[:, :, 0] |= pad
    mask[:, col, col] |= pad
    packed = torch.from_numpy(lengths) if bool((lengths < q).any()) else None
    return DraftBatch(torch.from_numpy(tokens), torch.from_numpy(parents), torch.from_numpy(depths),
                      torch.from_numpy(mask), torch.zeros(0, dtype=torch.long), tuple(row_nodes), tuple(chain_columns),
                      tuple(match_lengths), max(p.batch.max_depth for p in parts), lengths=packed,
                      before_roots=torch.from_numpy(before) if before is not None else None,
                      chain_next=tuple(chain_next), chain_agreement=tuple(chain_agreement),
                      branch_cells=tuple(branch_cells), parts=tuple(parts))


def build_draft(template_tokens: torch.Tensor, tree: CompiledTree, template_nodes: torch.Tensor,
                chains: list[list[int]] | None = None, match_lengths: list[int] | None = None,
                row_nodes: list[int] | None = None, caps: list[int] | None = None,
                agreements: list[Sequence[bool]] | None = None,
                cells: list[Sequence[int] | None] | None = None) -> DraftBatch:
    """template_tokens [b, n+1]: the root and the drafted tokens of ``tree``'s n nodes (which are
    the full template's nodes ``template_nodes``); row_nodes[r]: row r verifies only the first
    row_nodes[r] of them (parents come before children, so a prefix is a tree; default: all);
    chains: per row, a retrieved continuation of the root (may be empty), hung under the root
    through the row's template nodes while the tokens agree, the rest (at most caps[r] tokens;
    default: all) as one chain right after the row's template columns; agreements[r]: per token of
    chains[r], whether the matrix agreed with it (default: never); cells[r]: per token of a branch
    drawn from the suffix index, its SuffixStats cell (None, or no ``cells``: another kind)."""
    b, width = template_tokens.shape
    n = width - 1
    chains = chains or [[] for _ in range(b)]
    match_lengths = match_lengths or [0] * b
    row_nodes = [n] * b if row_nodes is None else [min(int(k), n) for k in row_nodes]
    extras: list[tuple[int, list[int]]] = []  # (column the rest hangs under, the rest)
    chain_cols: list[tuple[int, ...]] = []
    chain_next: list[int] = []
    chain_agreement: list[tuple[bool, ...]] = []
    branch_cells: list[tuple[int, ...]] = []
    host = template_tokens.cpu().numpy() if any(chains) else None  # one copy to the host, read by both walks
    rows_tokens = host.tolist() if host is not None else None
    for r, chain in enumerate(chains):
        limit, node, cols, rest = row_nodes[r], 0, [], []
        for j, tok in enumerate(chain):
            nxt = next((c for c in tree.children[node] if c <= limit and rows_tokens[r][c] == tok), None)
            if nxt is None:
                rest = list(chain[j:]) if caps is None else list(chain[j : j + caps[r]])
                break
            node = nxt
            cols.append(nxt)
        extras.append((node, rest))
        chain_cols.append(tuple(cols))
        drafted = len(cols) + len(rest)
        chain_next.append(int(chain[drafted]) if drafted < len(chain) else EMPTY)
        observed = min(drafted + 1, len(chain))  # the drafted tokens and chain_next
        chain_agreement.append(tuple(bool(a) for a in agreements[r][:observed]) if agreements is not None
                               else (False,) * observed)
        row_cells = cells[r] if cells is not None else None
        branch_cells.append(tuple(int(c) for c in row_cells[:observed]) if row_cells else ())
    lengths = [1 + row_nodes[r] + len(extras[r][1]) for r in range(b)]
    q = max(lengths)
    parents_1d = tree.parents.clamp(min=0)
    parents_1d[0] = -1
    if all(k == n and not rest for k, (_, rest) in zip(row_nodes, extras)):  # every row: the whole tree, nothing else
        return DraftBatch(template_tokens, parents_1d[None].expand(b, width).clone(), tree.depths, tree.mask,
                          template_nodes, tuple(row_nodes), tuple(chain_cols), tuple(match_lengths),
                          tree.max_depth, chain_next=tuple(chain_next), chain_agreement=tuple(chain_agreement),
                          branch_cells=tuple(branch_cells))
    # the template columns of every row at once (a prefix of the tree, cut to the row's w = row_nodes + 1),
    # in numpy: a step builds a few [b, q] tables and each torch call on them costs several microseconds
    drafted = host if host is not None else template_tokens.cpu().numpy()
    tree_mask, tree_depths_np = tree.mask.numpy(), tree.depths.numpy()
    length_a = np.asarray(lengths, dtype=np.int64)
    widths = np.asarray(row_nodes, dtype=np.int64) + 1  # [b]
    col = np.arange(q)
    cut = min(q, width)
    own = col[None, :cut] < widths[:, None]  # [b, cut] the row's template columns
    tokens = np.full((b, q), EMPTY, dtype=np.int64)
    tokens[:, :cut] = np.where(own, drafted[:, :cut], EMPTY)
    parents = np.zeros((b, q), dtype=np.int64)
    parents[:, :cut] = np.where(own, parents_1d.numpy()[None, :cut], 0)
    depths = np.ones((b, q), dtype=np.int64)
    depths[:, :cut] = np.where(own, tree_depths_np[None, :cut], 1)
    mask = np.zeros((b, q, q), dtype=bool)
    mask[:, :cut, :cut] = tree_mask[None, :cut, :cut] & own[:, :, None] & own[:, None, :]
    pad = col[None, :] >= length_a[:, None]  # [b, q]: a dead child of the root
    mask[:, :, 0] |= pad
    mask[:, col, col] |= pad
    tree_depths = tree_depths_np.tolist()
    level_end = np.maximum.accumulate(tree_depths_np).tolist()  # level_end[i]: the deepest of nodes 0..i
    max_depth = max(level_end[k] for k in row_nodes)  # a row's template columns are nodes 0..row_nodes[r]
    for r, (under, rest) in enumerate(extras):  # the rows whose branch goes past their template nodes
        m = len(rest)
        if m == 0:
            continue
        w = row_nodes[r] + 1
        tokens[r, w : w + m] = rest
        parents[r, w] = under
        parents[r, w + 1 : w + m] = np.arange(w, w + m - 1)
        depths[r, w : w + m] = np.arange(tree_depths[under] + 1, tree_depths[under] + m + 1)
        mask[r, w : w + m, :w] = tree_mask[under, :w]  # the merge node and its ancestors
        mask[r, w : w + m, w : w + m] = np.tri(m, dtype=bool)
        max_depth = max(max_depth, tree_depths[under] + m)
        chain_cols[r] = chain_cols[r] + tuple(range(w, w + m))
    packed = torch.from_numpy(length_a) if bool((length_a < q).any()) else None
    tokens, parents, depths, mask = (torch.from_numpy(a) for a in (tokens, parents, depths, mask))
    return DraftBatch(tokens, parents, depths, mask, template_nodes, tuple(row_nodes), tuple(chain_cols),
                      tuple(match_lengths), max_depth, lengths=packed, chain_next=tuple(chain_next),
                      chain_agreement=tuple(chain_agreement), branch_cells=tuple(branch_cells))
