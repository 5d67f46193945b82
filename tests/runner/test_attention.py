"""The runner's attention: native grouped-query sdpa under the 4D mask, bit-identical to transformers'
copying ``sdpa`` path, active only inside ``runner_attention``."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from tr_serve.runner import attention


class _Module(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True
        self.eval()


def _inputs(q: int, kv: int, heads: int = 9, kv_heads: int = 3, d: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    query = torch.randn(1, heads, q, d)
    key = torch.randn(1, kv_heads, kv, d)
    value = torch.randn(1, kv_heads, kv, d)
    mask = torch.zeros(1, 1, q, kv)
    mask[..., kv - q:] = torch.triu(torch.full((q, q), torch.finfo(torch.float32).min), 1)
    return query, key, value, mask


@pytest.mark.parametrize("q", [2, 5, 16])
def test_gqa_path_is_bit_identical_to_transformers_sdpa(q):
    module = _Module(groups=3)
    query, key, value, mask = _inputs(q, kv=40 + q)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    with attention.runner_attention(torch.nn.Module()):
        got, _ = attention.gqa_sdpa_forward(module, query, key, value, mask, scaling=0.25)
    assert got.shape == want.shape == (1, q, 9, 16) and got.is_contiguous()
    assert torch.equal(got, want)


def test_outside_the_block_it_delegates(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or ("sdpa", None))
    module = _Module(groups=3)
    query, key, value, mask = _inputs(3, kv=10)
    assert attention.gqa_sdpa_forward(module, query, key, value, mask)[0] == "sdpa"
    with attention.runner_attention(torch.nn.Module()):
        assert torch.is_tensor(attention.gqa_sdpa_forward(module, query, key, value, mask)[0])
        assert attention.gqa_sdpa_forward(module, query, key, value, None)[0] == "sdpa"  # no mask: transformers'
        module.train()
        assert attention.gqa_sdpa_forward(module, query, key, value, mask)[0] == "sdpa"  # training: transformers'
    assert calls == [1, 1, 1]


def test_runner_attention_swaps_only_sdpa_and_restores(tokenizer):
    from tests.tiny_model import tiny_loaded

    model = tiny_loaded(tokenizer).model
    seen = []
    with attention.runner_attention(model):
        seen.append(model.config._attn_implementation)
        other = []
        t = threading.Thread(target=lambda: other.append(getattr(attention._state, "active", False)))
        t.start()
        t.join()
    assert seen == [attention.NAME] and other == [False]  # active on this thread only
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation = "eager"
    with attention.runner_attention(model):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "eager"


def test_generate_under_the_registered_name_matches_sdpa(tokenizer):
    """The name stays registered for masks too, so a model whose config carries it still generates."""
    from tests.tiny_model import tiny_loaded

    model = tiny_loaded(tokenizer, seed=3, init_range=0.05).model
    ids = torch.tensor([[5, 17, 99, 3, 250, 8]])
    with torch.inference_mode():
        want = model.generate(ids, do_sample=False, max_new_tokens=6)
        model.config._attn_implementation = attention.NAME
        try:
            got = model.generate(ids, do_sample=False, max_new_tokens=6)
        finally:
            model.config._attn_implementation = "sdpa"
    assert torch.equal(got, want)
