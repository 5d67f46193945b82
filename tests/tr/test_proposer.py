"""Drafting a static tree from a known adjacency matrix."""

from __future__ import annotations

import torch

from tr_serve.tr.matrix import EMPTY, AdjacencyMatrix
from tr_serve.tr.proposer import propose
from tr_serve.tr.tree import DEFAULT_TREE, compile_tree

V = 10
# node 1 = (0), 2 = (1), 3 = (0,0), 4 = (0,1), 5 = (0,0,0)
SMALL = compile_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])


def matrix_from(rows: dict[int, list[int]], k: int = 2) -> AdjacencyMatrix:
    m = AdjacencyMatrix(V, k=k)
    for tok, cands in rows.items():
        m.table[tok] = torch.tensor(cands, dtype=torch.int32)
    return m


def reference_propose(table: torch.Tensor, root: int, tree) -> list[int]:
    """Node by node, in template order: the parent's row, at the node's rank."""
    out = [root]
    for i in range(1, tree.num_nodes + 1):
        parent_tok = out[int(tree.parents[i])]
        out.append(EMPTY if parent_tok == EMPTY else int(table[parent_tok, int(tree.ranks[i])]))
    return out


def test_tokens_per_node():
    m = matrix_from({3: [5, 6], 5: [7, EMPTY], 7: [1, 2]})
    draft = propose(m, torch.tensor([3]), SMALL)
    assert draft.shape == (1, 6)
    assert draft.dtype == torch.long
    # root 3; (0) = row3[0] = 5; (1) = row3[1] = 6; (0,0) = row5[0] = 7; (0,1) = row5[1] = EMPTY;
    # (0,0,0) = row7[0] = 1
    assert draft[0].tolist() == [3, 5, 6, 7, EMPTY, 1]


def test_empty_propagates_to_descendants_and_never_reads_row_zero():
    # row 0 is full: a node whose parent is EMPTY must not read it (EMPTY is not an index)
    m = matrix_from({0: [9, 9], 9: [8, 8], 8: [4, 4], 3: [EMPTY, 5]})
    # 1 = (0), 2 = (1), 3 = (0,0), 4 = (1,0), 5 = (0,0,0), 6 = (1,0,0)
    tree = compile_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]])
    draft = propose(m, torch.tensor([3]), tree)
    # (0) is EMPTY (no rank-0 candidate), so (0,0) and (0,0,0) are EMPTY too; (1) = 5, whose row is
    # empty, so (1,0) and (1,0,0) are EMPTY
    assert draft[0].tolist() == [3, EMPTY, 5, EMPTY, EMPTY, EMPTY, EMPTY]


def test_cold_matrix_drafts_nothing():
    m = AdjacencyMatrix(V, k=8)
    tree = compile_tree(DEFAULT_TREE)
    draft = propose(m, torch.tensor([4, 0]), tree)
    assert draft[:, 0].tolist() == [4, 0]
    assert bool((draft[:, 1:] == EMPTY).all())


def test_batch_rows_are_independent():
    m = matrix_from({1: [2, 3], 2: [4, 5], 4: [6, 7], 3: [EMPTY, EMPTY]})
    draft = propose(m, torch.tensor([1, 3, 9]), SMALL)
    assert draft[0].tolist() == [1, 2, 3, 4, 5, 6]
    assert draft[1].tolist() == [3, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY]
    assert draft[2].tolist() == [9, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY]  # row 9 never filled


def test_random_matrix_matches_reference_and_stays_in_range():
    g = torch.Generator().manual_seed(0)
    vocab, k = 12, 8
    m = AdjacencyMatrix(vocab, k=k)
    m.table.copy_(torch.randint(-1, vocab, (vocab, k), generator=g, dtype=torch.int32))
    m.table[torch.randint(0, vocab, (4,), generator=g)] = EMPTY  # some rows never filled
    tree = compile_tree(DEFAULT_TREE)
    roots = torch.arange(vocab)
    draft = propose(m, roots, tree)
    assert draft.shape == (vocab, 81)
    assert bool(((draft >= EMPTY) & (draft < vocab)).all())
    for r in range(vocab):
        assert draft[r].tolist() == reference_propose(m.table, r, tree)


def test_prefix_draft_is_prefix_of_full_draft():
    # the engine drafts the full template and verifies a prefix of it
    g = torch.Generator().manual_seed(1)
    m = AdjacencyMatrix(V, k=8)
    m.table.copy_(torch.randint(0, V, (V, 8), generator=g, dtype=torch.int32))
    full = compile_tree(DEFAULT_TREE)
    roots = torch.tensor([0, 5])
    full_draft = propose(m, roots, full)
    for n in (1, 4, 16, 32):
        assert torch.equal(propose(m, roots, full.prefix(n)), full_draft[:, : n + 1])


def test_max_depth_fills_only_the_shallow_levels():
    m = matrix_from({1: [2, 3], 2: [4, 5], 4: [6, 7]})
    full = propose(m, torch.tensor([1]), SMALL)
    one = propose(m, torch.tensor([1]), SMALL, max_depth=1)
    two = propose(m, torch.tensor([1]), SMALL, max_depth=2)
    assert full[0].tolist() == [1, 2, 3, 4, 5, 6]
    assert one[0].tolist() == [1, 2, 3, EMPTY, EMPTY, EMPTY]
    assert two[0].tolist() == [1, 2, 3, 4, 5, EMPTY]


def test_propose_fills_every_node_from_its_parents_row_down_to_the_depth_asked():
    # the reference, node by node in level order: EMPTY under an EMPTY parent and below max_depth
    g = torch.Generator().manual_seed(2)
    m = AdjacencyMatrix(V, k=8)
    m.table.copy_(torch.randint(0, V, (V, 8), generator=g, dtype=torch.int32))
    m.table[torch.randint(0, V, (V // 3,), generator=g)] = EMPTY  # rows with no candidates yet
    tree = compile_tree(DEFAULT_TREE)
    roots = torch.tensor([0, 5, 7, V - 1])
    for depth in (None, 1, 3):
        got = propose(m, roots, tree, depth)
        for r, root in enumerate(roots.tolist()):
            want = [root]
            for i in range(1, tree.num_nodes + 1):
                parent = want[int(tree.parents[i])]
                deep = depth is not None and int(tree.depths[i]) > depth
                want.append(EMPTY if parent == EMPTY or deep else int(m.table[parent, int(tree.ranks[i])]))
            assert got[r].tolist() == want
        assert got.dtype == torch.long
    assert (got == EMPTY).any() and (got[:, 1:] != EMPTY).any()