"""Prompt seeding follows the budget: always with a fixed tree, only while "auto" verifies nodes."""

from __future__ import annotations

import pytest
import torch

from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.matrix import AdjacencyMatrix


def _seeded_prefills(engine: Engine, n_requests: int = 2) -> list[bool]:
    calls = []
    real = engine.runner.prefill

    def prefill(rows, chunks, logit_positions=None):
        calls.append(logit_positions is not None)
        return real(rows, chunks, logit_positions)

    engine.runner.prefill = prefill
    for i in range(n_requests):
        engine.add_request([5 + i, 77, 300, 12 + i], SamplingParams(max_tokens=4))
        while engine.has_unfinished():
            engine.step()
    return calls


@pytest.mark.parametrize("budget", ["fixed", "auto"])
def test_seeding_follows_the_budget(tokenizer, tmp_path, monkeypatch, budget):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    engine = Engine(tiny_loaded(tokenizer, seed=6), EngineConfig(model="tiny", tree="top4", budget=budget,
                                                                 max_num_seqs=1, max_model_len=64))
    if budget == "auto":
        import tr_serve.tr.budget as budget_module

        # a fresh budget has no evidence that the matrix is used: no seeding until it verifies
        # nodes (a moving mean of at least one per row; here every step verifies all 4)
        monkeypatch.setattr(budget_module, "choose_plan", lambda *args, **kwargs: [(4, 0)] * len(args[1]))
        assert _seeded_prefills(engine) == [False, True]
        assert engine.drafter.mean_nodes >= 1.0
        # plain decoding wins every step: once the moving average of the budget is below one node,
        # the LM head over the prompt is not run any more
        monkeypatch.setattr(budget_module, "choose_plan", lambda *args, **kwargs: [(0, 0)] * len(args[1]))
        for _ in range(8):  # 3 decode steps each: the moving average decays by 0.9 per step
            _seeded_prefills(engine, 1)
        assert engine.drafter.mean_nodes < 1.0
        assert _seeded_prefills(engine) == [False, False]
    else:
        assert _seeded_prefills(engine) == [True, True]  # a fixed tree always seeds
        assert _seeded_prefills(engine) == [True, True]


def test_seeding_writes_what_the_lm_head_over_every_prompt_position_would(tokenizer, tmp_path, monkeypatch):
    """The engine runs the LM head over each distinct token's last position only; the matrix it
    leaves equals a recycle of every position's logits."""
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    loaded = tiny_loaded(tokenizer, seed=6)
    engine = Engine(loaded, EngineConfig(model="tiny", tree="top4", max_num_seqs=2, max_model_len=64))
    prompt = [5, 77, 300, 5, 12, 77, 77, 41, 300, 9]
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    runner = engine.runner
    _, every = runner.prefill(torch.tensor([1]), [prompt], logit_positions=[list(range(len(prompt)))])
    want = AdjacencyMatrix(loaded.model.config.vocab_size, engine.matrix.k)
    want.recycle(torch.tensor(prompt), every[0])
    assert torch.equal(engine.matrix.table, want.table)
    assert engine.matrix.num_filled_rows() == len(set(prompt))
