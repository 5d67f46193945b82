"""Prompt seeding: by default with a fixed template, not under the cost-aware budget; forced on or off by the config."""

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


@pytest.mark.parametrize("tree, budget, setting, seeds", [
    ("top4", "fixed", None, True),  # a fixed template seeds by default
    ("top4", "auto", None, False),  # the cost-aware budget does not (measured: no MAT gain, 2-3% of the wall)
    ("auto", "fixed", None, False),
    ("auto", "fixed", True, True),  # forced on
    ("top4", "fixed", False, False),  # forced off
    ("pld", "fixed", True, False),  # no matrix, nothing to seed
])
def test_seeding_follows_the_method_unless_forced(tokenizer, tmp_path, monkeypatch, tree, budget, setting, seeds):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    engine = Engine(tiny_loaded(tokenizer, seed=6), EngineConfig(model="tiny", tree=tree, budget=budget,
                                                                 max_num_seqs=1, max_model_len=64,
                                                                 prompt_seeding=setting))
    assert engine.speculator.seeds_prompts is seeds
    assert _seeded_prefills(engine) == [seeds, seeds]


def test_seeding_writes_what_the_lm_head_over_every_prompt_position_would(tokenizer, tmp_path, monkeypatch):
    """The engine runs the LM head over each distinct token's last position only; the matrix it
    leaves equals a recycle of every position's logits."""
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    loaded = tiny_loaded(tokenizer, seed=6)
    engine = Engine(loaded, EngineConfig(model="tiny", tree="top4", max_num_seqs=2, max_model_len=64,
                                         matrix_prior=False))  # the rows the prompt wrote, nothing else
    prompt = [5, 77, 300, 5, 12, 77, 77, 41, 300, 9]
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    runner = engine.runner
    _, every = runner.prefill(torch.tensor([1]), [prompt], logit_positions=[list(range(len(prompt)))])
    want = AdjacencyMatrix(loaded.model.config.vocab_size, engine.matrix.k)
    want.recycle(torch.tensor(prompt), torch.topk(every[0], want.k).indices)
    assert torch.equal(engine.matrix.table, want.table)
    assert engine.matrix.num_filled_rows() == len(set(prompt))
