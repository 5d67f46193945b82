"""The speculator: which tables each tree setting uses by default, its KV scratch, its latency calibration."""

from __future__ import annotations

import pytest
import torch

from tr_serve.engine.config import EngineConfig
from tr_serve.tr.drafter import HYBRID_CONTEXT, PLD_CONTEXT
from tr_serve.tr.speculator import Speculator
from tr_serve.tr.step_latency import LatencyTable

VOCAB = 64


def _speculator(calls: list | None = None, rows: int = 3, **settings) -> Speculator:
    def calibrate(max_tokens: int, recycle_k: int, adopt) -> LatencyTable:
        if calls is not None:
            calls.append((max_tokens, recycle_k))
        return LatencyTable((1, 64), (1.0, 1.1))

    return Speculator(EngineConfig(model="tiny", **settings), VOCAB, rows, calibrate=calibrate)


@pytest.mark.parametrize("tree, matrix, seeds, pairs, suffix", [
    ("none", False, False, False, False),
    ("pld", False, False, False, False),
    ("2.2.2", True, True, False, False),
    ("2.2.2+ctx", True, True, True, False),
    ("auto", True, False, False, True),
])
def test_each_tree_uses_its_default_tables(tree, matrix, seeds, pairs, suffix):
    s = _speculator(tree=tree)
    assert (s.uses_matrix, s.seeds_prompts, s.pairs is not None, s.suffix is not None) == (matrix, seeds, pairs, suffix)
    assert s.recycle_k == (8 if matrix else 0)
    assert (s.drafter is None) == (tree == "none")
    assert s.seed_positions([[5, 6, 5]]) == ([[1, 2]] if seeds else None)  # the last occurrence of each token


def test_settings_override_the_defaults():
    s = _speculator(tree="auto", prompt_seeding=True, pair_table=True, suffix_index=False)
    assert s.seeds_prompts and s.pairs is not None and s.suffix is None
    assert not _speculator(tree="2.2.2+ctx", prompt_seeding=False, pair_table=False).seeds_prompts


def test_kv_scratch_holds_a_steps_whole_tree():
    hybrid = 80 + HYBRID_CONTEXT.max_tokens + 1  # the 80-node template, the longest branch, the root
    scratch_of = {"none": 1, "pld": PLD_CONTEXT.max_tokens + 1, "2.2.2": 80 + 1, "2.2.2+ctx": hybrid, "auto": hybrid}
    for tree, scratch in scratch_of.items():
        assert Speculator.kv_scratch(EngineConfig(model="tiny", tree=tree)) == scratch, tree


def test_only_the_cost_aware_budget_calibrates_for_every_rows_whole_tree():
    calls: list = []
    _speculator(calls, tree="2.2.2+ctx")
    assert calls == []
    s = _speculator(calls, rows=3, tree="auto")
    assert calls == [(3 * (Speculator.kv_scratch(s.settings) + 1), 8)]
    assert s.drafter.budget.latency.table == LatencyTable((1, 64), (1.0, 1.1))
    with pytest.raises(ValueError, match="calibrate"):
        Speculator(EngineConfig(model="tiny", tree="auto"), VOCAB, 1)


def test_a_matrix_handed_in_keeps_its_learned_rows_under_the_prior():
    from tr_serve.tr.matrix import AdjacencyMatrix

    kept = AdjacencyMatrix(VOCAB, 8)
    kept.table[3] = torch.arange(8, dtype=torch.int32)
    s = Speculator(EngineConfig(model="tiny", tree="2.2.2"), VOCAB, 1, matrix=kept)
    s.seed_prior(torch.full((VOCAB, 8), 9, dtype=torch.int32))
    assert s.matrix is kept and kept.table[3].tolist() == list(range(8)) and kept.table[4].tolist() == [9] * 8
