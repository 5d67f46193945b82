"""Incremental detokenization with the real tokenizer: deltas are whole characters and add up to the
full decode."""

from __future__ import annotations

from tr_serve import SamplingParams
from tr_serve.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer
from tr_serve.engine.prompt import encode_prompt
from tr_serve.llm import LLM

TEXT = "Hello 👋 world! 你好，世界 🎉🚀 naïve café — done. Ünïcödé ∑ x² ≠ 𝔘 end"


def stream(tokenizer, ids: list[int]) -> list[str]:
    d = IncrementalDetokenizer(tokenizer)
    deltas = [d.add(i) for i in ids]
    deltas.append(d.flush())
    assert d.text == "".join(deltas)
    return deltas


def test_multibyte_deltas_add_up_to_full_decode(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full == TEXT
    # the byte-level tokenizer splits some of these characters across tokens
    split = [i for i in ids if REPLACEMENT in tokenizer.decode([i])]
    assert split, "the text should contain characters split across tokens"

    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == full
    assert all(REPLACEMENT not in d for d in deltas)
    assert deltas.count("") >= len(split) // 2  # partial characters were held back, not emitted
    assert deltas[-1] == ""  # nothing incomplete left at the end


def test_every_prefix_of_a_stream_is_valid_text(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer)
    for n, i in enumerate(ids, start=1):
        d.add(i)
        assert REPLACEMENT not in d.text
        # what has been emitted is always a prefix of the final text
        assert TEXT.startswith(d.text)
        # and lags the decode of the ids so far only while a character is incomplete
        so_far = tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert so_far.startswith(d.text)
        held = so_far[len(d.text):]
        assert held == "" or held.endswith(REPLACEMENT), (n, held)


def test_special_tokens_are_skipped(tokenizer, loaded):
    eos = loaded.eos_token_ids[0]
    a = tokenizer("你好 🎉", add_special_tokens=False)["input_ids"]
    b = tokenizer(" ok", add_special_tokens=False)["input_ids"]
    ids = a + [eos] + b
    deltas = stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == "你好 🎉 ok"
    assert all(REPLACEMENT not in d for d in deltas)


def test_flush_releases_an_incomplete_character(tokenizer):
    ids = tokenizer("ab 🎉", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 3
    cut = ids[:-1]  # the emoji's last byte never arrives
    d = IncrementalDetokenizer(tokenizer)
    emitted = "".join(d.add(i) for i in cut)
    assert REPLACEMENT not in emitted
    rest = d.flush()
    assert emitted + rest == tokenizer.decode(cut, skip_special_tokens=True)
    assert rest.endswith(REPLACEMENT)


def test_engine_stream_of_chinese_output(loaded):
    """Streamed new_text deltas of a real TR run concatenate to the final text and the full decode."""
    llm = LLM(tree="top4", loaded=loaded, max_num_seqs=1)
    tok = loaded.tokenizer
    prompt = [{"role": "user", "content": "Translate 'good morning, my friend' into Chinese."}]
    engine = llm.engine
    rid = engine.add_request(encode_prompt(tok, prompt), SamplingParams(max_tokens=40))
    pieces, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            pieces.append(out.new_text)
            last = out
    assert last is not None and last.finished
    assert any(ord(ch) > 0x2E80 for ch in last.text), "expected CJK output from this prompt"
    assert "".join(pieces) == last.text == tok.decode(last.token_ids, skip_special_tokens=True)
    assert all(REPLACEMENT not in p for p in pieces)
