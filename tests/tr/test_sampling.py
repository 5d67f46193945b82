"""Sampling: transformers-compatible logits processing, position-keyed draws made on the device,
and the tree walk over them keeps the distribution."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.sampling_params import SamplingParams
import numpy as np

from tr_serve.runner.sampler import draw, position_uniforms, process_logits, request_seed, sample_rows
from tr_serve.runner.step_io import RowSampler


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6)])
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.softmax(-1)
    torch.testing.assert_close(process_logits(logits, temperature, top_k, top_p), expected)


def test_uniforms_depend_on_the_seed_and_the_position_only():
    u = position_uniforms(np.array([7, 7, 7, 8]), np.array([3, 4, 3, 3]))
    assert u[0] == u[2]  # the same request and position: the same draw, whatever else is in the step
    assert len({float(x) for x in u}) == 3 and ((u >= 0) & (u < 1)).all()
    many = position_uniforms(np.full(20_000, 123), np.arange(20_000))
    assert abs(many.mean() - 0.5) < 0.01 and abs((many < 0.1).mean() - 0.1) < 0.01  # uniform enough
    assert request_seed(5) == 5 and request_seed(-1) == (1 << 63) - 1 and 0 <= request_seed(None) < 1 << 63


def test_draw_is_the_inverse_cdf_and_never_picks_a_token_without_mass():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75], [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    u = torch.tensor([0.2, 0.5, 0.999999999])
    assert draw(probs, u).tolist() == [1, 1, 3]
    assert draw(probs[:1], torch.tensor([0.25])).tolist() == [3]  # the boundary belongs to the next token
    assert draw(probs[1:2], torch.tensor([1.0])).tolist() == [1]  # past the top: the last token with mass


def test_sample_rows_draws_only_the_sampled_rows_with_their_settings():
    torch.manual_seed(0)
    logits = torch.randn(5, 32) * 4
    node_rows, positions = np.array([0, 0, 1, 2, 2]), np.array([10, 11, 4, 7, 8])
    hot, cold = RowSampler(1.0, 0, 1.0, seed=3), RowSampler(0.01, 1, 1.0, seed=4)
    picked, drawn = sample_rows(logits, node_rows, positions, (hot, None, cold))
    assert picked.tolist() == [0, 1, 3, 4]
    assert drawn[2:].tolist() == logits[3:].argmax(-1).tolist()  # top_k=1 leaves the argmax alone
    again = sample_rows(logits[[0, 1]], node_rows[:2], positions[:2], (hot,))
    assert again[1].tolist() == drawn[:2].tolist()  # the same seed and positions: the same draws
    assert sample_rows(logits, node_rows, positions, (None, None, None)) is None


def _critical_chi2(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z=3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_tree_sampling_keeps_the_model_distribution(tokenizer):
    """Chi-square goodness of fit of the 2nd and 3rd tokens (drawn through the tree walk) against
    the exact distribution computed from the model; the matrix is warm so drafts are accepted."""
    loaded = tiny_loaded(tokenizer, seed=1, init_range=0.6)
    model = loaded.model
    prompt = [17, 230, 402]
    temperature, top_k = 1.0, 6
    engine = Engine(loaded, EngineConfig(model="tiny", tree="2.2.2", max_num_seqs=64, max_model_len=64))

    def probs(ids):
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return process_logits(logits, temperature, top_k, 1.0)

    # exact marginals of token 2 and token 3
    p1 = probs(prompt)
    p2 = torch.zeros_like(p1)
    p3 = torch.zeros_like(p1)
    for t1 in p1.nonzero().flatten().tolist():
        q2 = probs(prompt + [t1])
        p2 += p1[t1] * q2
        for t2 in q2.nonzero().flatten().tolist():
            p3 += p1[t1] * q2[t2] * probs(prompt + [t1, t2])

    def run(seeds):
        for s in seeds:
            engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True))
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        return outs

    run(range(10_000, 10_200))  # warm the matrix with the model's own predictions
    outs = run(range(3000))
    steps = [a for o in outs for a in o.stats.accepted_per_step]
    assert sum(steps) / len(steps) > 1.15, "the tree walk should accept drafts on a warm matrix"
    for position, exact in ((1, p2), (2, p3)):
        counts = torch.zeros_like(exact)
        for o in outs:
            counts[o.token_ids[position]] += 1
        support = exact > 0
        assert counts[~support].sum() == 0, "a token outside the top-k support was emitted"
        expected = exact[support] * len(outs)
        keep = expected >= 5  # pool rare cells
        obs = torch.cat([counts[support][keep], counts[support][~keep].sum()[None]])
        exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
        if exp[-1] == 0:
            obs, exp = obs[:-1], exp[:-1]
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        df = len(exp) - 1
        assert chi2 < _critical_chi2(df), f"token {position + 1}: chi2={chi2:.1f} over {df} df"


@pytest.mark.parametrize("spec", ["top8", "2.2.2+ctx"])
def test_seeded_sampling_is_identical_with_and_without_the_tree(loaded, spec_bench_rows, spec):
    from tr_serve import LLM

    prompts = [[{"role": "user", "content": r["turns"][0]}] for r in spec_bench_rows[:40:10]]
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, top_k=40, seed=1234)
    plain = LLM(tree="none", loaded=loaded, max_num_seqs=4).generate(prompts, params)
    tree = LLM(tree=spec, loaded=loaded, max_num_seqs=4)
    tree.generate(prompts, params)  # warm the matrix so the walk accepts drafts
    again = tree.generate(prompts, params)
    for a, b in zip(plain, again):
        assert a.token_ids == b.token_ids
    assert max(o.stats.mat for o in again) > 1.0
