"""The pair table: rows keyed by (token before, token), drafted before the matrix's, recycled alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_matrix import V, logits_ranking

from tr_serve.tr.matrix import EMPTY, AdjacencyMatrix
from tr_serve.tr.pair_table import PairTable
from tr_serve.tr.proposer import propose
from tr_serve.tr.tree import DEFAULT_TREE, compile_tree


def test_slots_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        PairTable(V, 2, slots=12)


def test_a_stored_pair_drafts_its_row_and_an_unseen_pair_the_tokens_row():
    m = AdjacencyMatrix(V, k=2)
    pairs = PairTable(V, 2, slots=64)
    m.table[3] = torch.tensor([1, 2], dtype=torch.int32)
    pairs.write(torch.tensor([7]), torch.tensor([3]), torch.tensor([[8, 9]]))
    table = m.table.numpy()
    got = pairs.successors(table, np.array([[7], [6], [EMPTY]]), np.array([[3], [3], [3]]), np.array([[0, 1]]))
    assert got.tolist() == [[8, 9], [1, 2], [1, 2]]  # the pair; an unseen pair; no token before


def test_a_pair_that_lost_its_slot_falls_back_to_the_matrix():
    pairs = PairTable(V, 1, slots=1)  # every pair shares the one slot
    m = AdjacencyMatrix(V, k=1)
    m.table[:] = 5
    pairs.write(torch.tensor([1]), torch.tensor([2]), torch.tensor([[7]]))
    pairs.write(torch.tensor([3]), torch.tensor([4]), torch.tensor([[8]]))
    got = pairs.successors(m.table.numpy(), np.array([1, 3]), np.array([2, 4]), np.array([0, 0]))
    assert got.tolist() == [5, 8]
    assert int((pairs.keys >= 0).sum()) == 1


def test_one_write_of_two_pairs_in_one_slot_keeps_a_pair_with_its_own_row():
    pairs = PairTable(V, 1, slots=1)
    pairs.write(torch.tensor([1, 3]), torch.tensor([2, 4]), torch.tensor([[7], [8]]))
    key = int(pairs.keys[0])
    assert (key, int(pairs.rows[0, 0])) in {(1 * V + 2, 7), (3 * V + 4, 8)}


def test_pairs_with_no_token_before_are_not_written():
    pairs = PairTable(V, 1, slots=8)
    pairs.write(torch.tensor([EMPTY]), torch.tensor([2]), torch.tensor([[7]]))
    assert int((pairs.keys >= 0).sum()) == 0


def reference_propose(m: AdjacencyMatrix, pairs: PairTable, root: int, before: int, tree) -> list[int]:
    """Node by node: the row of (parent's parent token, parent token) where the table holds that
    pair, else the parent token's row, at the node's rank."""
    tokens, prev = [root], [before]
    stored = {int(k): pairs.rows[i].tolist() for i, k in enumerate(pairs.keys.tolist()) if k >= 0}
    for i in range(1, tree.num_nodes + 1):
        p = int(tree.parents[i])
        tok, b = tokens[p], prev[p]
        if tok == EMPTY:
            tokens.append(EMPTY)
        else:
            row = stored.get(b * V + tok) if b >= 0 else None
            tokens.append(row[int(tree.ranks[i])] if row is not None else int(m.table[tok, int(tree.ranks[i])]))
        prev.append(tok)
    return tokens


def test_propose_with_pairs_matches_the_reference():
    g = torch.Generator().manual_seed(3)
    m = AdjacencyMatrix(V, k=8)
    m.table.copy_(torch.randint(0, V, (V, 8), generator=g, dtype=torch.int32))
    m.table[torch.randint(0, V, (V // 3,), generator=g)] = EMPTY
    pairs = PairTable(V, 8, slots=1 << 10)
    n = 40
    pairs.write(torch.randint(0, V, (n,), generator=g), torch.randint(0, V, (n,), generator=g),
                torch.randint(0, V, (n, 8), generator=g))
    tree = compile_tree(DEFAULT_TREE)
    roots, before = torch.tensor([0, 5, 7, V - 1]), torch.tensor([3, EMPTY, 7, 1])
    want = [reference_propose(m, pairs, int(r), int(b), tree) for r, b in zip(roots, before)]
    host = propose(m, roots, tree, pairs=pairs, before=before)
    assert host.tolist() == want
    assert not torch.equal(host, propose(m, roots, tree))  # the pairs changed the draft
    shallow = propose(m, roots, tree, 2, pairs, before)
    assert torch.equal(shallow[:, : 1 + 8 + 21], host[:, : 1 + 8 + 21])


def test_recycle_writes_each_pairs_row_with_the_preferred_node_winning():
    m = AdjacencyMatrix(V, k=2)
    pairs = PairTable(V, 2, slots=1 << 8)
    tokens = torch.tensor([4, 4, 4, 6])
    before = torch.tensor([1, 2, 2, EMPTY])  # nodes 1 and 2 are one pair; node 3 has no pair
    logits = torch.stack([logits_ranking([0, 1]), logits_ranking([2, 3]), logits_ranking([5, 6]), logits_ranking([8, 9])])
    m.recycle(tokens, torch.topk(logits, 2).indices, preferred=torch.tensor([False, True, False, False]), pairs=pairs,
              before=before)
    assert m.table[4].tolist() == [2, 3]  # the matrix: the preferred occurrence of token 4
    assert m.table[6].tolist() == [8, 9]
    got = pairs.successors(np.full((V, 2), EMPTY, dtype=np.int32), np.array([[1], [2], [3]]),
                           np.array([[4], [4], [4]]), np.array([[0, 1]]))
    assert got.tolist() == [[0, 1], [2, 3], [EMPTY, EMPTY]]  # pair (2, 4): the preferred node 1
    assert int((pairs.keys >= 0).sum()) == 2


def test_clear_empties_the_table():
    pairs = PairTable(V, 1, slots=8)
    pairs.write(torch.tensor([1]), torch.tensor([2]), torch.tensor([[7]]))
    pairs.clear()
    assert int((pairs.keys >= 0).sum()) == 0 and bool((pairs.rows == EMPTY).all())


def test_chains_follow_stored_pairs_to_the_first_missing_one():
    pairs = PairTable(V, 2, slots=1 << 8)
    # (1, 2) -> 3, (2, 3) -> 4, (3, 4) not stored; (5, 6) -> 7, (6, 7) -> 6, (7, 6) -> 7: a loop
    pairs.write(torch.tensor([1, 2, 5, 6, 7]), torch.tensor([2, 3, 6, 7, 6]),
                torch.tensor([[3, 9], [4, 9], [7, 9], [6, 9], [7, 9]]))
    before, roots = torch.tensor([1, 5, EMPTY, 8, 1]), torch.tensor([2, 6, 2, 2, 2])
    lengths = [8, 5, 8, 8, 1]
    want = [[3, 4], [7, 6, 7, 6, 7], [], [], [3]]  # no token before; an unseen pair; a cap of 1
    assert pairs.chains(before, roots, lengths) == want
    assert pairs.chains(before, roots, [0] * 5) == [[]] * 5
