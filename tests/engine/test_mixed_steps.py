"""Mixed steps: a long prompt arriving mid-stream is prefilled in chunks beside the running
stream's trees (a few tokens a step: ``EngineConfig.mixed_prefill_tokens``), so the stream gets
tokens at every step while the prompt prefills, at a median gap within 3x its median gap before
and after. Every token is the same as each request's alone."""

from __future__ import annotations

import statistics
import time

from tr_serve import LLM, SamplingParams
from tr_serve.engine.prompt import encode_prompt

LONG_PROMPT_TOKENS = 1800
STREAM = SamplingParams(max_tokens=600, ignore_eos=True)
LONG = SamplingParams(max_tokens=8)


def _long_prompt(tokenizer) -> list[int]:
    paragraph = ("The harbour town kept its lighthouse lit through every winter storm, and the keepers wrote "
                 "down each ship that passed, its flag, its cargo and the hour it cleared the rocks. ")
    ids = tokenizer.encode(paragraph * 60)
    assert len(ids) >= LONG_PROMPT_TOKENS
    return ids[:LONG_PROMPT_TOKENS]


def test_a_long_prompt_mid_stream_keeps_the_streams_pace(loaded):
    llm = LLM(tree="auto", loaded=loaded, max_num_seqs=2)
    engine = llm.engine
    stream_prompt = encode_prompt(llm.tokenizer, "Tell me a long story about a lighthouse keeper.")
    long_prompt = _long_prompt(llm.tokenizer)
    stream_id = engine.add_request(stream_prompt, STREAM)
    tokens: dict[str, list[int]] = {}
    long_id = None
    last, beside, alone = time.perf_counter(), [], []  # the stream's gaps beside the prompt's prefill, and not
    silent = 0  # steps beside the prompt's prefill that gave the stream nothing
    while engine.has_unfinished():
        prefilling = bool(engine.prefilling) and len(tokens.get(stream_id, [])) < STREAM.max_tokens
        outputs = engine.step()
        now = time.perf_counter()
        if prefilling and not any(o.request_id == stream_id for o in outputs):
            silent += 1
        for out in outputs:
            tokens[out.request_id] = tokens.get(out.request_id, []) + list(out.new_token_ids)
            if out.request_id == stream_id and out.new_token_ids:
                if len(tokens[stream_id]) > len(out.new_token_ids):  # not the first token
                    (beside if prefilling else alone).append(now - last)
                last = now
        if long_id is None and len(tokens.get(stream_id, [])) >= 48:  # the stream is under way
            long_id = engine.add_request(long_prompt, LONG)
    assert long_id is not None and len(tokens[stream_id]) == STREAM.max_tokens
    assert len(beside) >= 30 and len(alone) >= 10  # the prompt was chunked beside the stream
    assert silent == 0
    assert statistics.median(beside) < 3 * statistics.median(alone), (beside, alone)
    reference = LLM(tree="auto", loaded=loaded, max_num_seqs=2)
    assert reference.generate([stream_prompt], STREAM)[0].token_ids == tokens[stream_id]
    assert reference.generate([long_prompt], LONG)[0].token_ids == tokens[long_id]
