"""Continuous batching is lossless: a batch of mixed-length requests decodes each row exactly as
that request alone, with chunked prefill interleaved with decoding."""

from __future__ import annotations

import pytest
import torch

from tr_serve import LLM, SamplingParams
from tr_serve.engine.prompt import encode_prompt


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _first_per_category(rows, n):
    seen, out = set(), []
    for r in rows:
        if r["category"] not in seen:
            seen.add(r["category"])
            out.append(r)
    return out[:n]


def _top2_gap(model, ids: list[int]) -> float:
    with torch.inference_mode():
        top = model(torch.tensor([ids])).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize("tree", ["top8", "2.2.2+ctx", "auto"])  # one tree for all rows; a tree per row; a plan per row (packed)
def test_eight_concurrent_requests_equal_each_alone(loaded, spec_bench_rows, tree):
    prompts = [encode_prompt(loaded.tokenizer, chat(r["turns"][0])) for r in _first_per_category(spec_bench_rows, 8)]
    assert len({len(p) for p in prompts}) > 4, "mixed prompt lengths"
    params = SamplingParams(max_tokens=24)
    # small prefill chunks so long prompts are split and interleaved with decoding rows
    batched = LLM(tree=tree, loaded=loaded, max_num_seqs=8, max_num_batched_tokens=96).generate(prompts, params)
    _assert_each_equals_alone(loaded, prompts, batched, params)


def test_lean_steps_are_lossless(loaded, spec_bench_rows):
    """Steps in which the budget verifies the context branches alone (its lean steps: many rows
    on a CPU), and the matrix's confident chains of rows with no context match, decode each row
    exactly as that request alone."""
    from tr_serve.tr.drafter import CONFIDENT_STREAK, TABLE_CHAIN_MATCH

    prompts = [encode_prompt(loaded.tokenizer, chat(r["turns"][0])) for r in _first_per_category(spec_bench_rows, 8)]
    params = SamplingParams(max_tokens=32)
    llm = LLM(tree="auto", loaded=loaded, max_num_seqs=8, max_num_batched_tokens=96)
    llm.engine.matrix.streak.fill_(CONFIDENT_STREAK)  # every row confident: rows with no context match get chains
    budget = llm.engine.speculator.drafter.budget
    budget.template_use = 0.0  # as after a run of plans that bought no template node
    lean = []
    plan_branches = budget.plan_branches
    kinds = set()  # the match lengths of the lean steps' branches
    budget.plan_branches = lambda chains, matches, *rest: (kinds.update(matches),
                                                           lean.append(plan_branches(chains, matches, *rest)),
                                                           lean[-1])[-1]
    batched = llm.generate(prompts, params)
    assert len(lean) >= 5 and any(cap > 0 for plans in lean for _, cap in plans)  # lean steps drafted branches
    assert TABLE_CHAIN_MATCH in kinds  # some rows with no context match got the matrix's confident chain
    _assert_each_equals_alone(loaded, prompts, batched, params)


ALONE_TOKENS = 32  # every test here asks for at most this many
_alone: dict[tuple[int, ...], list[int]] = {}  # prompt -> its greedy continuation decoded alone


def _alone_references(loaded, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation decoded alone (plain decoding, one row), computed once per
    prompt for :data:`ALONE_TOKENS` tokens: a shorter one is its prefix (greedy output does not
    depend on how many tokens are asked for, and an EOS ends both)."""
    assert max_tokens <= ALONE_TOKENS
    missing = [p for p in prompts if tuple(p) not in _alone]
    if missing:
        llm = LLM(tree="none", loaded=loaded, max_num_seqs=1, enable_prefix_caching=False)  # each prompt whole
        for prompt in missing:
            _alone[tuple(prompt)] = llm.generate(prompt, SamplingParams(max_tokens=ALONE_TOKENS))[0].token_ids
    return [_alone[tuple(p)][:max_tokens] for p in prompts]


def _assert_each_equals_alone(loaded, prompts, batched, params) -> None:
    for prompt, out, ref in zip(prompts, batched, _alone_references(loaded, prompts, params.max_tokens)):
        if out.token_ids != ref:  # only a near-tie may flip an argmax; show it
            i = next(j for j, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)
            gap = _top2_gap(loaded.model, prompt + ref[:i])
            print(f"divergence at token {i}: top-2 logit gap {gap:.2e}")
            assert gap < 1e-3, f"batched output differs at token {i} with a top-2 gap of {gap}"


def test_chunked_prefill_matches_generate(loaded, spec_bench_rows):
    long = next(r for r in spec_bench_rows if len(r["turns"][0]) > 2000)
    ids = encode_prompt(loaded.tokenizer, chat(long["turns"][0]))
    out = LLM(tree="top4", loaded=loaded, max_num_seqs=2, max_num_batched_tokens=128).generate(ids, SamplingParams(max_tokens=16))
    ref = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)[0, len(ids):].tolist()
    assert len(ids) > 3 * 128
    assert out[0].token_ids == ref


def test_kv_memory_budget_limits_rows_and_queues_the_rest(loaded):
    from tr_serve.runner.model_runner import kv_bytes_per_row

    llm_probe = LLM(tree="none", loaded=loaded, max_num_seqs=8, max_model_len=256)
    per_row = kv_bytes_per_row(loaded.model.config, llm_probe.engine.runner.max_len, torch.float32)
    llm = LLM(tree="none", loaded=loaded, max_num_seqs=8, max_model_len=256, kv_cache_memory_gb=2.5 * per_row / 2**30)
    assert llm.engine.num_rows == 2
    outs = llm.generate([f"Say {i}" for i in range(5)], SamplingParams(max_tokens=4))
    assert all(o.finished and len(o.token_ids) >= 1 for o in outs)
