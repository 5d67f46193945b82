"""The runner against the installed transformers: the cache keyword read off the forward's
signature (``cache`` in >= 5.24, ``past_key_values`` before), and the slot cache implementing
the cache-layer contract as the installed version states it. ``tests/test_gpu_check.py``
runs the runner under transformers 5.17 as well."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from tiny_model import small_llama
from tr_serve.runner import hf_compat, llama_body
from tr_serve.runner.kv_cache import SlotKVCache, SlotLayer
from tr_serve.runner.model_runner import ModelRunner


class NewForward(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None, cache=None, **kwargs):
        return cache


class OldForward(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, **kwargs):
        return past_key_values


def _decorated(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # transformers' output-capturing decorators look like this
        return fn(*args, **kwargs)

    return wrapper


class DecoratedOldForward(torch.nn.Module):
    @_decorated
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return past_key_values


class NoCache(torch.nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return None


@pytest.mark.parametrize("module, keyword", [(NewForward(), "cache"), (OldForward(), "past_key_values"),
                                             (DecoratedOldForward(), "past_key_values")])
def test_the_keyword_is_the_one_the_forward_names(module, keyword):
    assert hf_compat.cache_keyword(module) == keyword
    marker = object()
    assert module(**hf_compat.cache_kwargs(module, marker)) is marker  # it reaches the named parameter


def test_a_forward_without_a_cache_parameter_is_refused():
    with pytest.raises(TypeError, match="none of"):
        hf_compat.cache_keyword(NoCache())


def test_the_installed_llama_takes_the_keyword_its_signature_names():
    model = small_llama()
    for module in (model, model.model):
        keyword = hf_compat.cache_keyword(module)
        assert keyword in inspect.signature(type(module).forward).parameters
        assert keyword in hf_compat.CACHE_KEYWORDS


def test_the_runner_forward_through_transformers_writes_the_slot_cache():
    """With transformers' own forward (the path GPUs take), the new keys land in the runner's cache:
    a second verify over the written prefix gives the same logits as one forward over it all."""
    model = small_llama()
    assert llama_body.body_for(model) is not None
    llama_body.use_transformers_forward(model)
    assert llama_body.body_for(model) is None
    calls = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(set(kwargs)), with_kwargs=True)
    runner = ModelRunner(model, 2, 64, tree_attention_enabled=False)
    prompt = [5, 9, 11, 200, 7]
    runner.prefill(torch.tensor([1]), [prompt])
    assert runner.length(1) == len(prompt)
    assert bool(runner.cache.k_all[:, 1, :, : len(prompt)].abs().sum(dim=(0, 1, 3)).gt(0).all())
    logits = runner.verify(torch.tensor([1]), torch.tensor([[42]]), torch.tensor([0]),
                           torch.ones(1, 1, dtype=torch.bool))
    with torch.inference_mode():
        expected = model(torch.tensor([prompt + [42]])).logits[0, -1]
    torch.testing.assert_close(logits[0, 0], expected.float(), rtol=1e-4, atol=1e-4)
    assert len(calls) == 3 and all(hf_compat.cache_keyword(model.model) in kw for kw in calls[:2])
    llama_body.use_transformers_forward(model, False)
    assert llama_body.body_for(model) is not None


def _placeholder_call(method) -> list[None]:
    """A dummy for each positional parameter without a default of the installed base method."""
    params = [p for p in inspect.signature(method).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return [None] * len(params)


@pytest.mark.parametrize("name", sorted(CacheLayerMixin.__abstractmethods__))
def test_slot_layer_implements_every_abstract_layer_method_with_its_arguments(name):
    assert name not in SlotLayer.__abstractmethods__
    ours = getattr(SlotLayer, name)
    assert ours is not getattr(CacheLayerMixin, name)
    inspect.signature(ours).bind(*_placeholder_call(getattr(CacheLayerMixin, name)))  # TypeError if not


def test_the_cache_answers_what_transformers_asks_of_it():
    cache = SlotKVCache(2, 3, 16, 2, 4, torch.float32, "cpu")
    assert isinstance(cache, Cache)
    cache.set_length(1, 5)
    cache.begin_step(torch.tensor([1]), 2)
    keys = torch.randn(1, 2, 2, 4)
    k, v = cache.update(keys, keys + 1, 1)  # Cache.update(key, value, layer_idx) -> the layer's
    assert k.shape == (1, 2, 7, 4) and torch.equal(k[0, :, 5:7], keys[0]) and torch.equal(v[0, :, 5:7], keys[0] + 1)
    assert cache.get_mask_sizes(2, 0) == (7, 0)
    assert cache.get_seq_length() == 5 and cache.get_max_length() == 16
