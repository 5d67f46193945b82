"""Prefix caching on the embedded model is lossless: every token identical to the same requests
with prefix caching off, greedy and seeded sampling, through both decoders, with the prefix found
in a free row (kept in place) and in a running request's row (copied); and it is scoped by tenant."""

from __future__ import annotations

import pytest

from tr_serve import LLM, SamplingParams
from tr_serve.engine.prompt import encode_prompt
from tr_serve.engine.request_context import RequestContext

SYSTEM = ("You are a meticulous assistant for a hardware store. Answer in two short sentences, name the "
          "aisle when you can, and never invent a product the store does not carry.")
QUESTIONS = ["Where do I find wood glue?", "Do you sell cordless drills?", "What paint is best for a bathroom?"]


def _messages(*turns: str) -> list[dict[str, str]]:
    out = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return out


def _conversation(llm: LLM, params: SamplingParams) -> list:
    """Two turns of one conversation, then two other conversations at once (sharing the system prompt)."""
    tok = llm.tokenizer
    first = llm.generate(_messages(QUESTIONS[0]), params)[0]
    second = llm.generate(_messages(QUESTIONS[0], first.text, "And sandpaper?"), params)[0]
    both = llm.generate([encode_prompt(tok, _messages(q)) for q in QUESTIONS[1:]], params)
    return [first, second, *both]


@pytest.mark.parametrize("decoder, tree, params", [
    ("auto", "auto", SamplingParams(max_tokens=24)),
    ("auto", "auto", SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7)),
    ("compact", "2.2.2", SamplingParams(max_tokens=16)),
])
def test_prefix_caching_changes_no_token(loaded, decoder, tree, params):
    with_cache = LLM(tree=tree, loaded=loaded, max_num_seqs=3, decoder=decoder)
    copies = []
    reuse = with_cache.engine.runner.reuse_prefix
    with_cache.engine.runner.reuse_prefix = lambda row, source, n: (copies.append((row, source, n)), reuse(row, source, n))[1]
    cached = _conversation(with_cache, params)
    plain = _conversation(LLM(tree=tree, loaded=loaded, max_num_seqs=3, decoder=decoder,
                              enable_prefix_caching=False), params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    assert all(o.stats.cached_tokens == 0 for o in plain)
    first, second, *others = cached
    assert first.stats.cached_tokens == 0
    # the first turn's row, in place: its prompt and output but the last token (never fed), in full blocks
    assert second.stats.cached_tokens == (first.stats.prompt_tokens + len(first.token_ids) - 1) // 16 * 16 > 0
    assert all(o.stats.cached_tokens >= 32 for o in others)  # the system prompt's blocks
    assert any(row == source for row, source, _ in copies) and any(row != source for row, source, _ in copies)


def test_another_tenant_finds_nothing_and_its_own_finds_its_turn(loaded):
    llm = LLM(tree="auto", loaded=loaded, max_num_seqs=2)
    engine = llm.engine
    prompt = encode_prompt(llm.tokenizer, _messages(QUESTIONS[0]))

    def run(tenant: str) -> int:
        rid = engine.add_request(prompt, SamplingParams(max_tokens=4), context=RequestContext(tenant=tenant))
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out.stats.cached_tokens
        raise AssertionError("the request did not finish")

    assert run("alice") == 0
    assert run("bob") == 0  # alice's blocks, the same prompt: not bob's
    assert run("alice") == (len(prompt) - 1) // 16 * 16


def test_a_row_written_outside_the_engine_is_not_reused(loaded):
    """The latency calibration runs its forwards on free rows (runner/calibration.py): what they
    held is then not findable, and the next request prefills its prompt whole."""
    import torch

    from tr_serve.runner.step_io import StepSampling

    llm = LLM(tree="auto", loaded=loaded, max_num_seqs=1)
    prompt = encode_prompt(llm.tokenizer, _messages(QUESTIONS[1]))
    first = llm.generate(prompt, SamplingParams(max_tokens=8))[0]
    assert llm.generate(prompt, SamplingParams(max_tokens=8))[0].stats.cached_tokens > 0
    runner = llm.engine.runner
    runner.free(0)
    runner.prefill_step(torch.tensor([0]), [list(range(10, 10 + len(prompt)))], StepSampling((None,)))
    runner.free(0)
    again = llm.generate(prompt, SamplingParams(max_tokens=8))[0]
    assert again.stats.cached_tokens == 0 and again.token_ids == first.token_ids
