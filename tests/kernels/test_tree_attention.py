"""The native tree attention: torch's attention per query token, batch invariant, optional."""

from __future__ import annotations

import pytest
import torch

from tr_serve.kernels import native
from tr_serve.kernels import tree_attention as ta
from tr_serve.runner.model_runner import ModelRunner
from tests.kernel_testutil import needs_kernel as _needs
from tests.tiny_model import small_llama

needs_kernel = _needs(ta.KERNEL)


def _step(g: torch.Generator, heads: int, kv_heads: int, d: int, widths: list[int], rows: list[int],
          starts: list[int], max_len: int = 96):
    keys = torch.randn(6, kv_heads, max_len, d, generator=g)
    values = torch.randn(6, kv_heads, max_len, d, generator=g)
    w = max(widths)
    local = (torch.rand(len(rows), w, w, generator=g) > 0.4) & torch.ones(w, w, dtype=torch.bool).tril()
    local |= torch.eye(w, dtype=torch.bool)  # every node sees itself, and only earlier nodes (its ancestors)
    local[:, :, 0] = True  # and the root
    queries = ta.step_queries(rows, starts, widths, local)
    q = torch.randn(sum(widths), heads, d, generator=g)
    return q, keys, values, queries, local


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 8, 16), (32, 8, 128), (6, 2, 48)])
def test_matches_torch_attention_per_token(heads, kv_heads, d):
    g = torch.Generator().manual_seed(heads + d)
    # rows out of order and not consecutive, widths 1-7, prefixes across the 16-key blocks
    q, keys, values, queries, _ = _step(g, heads, kv_heads, d, [5, 1, 7, 3], [4, 0, 2, 5], [0, 33, 16, 80])
    got = ta.attend(q, keys, values, queries, d ** -0.5)
    assert got.shape == (q.shape[0], heads * d)
    torch.testing.assert_close(got, ta.reference(q, keys, values, queries, d ** -0.5), rtol=1e-5, atol=2e-6)


@needs_kernel
def test_a_tokens_result_does_not_depend_on_the_rest_of_the_step():
    g = torch.Generator().manual_seed(1)
    q, keys, values, queries, local = _step(g, 9, 3, 64, [6, 4], [1, 3], [40, 57])
    full = ta.attend(q, keys, values, queries, 0.125)
    # row 1 alone, then its token 2 alone (it sees the root and what local says)
    alone = ta.attend(q[6:], keys, values, ta.step_queries([3], [57], [4], local[1:, :4, :4]), 0.125)
    assert torch.equal(alone, full[6:])
    one = ta.step_queries([3], [57], [1], local[1:, :1, :1])
    assert torch.equal(ta.attend(q[6:7], keys, values, one, 0.125), full[6:7])


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 2, 64), (3, 3, 128), (8, 8, 16)])
def test_each_token_alone_gets_what_it_gets_in_a_pair(heads, kv_heads, d):
    """The kernel takes two tokens of a row per pass where the shape allows (the first three shapes
    here); every token, whichever pair it falls in, gets exactly what it gets when sent alone with
    the same visible slots."""
    g = torch.Generator().manual_seed(heads * d)
    q, keys, values, queries, _ = _step(g, heads, kv_heads, d, [5, 1, 6], [4, 0, 2], [40, 7, 16])
    full = ta.attend(q, keys, values, queries, d ** -0.5)
    for i in range(q.shape[0]):
        alone = ta.StepQueries(queries.rows[i : i + 1], queries.prefix[i : i + 1], queries.visible[i : i + 1])
        assert torch.equal(ta.attend(q[i : i + 1], keys, values, alone, d ** -0.5), full[i : i + 1]), i


@needs_kernel
def test_masked_slots_do_not_count():
    """A query that does not see a new slot gets the same result whatever that slot holds."""
    g = torch.Generator().manual_seed(2)
    q, keys, values, queries, local = _step(g, 9, 3, 64, [4], [0], [20])
    hidden = [m for m in range(4) if not bool(queries.visible[3, m])]
    assert hidden, "the draw must hide a slot from the last token"
    before = ta.attend(q, keys, values, queries, 0.125)[3]
    keys[0, :, 20 + hidden[0]] += 1000.0
    values[0, :, 20 + hidden[0]] -= 1000.0
    assert torch.equal(ta.attend(q, keys, values, queries, 0.125)[3], before)


def test_unavailable_without_a_compiler(monkeypatch):
    monkeypatch.delenv(native.REQUIRE_ENV, raising=False)  # (required, it raises: test_native.py)
    monkeypatch.setattr(ta.KERNEL, "tried", False)
    monkeypatch.setattr(ta.KERNEL, "lib", None)
    monkeypatch.setattr(ta.KERNEL, "why_not", "")
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert ta.load() is None and not ta.available()
    with pytest.raises(RuntimeError):
        ta.attend(torch.randn(1, 2, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
                  ta.step_queries([0], [1], [1], torch.ones(1, 1, 1, dtype=torch.bool)), 1.0)


def test_runner_falls_back_to_torch_attention_when_switched_off(monkeypatch, tokenizer):
    from tests.tiny_model import tiny_loaded

    monkeypatch.setattr(ta.KERNEL, "tried", False)
    monkeypatch.setattr(ta.KERNEL, "lib", None)
    monkeypatch.setenv("TR_SERVE_TREE_ATTENTION", "0")
    model = tiny_loaded(tokenizer).model
    assert ModelRunner(model, 1, 16).tree_attention is False


def test_shapes_it_takes():
    assert ta.supports(9, 3, 64) and ta.supports(64, 8, 128)
    assert not ta.supports(9, 3, 8)  # head size not a multiple of 16
    assert not ta.supports(9, 2, 64)  # heads not a multiple of kv heads
    assert not ta.supports(64, 2, 64)  # 32 heads per kv head


@needs_kernel
def test_runner_verify_with_native_attention_matches_torch_attention(tokenizer):
    """A ragged verify (three rows, widths 1-4, a gap in the rows) through the runner gives the
    same logits with the native kernel as with torch's attention, up to summation order."""
    model = small_llama()
    out = []
    for native_attention in (True, False):
        runner = ModelRunner(model, 4, 64, tree_attention_enabled=native_attention)
        assert runner.tree_attention is native_attention
        runner.prefill(torch.tensor([0, 1, 3]), [[5, 9, 11], [7, 7, 300, 2, 8], [40]])
        tokens = torch.tensor([[3, 4, 5, 6], [8, 9, 0, 0], [1, 0, 0, 0]])
        depths = torch.tensor([[0, 1, 1, 2], [0, 1, 0, 0], [0, 0, 0, 0]])
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        out.append(runner.verify(torch.tensor([0, 1, 3]), tokens, depths, tree, torch.tensor([4, 2, 1])))
    assert out[0].shape == (7, 512)
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_step_of_several_rows_takes_the_kernel_past_one_rows_width(tokenizer, monkeypatch):
    """One row of 20 tokens beside a row of 1: the native kernel serves the step (torch's path
    would pad both rows to 20), with the same logits as torch's attention up to summation order.
    A single row that wide keeps torch's attention, which shares each key block across queries."""
    assert ta.takes(2, 20) and ta.takes(16, ta.MAX_WIDTH_ROWS) and not ta.takes(2, ta.MAX_WIDTH_ROWS + 1)
    assert not ta.takes(1, 17) and ta.takes(1, 16)
    model = small_llama()
    calls = []
    attend = ta.attend
    monkeypatch.setattr(ta, "attend", lambda *a, **k: calls.append(a[3].visible.shape) or attend(*a, **k))
    out = []
    for native_attention in (True, False):
        runner = ModelRunner(model, 2, 64, tree_attention_enabled=native_attention)
        runner.prefill(torch.tensor([0, 1]), [[5, 9, 11], [7, 7, 300, 2, 8]])
        calls.clear()  # a prefill this short (5 tokens) takes the kernel too
        tokens = torch.zeros(2, 20, dtype=torch.long)
        tokens[0] = torch.arange(3, 23)
        tokens[1, 0] = 8
        chain = torch.ones(20, 20, dtype=torch.bool).tril()  # row 0: a chain of 19 drafts under its root
        out.append(runner.verify(torch.tensor([0, 1]), tokens, torch.arange(20)[None].expand(2, 20),
                                 chain[None].expand(2, 20, 20), torch.tensor([20, 1])))
        if native_attention:
            assert calls == [(21, 20)] * model.config.num_hidden_layers  # 20 + 1 packed queries, each layer once
    assert calls == []  # the last run, torch's attention, made no call
    assert out[0].shape == (21, 512)
    torch.testing.assert_close(out[0], out[1], rtol=1e-4, atol=1e-4)
