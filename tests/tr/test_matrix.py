"""The adjacency matrix: recycle semantics and dirty-row tracking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tr_serve.kernels.top_k import top_k_indices
from tr_serve.tr.matrix import EMPTY, STREAK_CAP, AdjacencyMatrix, last_occurrences

V = 10


def top(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids recycle takes: each row's k most likely next tokens, best first."""
    return torch.topk(logits, k, dim=-1).indices


def logits_ranking(order: list[int]) -> torch.Tensor:
    """Logits [V] whose descending order starts with ``order``; other tokens far below."""
    x = torch.full((V,), -100.0)
    for rank, tok in enumerate(order):
        x[tok] = 10.0 - rank
    return x


def test_new_matrix_is_empty():
    m = AdjacencyMatrix(V, k=3)
    assert m.table.shape == (V, 3)
    assert m.table.dtype == torch.int32
    assert bool((m.table == EMPTY).all())
    assert m.num_filled_rows() == 0
    assert m.take_dirty_rows().tolist() == []


def test_k_must_be_positive():
    with pytest.raises(ValueError, match="k must be >= 1"):
        AdjacencyMatrix(V, k=0)


def test_recycle_writes_top_k_of_each_input_token():
    m = AdjacencyMatrix(V, k=3)
    tokens = torch.tensor([2, 5])
    logits = torch.stack([logits_ranking([7, 1, 9, 4]), logits_ranking([0, 3, 8])])
    m.recycle(tokens, top(logits, m.k))
    assert m.table[2].tolist() == [7, 1, 9]  # best first, only k kept
    assert m.table[5].tolist() == [0, 3, 8]
    others = [i for i in range(V) if i not in (2, 5)]
    assert bool((m.table[others] == EMPTY).all())
    assert m.num_filled_rows() == 2


def test_recycle_overwrites_whole_row():
    m = AdjacencyMatrix(V, k=3)
    m.recycle(torch.tensor([4]), top(logits_ranking([1, 2, 3])[None], m.k))
    m.recycle(torch.tensor([4]), top(logits_ranking([9, 8, 7])[None], m.k))
    assert m.table[4].tolist() == [9, 8, 7]


def test_recycle_accepts_tree_shaped_inputs():
    # the engine passes draft [b, n+1] and logits [b, n+1, V]
    m = AdjacencyMatrix(V, k=2)
    tokens = torch.tensor([[1, 2], [3, 6]])
    logits = torch.stack(
        [
            torch.stack([logits_ranking([5, 6]), logits_ranking([7, 8])]),
            torch.stack([logits_ranking([0, 9]), logits_ranking([2, 1])]),
        ]
    )
    m.recycle(tokens, top(logits, m.k))
    assert m.table[1].tolist() == [5, 6]
    assert m.table[2].tolist() == [7, 8]
    assert m.table[3].tolist() == [0, 9]
    assert m.table[6].tolist() == [2, 1]


def test_empty_tokens_are_skipped():
    m = AdjacencyMatrix(V, k=2)
    m.recycle(torch.tensor([3]), top(logits_ranking([1, 2])[None], m.k))
    tokens = torch.tensor([EMPTY, 4, EMPTY])
    logits = torch.stack([logits_ranking([8, 9]), logits_ranking([5, 6]), logits_ranking([0, 7])])
    m.recycle(tokens, top(logits, m.k))
    assert m.table[4].tolist() == [5, 6]
    assert m.table[3].tolist() == [1, 2]  # untouched
    # EMPTY must not have been used as an index (it would hit the last row)
    assert m.table[V - 1].tolist() == [EMPTY, EMPTY]
    assert m.num_filled_rows() == 2


def test_all_empty_is_a_no_op():
    m = AdjacencyMatrix(V, k=2)
    m.recycle(torch.tensor([EMPTY, EMPTY]), top(torch.randn(2, V), m.k))
    assert m.num_filled_rows() == 0
    assert m.take_dirty_rows().tolist() == []


def test_repeated_token_last_occurrence_wins():
    m = AdjacencyMatrix(V, k=2)
    tokens = torch.tensor([6, 1, 6])
    logits = torch.stack([logits_ranking([1, 2]), logits_ranking([3, 4]), logits_ranking([8, 9])])
    m.recycle(tokens, top(logits, m.k))
    assert m.table[6].tolist() == [8, 9]
    assert m.table[1].tolist() == [3, 4]


def test_dirty_rows_are_reported_once():
    m = AdjacencyMatrix(V, k=2)
    m.recycle(torch.tensor([7, 2, 7]), top(torch.randn(3, V), m.k))
    assert m.take_dirty_rows().tolist() == [2, 7]
    assert m.take_dirty_rows().tolist() == []
    m.recycle(torch.tensor([EMPTY, 5]), top(torch.randn(2, V), m.k))
    assert m.take_dirty_rows().tolist() == [5]
    assert m.take_dirty_rows().tolist() == []
    # the table keeps its content after the dirty set is taken
    assert m.num_filled_rows() == 3


def test_clear():
    m = AdjacencyMatrix(V, k=2)
    m.recycle(torch.tensor([1, 2]), top(torch.randn(2, V), m.k))
    m.clear()
    assert m.num_filled_rows() == 0
    assert bool((m.table == EMPTY).all())
    assert m.take_dirty_rows().tolist() == []


def test_a_preferred_occurrence_wins_over_later_ones():
    m = AdjacencyMatrix(vocab_size=10, k=2)
    tokens = torch.tensor([3, 3, 3])
    logits = torch.zeros(3, 10)
    logits[0, [1, 2]] = torch.tensor([5.0, 4.0])
    logits[1, [5, 6]] = torch.tensor([5.0, 4.0])  # on the accepted path
    logits[2, [7, 8]] = torch.tensor([5.0, 4.0])
    m.recycle(tokens, top(logits, m.k), preferred=torch.tensor([False, True, False]))
    assert m.table[3].tolist() == [5, 6]
    m.recycle(tokens, top(logits, m.k))
    assert m.table[3].tolist() == [7, 8]  # no preference: the last occurrence


def test_rows_are_a_copy_of_the_table_rows():
    m = AdjacencyMatrix(vocab_size=10, k=2)
    m.recycle(torch.tensor([3, 4]), top(torch.arange(20.0).reshape(2, 10), m.k))
    rows = m.rows(torch.tensor([4, 3]))
    assert rows.tolist() == [[9, 8], [9, 8]] and rows.dtype == torch.int32
    rows[0, 0] = 1
    assert m.table[4].tolist() == [9, 8]  # the matrix is not written through the copy


def test_adopt_takes_the_table_and_keeps_the_given_rows():
    m = AdjacencyMatrix(vocab_size=6, k=2)
    m.recycle(torch.tensor([1, 2]), top(torch.arange(12.0).reshape(2, 6), m.k))  # rows 1, 2 = [5, 4], dirty
    snapshot = torch.full((6, 2), EMPTY, dtype=torch.int32)
    snapshot[2] = torch.tensor([0, 1], dtype=torch.int32)
    snapshot[3] = torch.tensor([4, 5], dtype=torch.int32)
    m.adopt(snapshot, keep_ids=torch.tensor([3]), keep_rows=torch.tensor([[2, 3]], dtype=torch.int32))
    assert m.table[1].tolist() == [5, 4]  # the snapshot holds nothing for it: ours stays
    assert m.table[2].tolist() == [0, 1] and m.table[3].tolist() == [2, 3]  # the snapshot's, then the kept
    assert m.table[0].tolist() == [EMPTY, EMPTY]
    assert m.take_dirty_rows().tolist() == [1, 2]  # adopting marks nothing as changed here
    snapshot[2, 0] = 5
    assert m.table[2].tolist() == [0, 1]  # a copy, not the snapshot itself
    with pytest.raises(ValueError, match="shape"):
        m.adopt(torch.zeros(5, 2, dtype=torch.int32))



def test_seed_fills_only_empty_rows_and_marks_nothing_dirty():
    m = AdjacencyMatrix(vocab_size=6, k=2)
    m.recycle(torch.tensor([1]), top(torch.arange(6.0).reshape(1, 6), m.k))  # row 1 = [5, 4], dirty
    m.take_dirty_rows()
    prior = torch.arange(12, dtype=torch.int32).reshape(6, 2) % 6
    assert m.seed(prior) == 5
    assert m.table[1].tolist() == [5, 4]  # learned rows are kept
    assert m.table[0].tolist() == [0, 1] and m.table[5].tolist() == [4, 5]
    assert m.take_dirty_rows().tolist() == []
    assert m.seed(torch.zeros(6, 2, dtype=torch.int32)) == 0  # nothing empty is left
    with pytest.raises(ValueError, match="shape"):
        m.seed(torch.zeros(5, 2, dtype=torch.int32))


def test_recycling_the_last_occurrences_equals_recycling_every_position():
    tokens = [3, 1, 3, 7, 1, 1, 9, 3, 0]
    assert last_occurrences(tokens) == [3, 5, 6, 7, 8]
    assert last_occurrences([]) == []
    logits = torch.randn(len(tokens), V, generator=torch.Generator().manual_seed(0))
    every, seeded = AdjacencyMatrix(V, k=3), AdjacencyMatrix(V, k=3)
    every.recycle(torch.tensor(tokens), top(logits, every.k))
    keep = last_occurrences(tokens)
    seeded.recycle(torch.tensor(tokens)[keep], top(logits[keep], seeded.k))
    assert torch.equal(every.table, seeded.table)
    # the first occurrence's logits would have written another row: the choice is not vacuous
    first = AdjacencyMatrix(V, k=3)
    first.recycle(torch.tensor([3]), top(logits[:1], first.k))
    assert not torch.equal(first.table[3], every.table[3])


def test_top_k_indices_equals_torch_topk():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 49152, generator=g)
    logits[1, 256:264] += 50.0  # the whole top 8 in one block
    logits[2, torch.arange(8) * 4096 + 5] += 50.0  # one per block, far apart
    logits[3, 127:129] += 50.0  # across a block edge
    for k in (1, 3, 8):
        assert torch.equal(top_k_indices(logits, k), torch.topk(logits, k, dim=-1).indices)
    odd = torch.randn(2, 1000, generator=g)  # does not split into blocks: torch's own
    assert torch.equal(top_k_indices(odd, 8), torch.topk(odd, 8, dim=-1).indices)
    assert torch.equal(top_k_indices(logits[:, :512], 8), torch.topk(logits[:, :512], 8, dim=-1).indices)


def test_recycle_writes_the_given_ids_with_the_winners_rules():
    """recycle writes the ids it is handed (the runner's top-k, runner/next_tokens.py): the
    preferred occurrence of a repeated token, else its last; the same winners in the pair table."""
    from tr_serve.tr.pair_table import PairTable

    g = torch.Generator().manual_seed(5)
    tokens = torch.tensor([4, 7, 4, EMPTY, 9, 7, 2])
    ids = torch.randperm(64, generator=g)[:28].reshape(7, 4)
    preferred = torch.tensor([True, False, False, False, True, False, False])
    before = torch.tensor([-1, 4, 7, 4, 4, 9, 7])
    m, pairs = AdjacencyMatrix(vocab_size=64, k=4), PairTable(64, 4, 32)
    m.recycle(tokens, ids, preferred=preferred, pairs=pairs, before=before)
    assert m.table[4].tolist() == ids[0].tolist()  # the preferred occurrence of token 4
    assert m.table[7].tolist() == ids[5].tolist() and m.table[2].tolist() == ids[6].tolist()  # the last one
    got = pairs.successors(m.table.numpy(), np.array([[9], [7]]), np.array([[7], [2]]), np.arange(4)[None])
    assert got.tolist() == [ids[5].tolist(), ids[6].tolist()]
    wider = AdjacencyMatrix(vocab_size=64, k=2)  # more ids than k: the best k are kept
    wider.recycle(tokens, ids)
    assert wider.table[9].tolist() == ids[4, :2].tolist()


def test_streak_counts_rewrites_that_keep_the_first_candidate():
    m = AdjacencyMatrix(V, k=3)
    m.recycle(torch.tensor([4]), top(logits_ranking([1, 2, 3])[None], m.k))
    assert int(m.streak[4]) == 0  # a first write: nothing was kept
    m.recycle(torch.tensor([4]), top(logits_ranking([1, 3, 2])[None], m.k))
    m.recycle(torch.tensor([4, 5]), top(torch.stack([logits_ranking([1, 9, 8]), logits_ranking([2, 3, 4])]), m.k))
    assert int(m.streak[4]) == 2 and int(m.streak[5]) == 0  # the other candidates may move
    m.recycle(torch.tensor([4, 4]), top(torch.stack([logits_ranking([7, 1, 2]), logits_ranking([1, 2, 3])]), m.k))
    assert int(m.streak[4]) == 3  # one write per recycle: the last occurrence's
    m.recycle(torch.tensor([4]), top(logits_ranking([2, 1, 3])[None], m.k))
    assert int(m.streak[4]) == 0  # a new first candidate starts over
    for _ in range(STREAK_CAP + 3):
        m.recycle(torch.tensor([4]), top(logits_ranking([2, 1, 3])[None], m.k))
    assert int(m.streak[4]) == STREAK_CAP
    m.clear()
    assert int(m.streak.abs().sum()) == 0


def test_adopt_and_seed_keep_a_streak_only_where_the_first_candidate_stays():
    m = AdjacencyMatrix(vocab_size=6, k=2)
    for _ in range(3):
        m.recycle(torch.tensor([1, 2]), top(torch.arange(12.0).reshape(2, 6), m.k))  # rows 1, 2 = [5, 4]
    assert m.streak[[1, 2]].tolist() == [2, 2]
    snapshot = torch.full((6, 2), EMPTY, dtype=torch.int32)
    snapshot[1] = torch.tensor([5, 0], dtype=torch.int32)  # the same first candidate
    snapshot[2] = torch.tensor([3, 4], dtype=torch.int32)
    m.adopt(snapshot)
    assert m.streak[[1, 2]].tolist() == [2, 0]
    m.seed(torch.zeros(6, 2, dtype=torch.int32))
    assert int(m.streak.abs().sum()) == 2


def test_confident_chains_follow_first_candidates_through_rows_with_a_streak():
    m = AdjacencyMatrix(V, k=2)
    for _ in range(3):  # 1 -> 2 -> 3 -> 1 with streak 2 each, 6 -> 7 with streak 0 (written once below)
        m.recycle(torch.tensor([1, 2, 3]), top(torch.stack([logits_ranking([2, 0]), logits_ranking([3, 0]),
                                                        logits_ranking([1, 0])]), m.k))
    m.recycle(torch.tensor([6, 3]), top(torch.stack([logits_ranking([7, 0]), logits_ranking([9, 0])]), m.k))
    # 3's first candidate moved to 9: its streak is 0, so a chain stops after reaching 3
    assert m.confident_chains([1, 2, 6, 5, 3], [8, 1, 8, 8, 8], 2) == [[2, 3], [3], [], [], []]
    assert m.confident_chains([1, 6], [8, 8], 0) == [[2, 3, 9], [7]]  # 9 and 7: empty rows end them
    assert m.confident_chains([1], [0], 0) == [[]]


def test_the_recycled_rows_write_raises_a_kept_first_candidates_streak_and_resets_a_changed_one():
    from tr_serve.tr.matrix import write_rows_on_host

    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        vocab = 10
        table = torch.randint(-1, 3, (vocab, 2), generator=gen, dtype=torch.int32)
        streak = torch.randint(0, STREAK_CAP + 1, (vocab,), generator=gen, dtype=torch.int8)
        dirty = torch.rand(vocab, generator=gen) < 0.3
        ids = torch.randperm(vocab, generator=gen)[:4]
        rows = torch.randint(0, 3, (4, 2), generator=gen, dtype=torch.int32)
        expected_streak = torch.where(table[ids, 0] == rows[:, 0], (streak[ids] + 1).clamp(max=STREAK_CAP), 0)
        untouched = torch.ones(vocab, dtype=torch.bool)
        untouched[ids] = False
        before = [t.clone() for t in (table, streak, dirty)]
        write_rows_on_host(table.numpy(), streak.numpy(), dirty.numpy(), ids.numpy(), rows.numpy())
        assert torch.equal(table[ids], rows) and dirty[ids].all() and torch.equal(streak[ids], expected_streak)
        for now, was in zip((table, streak, dirty), before):
            assert torch.equal(now[untouched], was[untouched])


def test_first_candidates_read_each_tokens_first_candidate():
    m = AdjacencyMatrix(V, 3)
    m.recycle(torch.tensor([2, 5]), top(torch.stack([logits_ranking([7, 1]), logits_ranking([4, 2])]), m.k))
    assert m.first_candidates([5, 2, 3, 5]) == [4, 7, EMPTY, 4]
    assert m.first_candidates([]) == []
