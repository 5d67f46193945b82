"""Helpers of the tensor-parallel tests (a uniquely named module: other folders have their own)."""

from __future__ import annotations

import json
import socket

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tr_serve.data import SPEC_BENCH_DEV
from tr_serve.model_loader import LoadedModel
from tr_serve.sampling_params import SamplingParams

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
DEV = SPEC_BENCH_DEV  # packaged with tr_serve (tr_serve/data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dev_questions(count: int) -> list[dict]:
    assert DEV.exists(), f"missing packaged data file {DEV}"
    rows = [json.loads(line) for line in DEV.read_text().splitlines() if line.strip()]
    return rows[:count]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """top-1 minus top-2 logit of the unsharded ``model`` after ``prompt + prefix``."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_same_or_near_tie(model, prompt: list[int], got: list[int], want: list[int], what: str) -> None:
    """Tokens equal, or they part at a near-tie of the unsharded model (top-2 gap < 1e-3): summing
    the shards' partial results in another order may flip a tie, and nothing else."""
    i = first_difference(got, want)
    if i is None:
        return
    gap = top2_gap(model, prompt, want[:i])
    print(f"\n{what}: first difference at token {i} (got {got[i:i + 3]}, want {want[i:i + 3]}); "
          f"top-2 logit gap there {gap:.3e}")
    assert gap < 1e-3, f"{what}: differs at token {i} where the top-2 logit gap is {gap:.3e} (not a near-tie)"


PROMPTS = [[5, 17, 99, 200, 3], [7, 8, 9], list(range(30, 90)), [400, 401]]


def tiny(tokenizer, model_id: str) -> LoadedModel:
    """12 heads, 6 kv heads (GQA groups of 2): splits 2 and 3 ways."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=512,
                         initializer_range=0.5, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, model_id, (int(tokenizer.eos_token_id),))


def rank_lengths(runner) -> list[list[int]]:
    import ray

    return ray.get([w.lengths.remote() for w in runner.workers])


def run(engine, prompts, max_tokens: int, extra: dict[str, SamplingParams] | None = None):
    """Greedy outputs by prompt index (plus ``extra`` requests by id); checks the scheduler's
    stats and, on a tensor-parallel runner, that every rank's cache lengths equal the driver's."""
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"r{i}")
    for rid, params in (extra or {}).items():
        engine.add_request(prompts[0], params, request_id=rid)
    total = len(prompts) + len(extra or {})
    assert len(engine.scheduler.waiting) + len(engine.prefilling) + len(engine.running) == total
    done, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        steps += 1
        busy = len(engine.prefilling) + len(engine.running)
        assert engine.num_rows - len(engine.scheduler.free_rows) == busy
        runner = engine.runner
        if hasattr(runner, "workers") and not runner._pending:  # every queued call has reached the ranks
            mirror = [runner.length(r) for r in range(engine.num_rows)]
            assert rank_lengths(runner) == [mirror] * runner.world_size
    assert len(done) == total
    return [done[f"r{i}"] for i in range(len(prompts))], done, steps
