"""Sharding by heads without any process group: the checks, the per-rank shapes and config, and
the KV cache the runner builds from that config."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tr_serve.runner.model_runner import ModelRunner
from tr_serve.tp.shard import ShardingError, check_shardable, shard_model


def tiny_llama(heads: int = 12, kv_heads: int = 6, hidden: int = 48, inter: int = 96, bias: bool = False):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, attention_bias=bias,
                         mlp_bias=bias)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def test_check_shardable_names_the_problem():
    smollm2_like = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    check_shardable(smollm2_like, 3)
    check_shardable(smollm2_like, 1)
    with pytest.raises(ShardingError, match=r"num_attention_heads=9, num_key_value_heads=3.*gcd.* = 3"):
        check_shardable(smollm2_like, 2)
    with pytest.raises(ShardingError, match="must be >= 1"):
        check_shardable(smollm2_like, 0)
    other = smollm2_like.to_dict() | {"model_type": "gpt2"}
    with pytest.raises(ShardingError, match="model types"):
        check_shardable(type("C", (), other)(), 3)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_keeps_its_heads_and_config(world):
    full = tiny_llama()
    rank = world - 1
    shard = shard_model(tiny_llama(), rank, world, reduce=False)
    head_dim = 4
    h, kv, i = 12 // world, 6 // world, 96 // world
    cfg = shard.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (h, kv, head_dim, i)
    assert cfg.hidden_size == 48 and (cfg.tp_rank, cfg.tp_world_size) == (rank, world)
    a_full, a = full.model.layers[1].self_attn, shard.model.layers[1].self_attn
    q0, k0 = rank * h * head_dim, rank * kv * head_dim
    assert torch.equal(a.q_proj.weight, a_full.q_proj.weight[q0:q0 + h * head_dim])
    assert torch.equal(a.k_proj.weight, a_full.k_proj.weight[k0:k0 + kv * head_dim])
    assert torch.equal(a.v_proj.weight, a_full.v_proj.weight[k0:k0 + kv * head_dim])
    assert torch.equal(a.o_proj.weight, a_full.o_proj.weight[:, q0:q0 + h * head_dim])
    assert a.num_key_value_groups == a_full.num_key_value_groups == 2
    m_full, m = full.model.layers[0].mlp, shard.model.layers[0].mlp
    assert torch.equal(m.gate_proj.weight, m_full.gate_proj.weight[rank * i:(rank + 1) * i])
    assert torch.equal(m.down_proj.weight, m_full.down_proj.weight[:, rank * i:(rank + 1) * i])
    # replicated parts
    assert torch.equal(shard.lm_head.weight, full.lm_head.weight)
    assert torch.equal(shard.model.norm.weight, full.model.norm.weight)
    # the runner sizes the KV cache for this rank's kv heads only
    runner = ModelRunner(shard, num_rows=2, max_len=16)
    assert runner.cache.k_all.shape == (2, 2, kv, 16, head_dim)


def test_row_parallel_bias_is_added_once():
    shards = [shard_model(tiny_llama(bias=True), r, 2, reduce=False) for r in range(2)]
    assert shards[0].model.layers[0].self_attn.o_proj.bias is not None
    assert shards[1].model.layers[0].self_attn.o_proj.bias is None
    assert shards[1].model.layers[0].mlp.down_proj.bias is None
    assert shards[1].model.layers[0].self_attn.q_proj.bias.shape == (6 * 4,)


def test_partial_sums_add_up_to_the_full_layer():
    """Without the all-reduce each rank's o_proj / MLP gives a partial sum; the partial sums of all
    ranks are the unsharded layer's output."""
    full = tiny_llama()
    shards = [shard_model(tiny_llama(), r, 3, reduce=False) for r in range(3)]
    x = torch.randn(1, 5, 48)
    with torch.inference_mode():
        want = full.model.layers[0].mlp(x)
        got = sum(s.model.layers[0].mlp(x) for s in shards)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        attn_in = torch.randn(1, 5, 12 * 4)  # o_proj: heads-concatenated input, split by rank
        want = full.model.layers[0].self_attn.o_proj(attn_in)
        got = sum(s.model.layers[0].self_attn.o_proj(attn_in[..., r * 16:(r + 1) * 16]) for r, s in enumerate(shards))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
