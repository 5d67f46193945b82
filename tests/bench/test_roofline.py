"""The arithmetic floor: multiply-adds counted from the config, checked against the model's own
layers, and the float32 peak loop."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tr_serve.bench import roofline
from tr_serve.bench.latency import tree_inputs
from tests.kernel_testutil import kernel_missing


def _llama(**overrides) -> LlamaForCausalLM:
    kw = dict(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 6}, {"head_dim": 12}])
def test_linear_macs_are_the_weights_of_every_linear_layer(overrides):
    model = _llama(**overrides)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert roofline.linear_macs_per_token(model.config) == weights


def test_attention_counts_the_keys_each_node_sees():
    config = _llama().config
    linear = roofline.linear_macs_per_token(config)
    lanes = 3 * 6 * 16  # layers x heads x head size
    one = roofline.forward_flops(config, 100, tree_inputs(1, 300)[2])
    assert one == 2 * (linear + lanes * 2 * 101)  # the prefix and itself
    three = roofline.forward_flops(config, 100, tree_inputs(3, 300)[2])  # a root and two children
    assert three == 2 * (3 * linear + lanes * 2 * (3 * 100 + 1 + 2 + 2))


def test_counts_only_llama_shaped_configs():
    assert roofline.counts(_llama().config)

    class NoMlp:
        num_hidden_layers, hidden_size, num_attention_heads, vocab_size = 2, 32, 4, 100

    assert not roofline.counts(NoMlp())


def test_peak_loop_measures_a_positive_rate():
    if kernel_missing(roofline.KERNEL):
        pytest.skip("no C compiler or no libgomp here")
    peak = roofline.measure_peak_gflops(threads=1, seconds=0.01, repeats=2)
    assert peak is not None and math.isfinite(peak) and peak > 0
