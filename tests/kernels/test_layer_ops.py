"""The native layer ops: transformers' RMSNorm, rotary embedding and SiLU product per token
(rotary bit for bit), batch invariant, and the runner's forwards with them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from tr_serve.kernels import layer_ops as lo
from tr_serve.kernels import native
from tr_serve.runner.model_runner import ModelRunner
from tests.kernel_testutil import needs_kernel as _needs
from tests.tiny_model import prefill_and_verify, small_llama

needs_kernel = _needs(lo.KERNEL)


@needs_kernel
def test_add_rms_norm_is_the_residual_add_then_llamas_rms_norm():
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.rand(576, generator=g) + 0.5
    wide = torch.randn(40, 700, generator=g)
    h = wide[:, :576]  # rows 700 floats apart
    beside = wide[:, 576:].clone()
    delta = torch.randn(40, 576, generator=g) * 3
    want_h = h + delta
    got = lo.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon)
    assert torch.equal(h, want_h)  # added in place, exactly
    assert torch.equal(wide[:, 576:], beside)  # the columns beside the rows stay as they were
    torch.testing.assert_close(got, norm(want_h), rtol=2e-6, atol=1e-6)
    assert not torch.equal(got, h)
    again = lo.add_rms_norm(want_h.clone(), None, norm.weight, norm.variance_epsilon)  # no delta: the norm alone
    assert torch.equal(again, got)


@needs_kernel
def test_rope_store_rotates_as_transformers_bit_for_bit_and_fills_the_cache_slots():
    g = torch.Generator().manual_seed(1)
    t, heads, kv_heads, d = 5, 9, 3, 64
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)  # one fused projection's output
    q = qkv[:, : heads * d].view(t, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    cos, sin = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    want_v = v.clone()
    keys, values = torch.zeros(4, kv_heads, 20, d), torch.zeros(4, kv_heads, 20, d)
    rows, slots = torch.tensor([3, 3, 3, 0, 2]), torch.tensor([7, 8, 9, 0, 19])
    lo.rope_store(q, k, v, cos, sin, keys, values, rows, slots)
    assert torch.equal(q, want_q[0].transpose(0, 1))
    assert torch.equal(keys[rows, :, slots], want_k[0].transpose(0, 1))
    assert torch.equal(values[rows, :, slots], want_v)
    written = torch.zeros(4, 20, dtype=torch.bool)
    written[rows, slots] = True
    assert not keys.transpose(1, 2)[~written].any() and not values.transpose(1, 2)[~written].any()


@needs_kernel
def test_silu_mul_matches_torch_to_rounding_with_a_tail_and_extremes():
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(6, 100, generator=g) * 8  # 100: six blocks of 16 and a tail of 4
    gate[0, :6] = torch.tensor([-100.0, -88.5, 0.0, 88.5, 100.0, -20.0])
    up = torch.randn(6, 100, generator=g)
    got = lo.silu_mul(gate, up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=3e-6, atol=1e-30)
    assert got[0, 2] == 0 and got[0, 0] == 0  # silu(0) = 0; silu(-100) underflows


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Batch invariance: a token alone and the same token among 47 others (the threaded path)."""
    g = torch.Generator().manual_seed(3)
    h, delta, w = torch.randn(48, 64, generator=g), torch.randn(48, 64, generator=g), torch.rand(64, generator=g)
    many = lo.add_rms_norm(h.clone(), delta, w, 1e-6)
    one = lo.add_rms_norm(h[17:18].clone(), delta[17:18], w, 1e-6)
    assert torch.equal(many[17], one[0])
    gate, up = torch.randn(48, 96, generator=g), torch.randn(48, 96, generator=g)
    assert torch.equal(lo.silu_mul(gate, up)[30], lo.silu_mul(gate[30:31], up[30:31])[0])


def test_unavailable_without_a_compiler(monkeypatch):
    monkeypatch.delenv(native.REQUIRE_ENV, raising=False)  # (required, it raises: test_native.py)
    monkeypatch.setattr(lo.KERNEL, "tried", False)
    monkeypatch.setattr(lo.KERNEL, "lib", None)
    monkeypatch.setattr(lo.KERNEL, "why_not", "")
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert not lo.available()
    with pytest.raises(RuntimeError):
        lo.silu_mul(torch.randn(1, 16), torch.randn(1, 16))





@needs_kernel
def test_runner_forwards_with_layer_ops_match_torch_ops(monkeypatch):
    """Prefill (torch's attention over segments) and a ragged verify (native tree attention) give
    the logits of torch's layer operations up to rounding."""
    model = small_llama()
    runner = ModelRunner(model, 4, 96)
    assert runner.layer_ops
    calls = []
    real = lo.silu_mul
    monkeypatch.setattr(lo, "silu_mul", lambda *a: calls.append(1) or real(*a))
    native_out = prefill_and_verify(runner)
    assert len(calls) == 3 * model.config.num_hidden_layers  # prefill, verify, the one-token step
    runner = ModelRunner(model, 4, 96)
    runner.layer_ops = False
    torch_out = prefill_and_verify(runner)
    for a, b in zip(native_out, torch_out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert not torch.equal(a, b)  # (the native path did run: its sums round differently)


def test_runner_keeps_torch_ops_where_the_kernel_is_off(monkeypatch, tokenizer):
    monkeypatch.setattr(lo.KERNEL, "tried", False)
    monkeypatch.setattr(lo.KERNEL, "lib", None)
    monkeypatch.setenv("TR_SERVE_LAYER_OPS", "0")
    assert ModelRunner(small_llama(), 1, 16).layer_ops is False
    assert ModelRunner(small_llama(), 1, 16, tree_attention_enabled=False).layer_ops is False
