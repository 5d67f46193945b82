"""The fleet merge rule (tr_serve.fleet.merge): pure functions, no Ray."""

from __future__ import annotations

import numpy as np
import pytest

from tr_serve.fleet.merge import EMPTY, decay, last_per_row, merge_push, merge_rows, rank_weights
from tr_serve.tr.matrix import EMPTY as MATRIX_EMPTY

HL = 10.0  # half-life (s) used below


def empty_state(n: int, k: int):
    return (np.full((n, k), EMPTY, dtype=np.int32), np.zeros((n, k), dtype=np.float32), np.zeros(n, dtype=np.float64))


def merge1(old_c, old_s, old_t, new_c, now):
    c, s, t = merge_rows(np.array([old_c], dtype=np.int32), np.array([old_s], dtype=np.float32),
                         np.array([old_t], dtype=np.float64), np.array([new_c], dtype=np.int32), now, HL)
    return c[0].tolist(), s[0].tolist(), float(t[0])


def test_empty_is_the_matrix_empty():
    assert EMPTY == MATRIX_EMPTY


def test_rank_weights_and_decay():
    assert rank_weights(4).tolist() == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4])
    assert float(decay(10.0, 10.0)) == pytest.approx(0.5)
    assert float(decay(0.0, 10.0)) == 1.0
    assert float(decay(-5.0, 10.0)) == 1.0  # no growth for a stamp in the future
    with pytest.raises(ValueError):
        decay(1.0, 0.0)


def test_row_from_one_replica_only_is_taken_as_is():
    c, s, t = merge1([EMPTY] * 4, [0] * 4, 0.0, [7, 3, 9, 1], now=100.0)
    assert c == [7, 3, 9, 1]  # ranks kept
    assert s == pytest.approx([1, 1 / 2, 1 / 3, 1 / 4])
    assert t == 100.0


def test_agreement_beats_a_single_fresh_vote():
    # tokens 5 and 6 were voted rank 0 and 1 twice before; a new push puts 8 first
    c, s, _ = merge1([5, 6, EMPTY], [2.0, 1.0, 0.0], 100.0, [8, 5, 6], now=100.0)
    assert c == [5, 6, 8]  # 5: 2 + 1/2, 6: 1 + 1/3, 8: 1
    assert s == pytest.approx([2.5, 1 + 1 / 3, 1.0])


def test_recency_old_votes_fade():
    # the same history, a long time ago: the new push wins
    c, s, t = merge1([5, 6, EMPTY], [2.0, 1.0, 0.0], 100.0, [8, 9, EMPTY], now=100.0 + 3 * HL)
    assert c == [8, 9, 5]  # 5 decayed to 2/8 = 0.25 < 1/2
    assert s == pytest.approx([1.0, 0.5, 0.25])
    assert t == 100.0 + 3 * HL


def test_push_older_than_the_row_is_decayed_instead():
    # the row's stamp is ahead of this push's clock: the push counts less, the stamp stays
    c, s, t = merge1([5, EMPTY], [1.0, 0.0], 200.0, [8, EMPTY], now=200.0 - HL)
    assert c == [5, 8]
    assert s == pytest.approx([1.0, 0.5])
    assert t == 200.0


def test_ties_go_to_the_newer_evidence_in_push_rank_order():
    # old 4 has score 1.0 exactly like the new rank-0 candidate 2: the push wins the tie
    c, _, _ = merge1([4, EMPTY], [1.0, 0.0], 50.0, [2, EMPTY], now=50.0)
    assert c == [2, 4]
    # two new candidates tied with two old ones after decay: push first (by rank), then old
    c, s, _ = merge1([4, 3], [2.0, 1.0], 0.0, [1, 2], now=HL)  # old decays to 1.0, 0.5
    assert c == [1, 4]
    assert s == pytest.approx([1.0, 1.0])


def test_k_smaller_than_the_union_keeps_the_top_k():
    c, s, _ = merge1([10, 11, 12], [3.0, 0.2, 0.1], 0.0, [20, 21, 22], now=0.0)
    # union: 10:3, 20:1, 21:.5, 22:.333, 11:.2, 12:.1
    assert c == [10, 20, 21]
    assert s == pytest.approx([3.0, 1.0, 0.5])


def test_duplicate_token_in_both_lists_is_summed_and_appears_once():
    c, s, _ = merge1([7, 8], [1.0, 0.5], 0.0, [8, 7], now=0.0)
    assert sorted(c) == [7, 8] and len(set(c)) == 2
    assert dict(zip(c, s)) == pytest.approx({7: 1.5, 8: 1.5})
    assert c == [8, 7]  # tie: 8 is the push's rank 0


def test_empty_handling():
    # EMPTY never becomes a candidate, holds no score, and pads a short row at the end
    c, s, _ = merge1([EMPTY, EMPTY, EMPTY], [5.0, 5.0, 5.0], 0.0, [EMPTY, EMPTY, EMPTY], now=0.0)
    assert c == [EMPTY] * 3 and s == [0.0] * 3
    c, s, _ = merge1([3, EMPTY, EMPTY], [1.0, 9.0, 9.0], 0.0, [EMPTY, EMPTY, EMPTY], now=0.0)
    assert c == [3, EMPTY, EMPTY] and s == pytest.approx([1.0, 0.0, 0.0])
    # a push with holes (EMPTY in the middle) still fills from the left
    c, _, _ = merge1([EMPTY] * 3, [0] * 3, 0.0, [EMPTY, 6, EMPTY], now=0.0)
    assert c == [6, EMPTY, EMPTY]


def test_inputs_are_not_modified_and_shapes_are_checked():
    old = empty_state(3, 2)
    copies = [a.copy() for a in old]
    new = np.array([[1, 2], [3, EMPTY], [EMPTY, EMPTY]], dtype=np.int32)
    merge_rows(*old, new, 1.0, HL)
    for a, b in zip(old, copies):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError):
        merge_rows(*old, new[:, :1], 1.0, HL)


def test_many_rows_match_row_by_row_merges():
    rng = np.random.default_rng(0)
    n, k, vocab = 9000, 4, 30  # more than one internal chunk
    old_c = rng.integers(-1, vocab, size=(n, k)).astype(np.int32)
    old_s = rng.random((n, k)).astype(np.float32)
    old_t = rng.random(n) * 100
    new_c = rng.integers(-1, vocab, size=(n, k)).astype(np.int32)
    c, s, t = merge_rows(old_c, old_s, old_t, new_c, 50.0, HL)
    for i in rng.choice(n, size=50, replace=False):
        ci, si, ti = merge1(old_c[i], old_s[i], old_t[i], new_c[i], 50.0)
        assert c[i].tolist() == ci and s[i].tolist() == pytest.approx(si) and t[i] == ti
    filled = c != EMPTY
    for row in c:  # no duplicates, EMPTY only at the end
        vals = row[row != EMPTY]
        assert len(set(vals.tolist())) == vals.size
    assert (filled[:, :-1] | ~filled[:, 1:]).all()


def test_merge_push_in_place_last_occurrence_wins():
    cands, scores, stamp = empty_state(6, 2)
    n = merge_push(cands, scores, stamp, np.array([4, 1, 4]), np.array([[1, 2], [3, 5], [0, 5]]), 7.0, HL)
    assert n == 2
    assert cands[4].tolist() == [0, 5] and cands[1].tolist() == [3, 5]
    assert stamp[4] == 7.0 and stamp[0] == 0.0
    assert cands[0].tolist() == [EMPTY, EMPTY]
    ids, rows = last_per_row(np.array([], dtype=np.int64), np.zeros((0, 2), dtype=np.int32))
    assert ids.size == 0 and rows.shape == (0, 2)
    assert merge_push(cands, scores, stamp, ids, rows, 8.0, HL) == 0
