"""Where generation stops: EOS, stop strings, max_tokens, full context; unit level with a toy
tokenizer, then end to end on the embedded model, where a stop point can fall inside a path that
verification accepted in one step."""

from __future__ import annotations

import pytest
import torch

from tr_serve import SamplingParams
from tr_serve.engine.detokenizer import IncrementalDetokenizer
from tr_serve.engine.prompt import encode_prompt
from tr_serve.engine.request import FinishReason, Request
from tr_serve.engine.stopping import append_token
from tr_serve.llm import LLM

EOS = 0


class ToyTokenizer:
    """Each id decodes to a fixed piece of text; id 0 is a special (EOS) token."""

    pieces = {0: "<eos>", 1: "Hello", 2: " wor", 3: "ld", 4: "!", 5: " and", 6: " more", 7: " STOP"}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == EOS))


def make_request(**params) -> Request:
    return Request("r", [1], SamplingParams(**params), IncrementalDetokenizer(ToyTokenizer()))


def feed(req: Request, tokens: list[int], context_full_at: int | None = None) -> int:
    """Append tokens until one finishes the request; returns how many were appended."""
    for i, t in enumerate(tokens):
        full = context_full_at is not None and len(req.output_ids) + 1 >= context_full_at
        if append_token(req, t, {EOS}, full):
            return i + 1
    return len(tokens)


def test_runs_on_without_a_stop_condition():
    req = make_request(max_tokens=10)
    assert feed(req, [1, 2, 3, 4]) == 4
    assert not req.finished
    assert req.text == "Hello world!"


def test_eos_stops_and_is_kept_in_ids_not_text():
    req = make_request(max_tokens=10)
    assert feed(req, [1, 2, EOS, 3, 4]) == 3
    assert req.finish_reason == FinishReason.STOP
    assert req.output_ids == [1, 2, EOS]
    assert req.text == "Hello wor"


def test_ignore_eos():
    req = make_request(max_tokens=4, ignore_eos=True)
    assert feed(req, [1, EOS, 2, 3, 4]) == 4
    assert req.finish_reason == FinishReason.LENGTH
    assert req.output_ids == [1, EOS, 2, 3]


def test_max_tokens_exact():
    req = make_request(max_tokens=3)
    assert feed(req, [1, 2, 3, 4, 5]) == 3
    assert req.finish_reason == FinishReason.LENGTH
    assert req.output_ids == [1, 2, 3]
    assert req.text == "Hello world"


def test_context_full_is_length():
    req = make_request(max_tokens=100)
    assert feed(req, [1, 2, 3, 4, 5], context_full_at=2) == 2
    assert req.finish_reason == FinishReason.LENGTH


def test_stop_string_across_tokens_is_cut():
    req = make_request(max_tokens=10, stop=["o wo"])
    assert feed(req, [1, 2, 3, 4]) == 2  # "Hello wor" completes "o wo" at the second token
    assert req.finish_reason == FinishReason.STOP
    assert req.text == "Hell"
    assert req.output_ids == [1, 2]


def test_earliest_of_several_stop_strings_wins():
    req = make_request(max_tokens=10, stop=["and more", "ld"])
    assert feed(req, [1, 2, 3, 5, 6]) == 3
    assert req.text == "Hello wor"
    req = make_request(max_tokens=10, stop=["d and", "!"])
    assert feed(req, [1, 2, 3, 5, 4]) == 4
    assert req.text == "Hello worl"


def test_stop_string_wins_over_max_tokens_on_the_same_token():
    req = make_request(max_tokens=2, stop=[" wor"])
    assert feed(req, [1, 2, 3]) == 2
    assert req.finish_reason == FinishReason.STOP
    assert req.text == "Hello"


def test_stop_string_never_emitted_while_streaming():
    req = make_request(max_tokens=10, stop=[" STOP"])
    seen = ""
    for t in [1, 2, 3, 7, 4]:
        done = append_token(req, t, {EOS})
        seen += req.take_output().new_text
        if done:
            break
    assert req.finish_reason == FinishReason.STOP
    assert seen == "Hello world"
    assert "STOP" not in seen


# ---- end to end on the embedded model -----------------------------------------------------------
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a seagull."}]
N = 48


@pytest.fixture(scope="module")
def plain_llm(loaded):
    return LLM(tree="none", loaded=loaded, max_num_seqs=1)


@pytest.fixture(scope="module")
def hot_llm(loaded):
    """A TR engine whose matrix has already seen this prompt's continuation: long accepted paths."""
    llm = LLM(tree="top8", loaded=loaded, max_num_seqs=1)
    llm.generate(PROMPT, SamplingParams(max_tokens=N))
    return llm


@pytest.fixture(scope="module")
def plain_out(plain_llm):
    out = plain_llm.generate(PROMPT, SamplingParams(max_tokens=N))[0]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == N
    return out


def dropped_in_last_step(out) -> int:
    """Tokens the last verification step accepted but the engine did not keep (the first output
    token comes from the prefill, not from a verification step)."""
    assert 1 + sum(out.stats.accepted_per_step) == len(out.token_ids)  # steps count kept tokens only
    return out.stats.dropped_at_stop


def test_stop_string_inside_an_accepted_path(loaded, plain_llm, hot_llm, plain_out):
    tok = loaded.tokenizer
    ids, text = plain_out.token_ids, plain_out.text
    assert text == tok.decode(ids, skip_special_tokens=True)
    cut_mid_path = 0
    # stop strings starting at several points in the middle of the output, some mid-token
    for frac in (0.35, 0.5, 0.65, 0.8):
        pos = int(len(text) * frac)
        stop = text[pos : pos + 5]
        pos = text.find(stop)  # its first occurrence
        assert 0 < pos and stop.strip()
        # independent expectation: plain decoding stops at the first token whose text completes it
        m = next(m for m in range(1, len(ids) + 1) if stop in tok.decode(ids[:m], skip_special_tokens=True))
        params = SamplingParams(max_tokens=N, stop=[stop])

        want = plain_llm.generate(PROMPT, params)[0]
        assert want.token_ids == ids[:m]
        assert want.text == text[:pos]
        assert want.finish_reason == FinishReason.STOP

        got = hot_llm.generate(PROMPT, params)[0]
        assert got.finish_reason == FinishReason.STOP
        assert got.text == text[:pos], f"stop {stop!r}: text not cut right before it"
        assert stop not in got.text
        assert got.token_ids == want.token_ids
        cut_mid_path += dropped_in_last_step(got) > 0
    # the hot matrix accepts several tokens per step: some stop points fall inside a path
    assert cut_mid_path >= 1


@pytest.mark.parametrize("max_tokens", [1, 6, 11, 17, 23])
def test_max_tokens_cut_exactly(hot_llm, plain_out, max_tokens):
    got = hot_llm.generate(PROMPT, SamplingParams(max_tokens=max_tokens))[0]
    assert len(got.token_ids) == max_tokens
    assert got.token_ids == plain_out.token_ids[:max_tokens]
    assert got.finish_reason == FinishReason.LENGTH


def test_max_tokens_cut_inside_accepted_path(hot_llm, plain_out):
    drops = []
    for max_tokens in (9, 10, 13, 14):
        got = hot_llm.generate(PROMPT, SamplingParams(max_tokens=max_tokens))[0]
        assert got.token_ids == plain_out.token_ids[:max_tokens]
        drops.append(dropped_in_last_step(got))
    assert max(drops) > 0, "no max_tokens cut fell inside an accepted path"


EOS_PROMPT = [{"role": "user", "content": "What is 2+2? Answer with a single number."}]


def test_eos_finishes_with_stop(loaded, plain_llm):
    ids = encode_prompt(loaded.tokenizer, EOS_PROMPT)
    ref = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)[0, len(ids):].tolist()
    assert ref[-1] in loaded.eos_token_ids and len(ref) < 32, "the prompt is expected to end early"

    tr = LLM(tree="top8", loaded=loaded, max_num_seqs=1)
    for llm in (plain_llm, tr, tr):  # TR cold, then hot
        out = llm.generate(EOS_PROMPT, SamplingParams(max_tokens=32))[0]
        assert out.finish_reason == FinishReason.STOP
        assert out.token_ids == ref  # EOS is the last id, nothing after it
        assert out.text == loaded.tokenizer.decode(ref, skip_special_tokens=True)
        assert "<|im_end|>" not in out.text

    out = tr.generate(EOS_PROMPT, SamplingParams(max_tokens=len(ref) + 5, ignore_eos=True))[0]
    assert out.finish_reason == FinishReason.LENGTH
    assert len(out.token_ids) == len(ref) + 5
    assert out.token_ids[: len(ref)] == ref
