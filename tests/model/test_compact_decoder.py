"""The compact decoder against transformers: every supported family's features, prefill and tree
steps through the slot mapping, the compiled step, and greedy tokens on the embedded model."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from tr_serve.model.decoder import from_hf, step_mask
from tr_serve.model.family import features_of

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "llama-tied-biases": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True, attention_bias=True,
                                                              mlp_bias=True)),
    "mistral-window": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=5)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16)),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = FAMILIES[name]()
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():  # biases and norms away from their zero/one init, so a missed one shows
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval().requires_grad_(False)


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # [n, vocab]


def _logits(dec, hidden: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(hidden, dec.head_weight).float()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_and_a_tree_step_match_transformers(name):
    model = _model(name)
    dec = from_hf(model, max_positions=128)
    k, v = dec.new_cache(slots=3 * 64)
    prompt = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    q = len(prompt)
    causal = torch.ones(q, q, dtype=torch.bool).tril()[None]
    row = 2 * 64 + torch.arange(32)[None]  # the sequence's slots: any range of the cache
    hidden = dec.step(torch.tensor([prompt]), torch.arange(q)[None], 2 * 64 + torch.arange(q)[None], row,
                      torch.tensor([0]), causal, k, v)
    ref = _reference(model, prompt)
    assert torch.allclose(_logits(dec, hidden)[0], ref, atol=1e-4, rtol=1e-4)
    # a tree under the last prompt token: root, two children, a grandchild under the first child
    tree = [prompt[-1], 7, 9, 11]
    parents = [-1, 0, 0, 1]
    depths = torch.tensor([[0, 1, 1, 2]])
    local = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    prefix = q - 1  # the root's own K/V is written again by the step
    hidden = dec.step(torch.tensor([tree]), prefix + depths, 2 * 64 + prefix + torch.arange(4)[None], row,
                      torch.tensor([prefix]), local, k, v)
    got = _logits(dec, hidden)[0]
    for node in range(4):
        path, at = [], node
        while at > 0:
            path.append(tree[at])
            at = parents[at]
        ids = prompt + path[::-1]
        assert torch.allclose(got[node], _reference(model, ids)[-1], atol=1e-4, rtol=1e-4), (name, node)


def test_rows_of_one_step_see_only_their_own_slots():
    model = _model("llama")
    dec = from_hf(model, max_positions=128)
    k, v = dec.new_cache(slots=4 * 32)
    a, b = [5, 6, 7, 8, 9], [40, 41, 42]
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    local = torch.stack([causal, causal])
    tokens = torch.tensor([a, b + [0, 0]])  # b padded to the step's width
    starts = torch.tensor([[3 * 32], [1 * 32]])  # a at slots 96.., b at 32..
    hidden = dec.step(tokens, torch.arange(5)[None].expand(2, 5), starts + torch.arange(5)[None],
                      starts + torch.arange(16)[None], torch.tensor([0, 0]), local, k, v)
    logits = _logits(dec, hidden)
    assert torch.allclose(logits[0], _reference(model, a), atol=1e-4)
    assert torch.allclose(logits[1, :3], _reference(model, b), atol=1e-4)


def test_the_step_mask_example():
    mask = step_mask(torch.tensor([[2, 3]]), torch.tensor([2]), torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool),
                     4, None, torch.float32)
    assert (mask[0, 0] == 0).tolist() == [[True, True, True, False], [True, True, True, True]]
    windowed = step_mask(torch.tensor([[2, 3]]), torch.tensor([2]), torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool),
                         4, 2, torch.float32)
    assert (windowed[0, 0] == 0).tolist() == [[False, True, True, False], [False, False, True, True]]


def test_a_family_or_feature_the_decoder_does_not_compute_is_refused():
    from transformers import GPT2Config
    with pytest.raises(ValueError, match="gpt2"):
        features_of(GPT2Config())
    with pytest.raises(ValueError, match="hidden_act"):
        features_of(LlamaConfig(**SMALL, hidden_act="gelu"))
    model = _model("llama")
    model.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(64))  # a bias no config declares
    with pytest.raises(ValueError, match="q_proj"):
        from_hf(model, max_positions=64)


def test_the_compiled_step_is_one_graph_per_bucket_and_equals_eager():
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    model = _model("qwen3")
    dec = from_hf(model, max_positions=128)
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(dec.step_ids, fullgraph=True, dynamic=False)
    local = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)[None].expand(2, 4, 4)
    for seed in range(3):  # the same bucket, other values: no recompile
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 300, (2, 4), generator=g)
        prefix = torch.randint(0, 20, (2,), generator=g)
        depths = torch.tensor([0, 1, 1, 2])[None]
        starts = torch.tensor([[0], [2 * 32]])
        args = (tokens, prefix[:, None] + depths, starts + prefix[:, None] + torch.arange(4)[None],
                starts + torch.arange(32)[None], prefix, local)
        k1, v1 = dec.new_cache(slots=3 * 32)
        k1.normal_(generator=g)
        v1.normal_(generator=g)
        k2, v2 = k1.clone(), v1.clone()
        eager = dec.step_ids(*args, k1, v1, 4)
        got = compiled(*args, k2, v2, 4)
        assert torch.equal(got[..., 0], eager[..., 0])
        assert torch.allclose(k2, k1, atol=1e-5) and torch.allclose(v2, v1, atol=1e-5)  # written in place, as eagerly
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


def test_greedy_tokens_of_the_embedded_model_equal_transformers(loaded):
    """fp32 SmolLM2-135M: a prompt's prefill, then one token a step through the slot mapping, gives
    transformers' greedy tokens."""
    from tr_serve.engine.prompt import encode_prompt

    model = loaded.model
    prompt = encode_prompt(loaded.tokenizer, [{"role": "user", "content": "Explain what a hash table is."}])
    dec = from_hf(model, max_positions=256)
    k, v = dec.new_cache(slots=256)
    row, q = torch.arange(256)[None], len(prompt)
    causal = torch.ones(q, q, dtype=torch.bool).tril()[None]
    with torch.inference_mode():
        ids = dec.step_ids(torch.tensor([prompt]), torch.arange(q)[None], torch.arange(q)[None], row,
                           torch.tensor([0]), causal, k, v, 0)
        mine = [int(ids[0, -1, 0])]
        one = torch.ones(1, 1, 1, dtype=torch.bool)
        for n in range(q, q + 23):
            at = torch.tensor([[n]])
            ids = dec.step_ids(torch.tensor([[mine[-1]]]), at, at, row, torch.tensor([n]), one, k, v, 0)
            mine.append(int(ids[0, 0, 0]))
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, q:].tolist()
    assert mine == theirs


def test_repeated_kv_heads_attend_as_grouped_query_attention():
    """The CUDA layout (each KV head repeated for its query heads) computes what enable_gqa does."""
    from tr_serve.model.decoder import kv_heads_for_sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g) for n in (4, 2, 2))  # [R, Q or KV, heads, D]
    mask = torch.where(torch.rand(2, 1, 3, 3, generator=g) > 0.3, 0.0, float("-inf"))
    mask[..., 0] = 0.0

    def attend(keys, values):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
            enable_gqa=keys.shape[2] != 4)

    repeated = kv_heads_for_sdpa(k, v, 4, masked_gqa=False)
    assert repeated[0].shape == (2, 3, 4, 8)
    assert kv_heads_for_sdpa(k, v, 4, masked_gqa=True)[0] is k
    assert torch.allclose(attend(*repeated), attend(k, v), atol=1e-6)


def test_tensor_parallel_shards_sum_to_the_whole_models_step():
    """Two ranks' shards (tp/shard.py, with output and MLP biases: rank 0 keeps the row-parallel
    ones) as compact decoders: each rank's reduce adds the other rank's partial result, computed
    beside it, so both ranks give the unsharded model's logits."""
    import copy

    from tr_serve.tp.shard import shard_model

    model = _model("llama-tied-biases")
    ranks = [shard_model(copy.deepcopy(model), r, 2, reduce=False) for r in range(2)]
    decs = [from_hf(m, max_positions=128) for m in ranks]
    assert torch.count_nonzero(decs[1].layers[0].o.bias) == 0 and torch.count_nonzero(decs[0].layers[0].o.bias) > 0
    prompt = torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    q = len(prompt)
    args = (torch.tensor([prompt]), torch.arange(q)[None], torch.arange(q)[None], torch.arange(32)[None],
            torch.tensor([0]), torch.ones(q, q, dtype=torch.bool).tril()[None])
    # run both ranks layer by layer in lockstep: each "all-reduce" waits for the other rank's part
    import threading

    barrier, parts = threading.Barrier(2), [None, None]

    def reduce_of(rank):
        def reduce(partial):
            parts[rank] = partial.clone()
            barrier.wait()
            total = parts[0] + parts[1]
            barrier.wait()
            return total
        return reduce

    out = [None, None]

    def run(rank):
        decs[rank].reduce = reduce_of(rank)
        k, v = decs[rank].new_cache(slots=32)
        out[rank] = decs[rank].step(*args, k, v)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = _reference(model, prompt)
    for rank in range(2):
        assert torch.allclose(_logits(decs[rank], out[rank])[0], ref, atol=1e-4, rtol=1e-4)


def _storage_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters of ``modules``."""
    seen = {}
    for m in modules:
        for p in m.parameters():
            s = p.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("name", ["llama-tied-biases", "qwen3"])
def test_the_decoder_holds_no_weight_twice_and_the_model_still_runs(name):
    model = _model(name)
    before = _storage_bytes(model)
    prompt = [3, 14, 15, 92, 65]
    want = _reference(model, prompt)
    dec = from_hf(model, max_positions=64)
    assert _storage_bytes(model, dec) == before  # the fused matrices replaced the model's projections
    assert torch.equal(_reference(model, prompt), want)  # its projections are views of the fused ones
    assert dec.layers[0].qkv.weight.data_ptr() == model.model.layers[0].self_attn.q_proj.weight.data_ptr()
