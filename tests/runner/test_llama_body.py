"""The runner's Llama body is bit-identical to transformers' forward: ragged prefill of two rows,
then a tree verify per row; other architectures and training mode keep transformers' forward."""

from __future__ import annotations

import torch

from tr_serve.runner import llama_body
from tr_serve.kernels.cpu_kernels import KernelPlan, fuse_siblings, kernel_calls, kernel_linears, pack
from tr_serve.runner.model_runner import ModelRunner, build_step_mask


def _run(model, plan, disable: bool, monkeypatch):
    if disable:
        monkeypatch.setattr("tr_serve.runner.model_runner.body_for", lambda model: None)
    else:
        monkeypatch.setattr("tr_serve.runner.model_runner.body_for", llama_body.body_for)
    runner = ModelRunner(model, 3, 48, kernel_plan=plan)
    rows = torch.tensor([2, 0])
    last, every = runner.prefill(rows, [[5, 17, 99, 3, 250, 8, 41], [7, 7, 300]], logit_positions=[list(range(7)), [0, 1, 2]])
    tokens = torch.tensor([[7, 9, 11, 13], [21, 22, 23, 24]])
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]])
    trees = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                          [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]], dtype=torch.bool)
    verified = runner.verify(rows, tokens, depths, trees)
    one = runner.verify(torch.tensor([0]), tokens[1:, :1], depths[1:, :1], trees[1:, :1, :1])
    return [last, *every, verified, one]


def test_body_matches_transformers_bit_for_bit(tokenizer, monkeypatch):
    from tests.tiny_model import tiny_loaded

    model = tiny_loaded(tokenizer, seed=6, init_range=0.1).model
    assert llama_body.body_for(model) is not None
    for plan in (None, KernelPlan((64,), ("onednn",))):
        if plan is not None:
            kernel_linears(model)
            fuse_siblings(model)
            pack(kernel_calls(model))
        want = _run(model, plan, True, monkeypatch)
        got = _run(model, plan, False, monkeypatch)
        assert len(got) == len(want) == 5
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_body_only_for_plain_llama_in_eval(tokenizer):
    from tests.tiny_model import tiny_loaded

    model = tiny_loaded(tokenizer).model
    assert llama_body.body_for(model) is not None
    model.train()
    assert llama_body.body_for(model) is None  # training mode: transformers' forward
    model.eval()
    model.config._attn_implementation = "eager"
    assert llama_body.body_for(model) is None  # eager attention: transformers' forward
    model.config._attn_implementation = "sdpa"
    assert llama_body.body_for(model) is not None
    assert llama_body.body_for(torch.nn.Linear(2, 2)) is None


def test_packed_verify_matches_the_padded_forward_on_real_positions(tokenizer, monkeypatch):
    """Rows of different real lengths: the body runs the linears over the real tokens only; their
    logits equal transformers' padded forward bit for bit, and only theirs come back (packed)."""
    from tests.tiny_model import tiny_loaded

    model = tiny_loaded(tokenizer, seed=6, init_range=0.1).model
    tokens = torch.tensor([[7, 9, 11, 13], [21, 22, -1, -1]])
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 1, 1]])
    trees = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                          [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]]], dtype=torch.bool)
    lengths = torch.tensor([4, 2])
    out = {}
    for disable in (True, False):
        body = (lambda model: None) if disable else llama_body.body_for
        monkeypatch.setattr("tr_serve.runner.model_runner.body_for", body)
        runner = ModelRunner(model, 3, 48)
        rows = torch.tensor([2, 0])
        runner.prefill(rows, [[5, 17, 99, 3, 250, 8, 41], [7, 7, 300]])
        out[disable] = runner.verify(rows, tokens, depths, trees, lengths)
    padded, packed = out[True], out[False]
    assert packed.shape == (6, model.config.vocab_size)  # the real nodes only, in row order
    assert torch.equal(packed, padded)


def _three_rows(model, body, lengths):
    """Prefill rows 0, 2, 3 (two runs of consecutive cache rows), verify a tree per row with
    ``lengths`` real nodes, keep some, verify one token per row."""
    rows = torch.tensor([0, 2, 3])
    prompts = [[5, 17, 99, 3, 250, 8, 41, 9, 12, 30], [7, 7, 300], [1, 2, 3, 4, 5]]
    tokens = torch.tensor([[7, 9, 11], [21, 22, 23], [4, 5, 6]])
    depths = torch.tensor([[0, 1, 1], [0, 1, 2], [0, 1, 1]])
    trees = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]], [[1, 0, 0], [1, 1, 0], [1, 1, 1]],
                          [[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tr_serve.runner.model_runner.body_for", body)
        runner = ModelRunner(model, 4, 48)
        last, _ = runner.prefill(rows, prompts)
        verified = runner.verify(rows, tokens, depths, trees, lengths)
        runs = runner.cache.step_runs
        runner.compact(rows, [torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0, 1])])
        again = runner.verify(rows, tokens[:, :1], depths[:, :1], trees[:, :1, :1])
    return (last, verified, again), runs


def test_runs_of_consecutive_rows_match_the_gathered_forward(tokenizer):
    """Ascending rows with a gap attend per run of consecutive cache rows, over views of the
    buffers: their logits agree with transformers' forward over the gathered rows to float
    rounding and in every argmax, whether every row is at the step's width or rows have their
    own widths (exact per row: test_segments_attend_each_row_as_it_would_alone). Not bit for
    bit: the attention kernel reduces a run's shorter key span in other blocks, and on some CPUs
    (CI's) that rounds differently in the last bit."""
    from tests.tiny_model import tiny_loaded

    model = tiny_loaded(tokenizer, seed=7, init_range=0.1).model
    for lengths in (None, torch.tensor([3, 3, 2])):  # every row at the step's width; rows of their own
        want, _ = _three_rows(model, lambda model: None, lengths)
        got, runs = _three_rows(model, llama_body.body_for, lengths)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=0, atol=1e-5)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
        if lengths is None:
            assert runs == [(0, 1, 0, 1), (1, 3, 2, 4)]
    assert got[1].shape == (8, model.config.vocab_size)  # packed: 3 + 3 + 2 real nodes


def test_segments_attend_each_row_as_it_would_alone():
    """Segment attention (rows of one width over views of consecutive cache rows) gives each row
    exactly what attention over that row alone, at its own width, gives."""
    from tr_serve.runner.kv_cache import SlotKVCache

    torch.manual_seed(0)
    heads, kv_heads, d = 4, 2, 8
    cache = SlotKVCache(1, 5, 32, kv_heads, d, torch.float32, "cpu")
    cache.k_all.normal_()
    cache.v_all.normal_()
    for row, n in enumerate([9, 4, 6, 11, 3]):
        cache.set_length(row, n)
    rows, widths = torch.tensor([0, 1, 3, 4]), [2, 2, 3, 1]
    starts = cache.begin_step(rows, 3)
    segments = cache.plan_segments(widths)
    assert [(s.first_row, s.end_row, s.width) for s in segments] == [(0, 2, 2), (3, 4, 3), (4, 5, 1)]
    local = torch.ones(3, 3, dtype=torch.bool).tril()[None]
    mask = build_step_mask(starts, local, cache.step_kv_len, torch.float32)
    t = sum(widths)
    q, k, v = torch.randn(1, heads, t, d), torch.randn(1, kv_heads, t, d), torch.randn(1, kv_heads, t, d)
    cache.layers[0].write_packed(k[0].transpose(0, 1), v[0].transpose(0, 1))
    out = llama_body._attend_segments(cache.layers[0], segments, q, mask, 0.3)  # [1, t, heads * d]
    p = 0
    for i, (row, w) in enumerate(zip(rows.tolist(), widths)):
        start = int(starts[i])
        assert torch.equal(cache.k_all[0, row, :, start : start + w], k[0, :, p : p + w])  # written at its slots
        keys, values = cache.k_all[0, row : row + 1, :, : cache.step_kv_len], cache.v_all[0, row : row + 1, :, : cache.step_kv_len]
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, p : p + w], keys, values, attn_mask=mask[i : i + 1, :, :w], scale=0.3, enable_gqa=True)
        assert torch.equal(out[0, p : p + w], alone[0].transpose(0, 1).reshape(w, -1))
        p += w


def test_rows_out_of_order_attend_over_a_gathered_copy():
    from tr_serve.runner.kv_cache import SlotKVCache

    cache = SlotKVCache(1, 4, 16, 1, 2, torch.float32, "cpu")
    cache.begin_step(torch.tensor([2, 0]), 1)
    assert cache.step_runs is None
    cache.begin_step(torch.tensor([0, 1, 3]), 2)
    assert cache.step_runs == [(0, 2, 0, 2), (2, 3, 3, 4)]


def test_seeding_logits_are_the_lm_heads_in_bfloat16_where_native(tokenizer, monkeypatch):
    """Prompt seeding's logits only feed drafts: an fp32 CPU model computes them with a bfloat16
    copy of its LM head where the CPU multiplies bfloat16 natively, and with its own head elsewhere."""
    from tests.tiny_model import tiny_loaded
    from tr_serve.runner import model_runner

    model = tiny_loaded(tokenizer, seed=6, init_range=0.1).model
    hidden = torch.randn(5, model.config.hidden_size)
    for native in (True, False):
        monkeypatch.setattr(model_runner, "cpu_has_bf16_dot", lambda: native)
        runner = ModelRunner(model, 1, 16)
        got = runner.draft_logits(hidden)
        exact = runner.logits(hidden)
        if native:
            want = torch.nn.functional.linear(hidden.bfloat16(), model.lm_head.weight.bfloat16())
            assert got.dtype == torch.bfloat16 and torch.equal(got, want)
            assert torch.allclose(got.float(), exact, atol=0.05, rtol=0.02)
        else:
            assert torch.equal(got, exact)
