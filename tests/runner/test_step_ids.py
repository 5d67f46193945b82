"""The runner's engine calls return token ids computed from its logits, not the logits.

``verify_step`` / ``prefill_step`` (runner/step_io.py) equal the argmax and top-k of ``verify`` /
``prefill``'s logits, sampled rows draw what the sampler draws for their seed and positions, and
a step of 32 rows x 81 nodes at Llama-3's vocabulary returns under 2 MB."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tiny_model import small_llama
from tr_serve.runner.model_runner import ModelRunner
from tr_serve.runner.sampler import sample_rows
from tr_serve.runner.step_io import RowSampler, StepSampling
from tr_serve.tr.tree import compile_tree, load_template

K = 4
TOKENS = torch.tensor([[3, 4, 5, 6], [8, 9, 0, 0], [1, 0, 0, 0]])
DEPTHS = torch.tensor([[0, 1, 1, 2], [0, 1, 0, 0], [0, 0, 0, 0]])
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
LENGTHS = torch.tensor([4, 2, 1])
PROMPTS = [[5, 9, 11], [7, 7, 300, 2, 8], [40]]


def _runners(tree_attention: bool):
    model = small_llama()
    return (ModelRunner(model, 4, 64, tree_attention_enabled=tree_attention),
            ModelRunner(model, 4, 64, tree_attention_enabled=tree_attention))


def test_verify_step_is_the_argmax_and_top_k_of_verify():
    for tree_attention in (False, True):
        ids_runner, logits_runner = _runners(tree_attention)
        rows = torch.tensor([0, 1, 3])
        greedy = StepSampling((None,) * 3, K)
        ids_runner.prefill_step(rows, PROMPTS, greedy)
        last, _ = logits_runner.prefill(rows, PROMPTS)
        logits = logits_runner.verify(rows, TOKENS, DEPTHS, TREE, LENGTHS)  # packed [7, V]
        out = ids_runner.verify_step(rows, TOKENS, DEPTHS, TREE, LENGTHS, greedy)
        assert out.choices.dtype == torch.int32 and out.choices.tolist() == logits.argmax(-1).tolist()
        assert torch.equal(torch.sort(out.top_k.long(), dim=1).values,
                           torch.sort(torch.topk(logits, K).indices, dim=1).values)
        assert out.top_k[:, 0].tolist() == out.choices.tolist()


def test_prefill_step_is_the_reduced_prefill():
    ids_runner, logits_runner = _runners(True)
    rows = torch.tensor([0, 2])
    prompts = [[5, 9, 11, 5], [7, 7, 300]]
    seeds = [[1, 3], [0, 1, 2]]
    out = ids_runner.prefill_step(rows, prompts, StepSampling((None, None), K), seed_positions=seeds)
    last, picked = logits_runner.prefill(rows, prompts, logit_positions=seeds)
    assert out.last.choices.tolist() == last.argmax(-1).tolist()
    for got, want in zip(out.seeds, picked):
        assert torch.equal(torch.sort(got.long(), 1).values, torch.sort(torch.topk(want.float(), K).indices, 1).values)
    assert [ids_runner.length(r) for r in (0, 2)] == [4, 3]


def test_sampled_rows_draw_at_the_position_of_the_token_that_follows():
    ids_runner, logits_runner = _runners(False)
    rows = torch.tensor([0, 1, 3])
    hot = RowSampler(1.0, 0, 1.0, seed=77)
    sampling = StepSampling((hot, None, hot), K)
    ids_runner.prefill_step(rows, PROMPTS, StepSampling((None,) * 3, K))
    logits_runner.prefill(rows, PROMPTS)
    logits = logits_runner.verify(rows, TOKENS, DEPTHS, TREE, LENGTHS)
    out = ids_runner.verify_step(rows, TOKENS, DEPTHS, TREE, LENGTHS, sampling)
    # packed nodes: row 0 (prefix 3) nodes at depths 0,1,1,2; row 1 (prefix 5) 0,1; row 2 (prefix 1) 0
    node_rows = np.array([0, 0, 0, 0, 1, 1, 2])
    positions = np.array([4, 5, 5, 6, 6, 7, 2])
    picked, drawn = sample_rows(logits, node_rows, positions, sampling.rows)
    want = logits.argmax(-1)
    want[picked] = drawn
    assert out.choices.tolist() == want.tolist()


def test_a_step_of_32_rows_x_81_nodes_at_llama3s_vocabulary_returns_under_2_mb():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    runner = ModelRunner(LlamaForCausalLM(config).eval().requires_grad_(False), 32, 128)
    tree = compile_tree(load_template("2.2.2", 8)[1])
    rows = torch.arange(32)
    greedy = StepSampling((None,) * 32, 8)
    runner.prefill_step(rows, [[5 + i, 17, 99] for i in range(32)], greedy)
    out = runner.verify_step(rows, torch.randint(10, 128256, (32, 81)), tree.depths, tree.mask, None, greedy)
    assert out.choices.shape == (32 * 81,) and out.top_k.shape == (32 * 81, 8)
    assert out.nbytes == 93_312 < 2_000_000  # float32 logits: 1,329,758,208 bytes
