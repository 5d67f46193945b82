"""Per-rank sharded loading (tr_serve/tp/loading.py) against full loading: a tiny random checkpoint
written as two safetensors shards; no process group (row-parallel layers built with reduce=False)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from tr_serve.tp.loading import CheckpointError, load_sharded
from tr_serve.tp.shard import ShardingError, shard_model

COMMON = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=256)


def make_model(family: str, tied: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(**COMMON, tie_word_embeddings=tied, attention_bias=True, mlp_bias=True)
    elif family == "mistral":
        config = MistralConfig(**COMMON, tie_word_embeddings=tied)
    else:
        config = Qwen2Config(**COMMON, tie_word_embeddings=tied)  # biases on q/k/v
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a misplaced slice shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_two_shards(model, folder, dtype=None):
    """config.json, two safetensors files (layers split between them) and the index."""
    model.config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
        weight_map |= {k: file for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(list(folder.glob("*.safetensors"))) == 2


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_tp1_equals_full_load_weights_and_greedy_output(family, tmp_path):
    full = make_model(family)
    write_two_shards(full, tmp_path)
    loaded = load_sharded(tmp_path, 0, 1, torch.float32)
    assert_same_state(loaded, full)
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight  # still tied
    assert torch.equal(loaded.model.rotary_emb.inv_freq, full.model.rotary_emb.inv_freq)
    prompt = torch.tensor([[3, 17, 99, 4, 56]])
    kw = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(loaded.generate(prompt, **kw), full.generate(prompt, **kw))


@pytest.mark.parametrize("family,world", [("llama", 2), ("qwen2", 2), ("mistral", 2), ("llama", 1)])
def test_each_rank_reads_exactly_its_slices(family, world, tmp_path):
    full = make_model(family, tied=False)
    write_two_shards(full, tmp_path)
    for rank in range(world):
        expected = shard_model(copy.deepcopy(full), rank, world, reduce=False)
        loaded = load_sharded(tmp_path, rank, world, torch.float32, reduce=False)
        assert_same_state(loaded, expected)
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "head_dim"):
            assert getattr(loaded.config, key) == getattr(expected.config, key)
        ids = torch.tensor([[1, 2, 3, 4]])  # partial sums, but the same partial sums
        assert torch.equal(loaded(ids).logits, expected(ids).logits)
        if family == "llama" and world > 1:  # the row-parallel bias is added once: rank 0 only
            assert (loaded.model.layers[0].mlp.down_proj.bias is not None) == (rank == 0)


def test_bfloat16_checkpoint_converted_slice_by_slice(tmp_path):
    full = make_model("qwen2")
    write_two_shards(full, tmp_path, dtype=torch.bfloat16)
    reference = shard_model(copy.deepcopy(full).to(torch.bfloat16).to(torch.float32), 1, 2, reduce=False)
    loaded = load_sharded(tmp_path, 1, 2, torch.float32, reduce=False)
    assert_same_state(loaded, reference)


def test_other_model_types_are_refused_by_name(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ShardingError, match="'gpt2'"):
        load_sharded(tmp_path, 0, 2, torch.float32)


def test_missing_tensor_is_named(tmp_path):
    full = make_model("llama", tied=False)
    write_two_shards(full, tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        load_sharded(tmp_path, 0, 2, torch.float32, reduce=False)


def test_embedded_gguf_goes_through_the_safetensors_conversion(loaded):
    """The embedded SmolLM2 (GGUF): rank 2 of 3 read from the cached conversion equals the
    full model sliced."""
    from tr_serve.tp.loading import load_sharded_model

    rank2 = load_sharded_model("smollm2-135m-instruct", 2, 3, torch.float32, reduce=False)
    expected = shard_model(copy.deepcopy(loaded.model), 2, 3, reduce=False)
    assert_same_state(rank2.model, expected)
    assert rank2.eos_token_ids == loaded.eos_token_ids
