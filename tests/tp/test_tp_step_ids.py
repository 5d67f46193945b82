"""Under tensor parallelism the step returns token ids, not logits, and waits for the device once.

A tiny random Llama with Llama-3's vocabulary (128,256 tokens) at world size 2 (gloo): rank 0
reduces its logits to ids, so a verify step of 32 rows x 81 nodes sends back well under 2 MB
(its float32 logits would be 1.33 GB), and the workers' steps, run on the sync audit's stand-in
accelerator, each force at most one device-to-host synchronisation, greedy and sampled."""

from __future__ import annotations

import pickle

import ray
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tr_serve.engine.config import EngineConfig
from tr_serve.model_loader import LoadedModel
from tr_serve.runner.step_io import StepSampling
from tr_serve.sampling_params import SamplingParams
from tr_serve.tp.runner import TPModelRunner, tp_engine
from tr_serve.tr.tree import compile_tree, load_template

LLAMA3_VOCAB = 128256
ROWS = 32
MAX_BYTES = 2_000_000


def llama3_vocab_model(tokenizer) -> LoadedModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=LLAMA3_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, "tiny-llama3-vocab", (int(tokenizer.eos_token_id),))


def test_verify_step_of_32_rows_x_81_nodes_sends_ids_not_logits(ray_tp, tokenizer):
    loaded = llama3_vocab_model(tokenizer)
    config = EngineConfig(model="tiny", tree="2.2.2", max_num_seqs=ROWS, max_model_len=256, cpu_kernels="torch")
    runner = TPModelRunner(loaded, config, 2, measure_bytes=True)
    try:
        runner.allocate(256)
        _, paths = load_template("2.2.2", config.k)
        tree = compile_tree(paths)
        assert tree.num_nodes + 1 == 81
        rows = torch.arange(ROWS)
        greedy = StepSampling((None,) * ROWS, config.k)
        runner.prefill_step(rows, [[5 + i, 17, 99, 3] for i in range(ROWS)], greedy)
        tokens = torch.randint(10, LLAMA3_VOCAB, (ROWS, 81))
        before = runner.transfer.bytes_back
        out = runner.verify_step(rows, tokens, tree.depths, tree.mask, None, greedy)
        sent = runner.transfer.bytes_back - before
        assert out.choices.shape == (ROWS * 81,) and out.top_k.shape == (ROWS * 81, config.k)
        assert sent <= MAX_BYTES, f"{sent} bytes back for one step"
        assert out.nbytes == ROWS * 81 * (1 + config.k) * 4  # 93,312 bytes of ids
        print(f"\nbytes back per verify step, 32 rows x 81 nodes, vocab {LLAMA3_VOCAB}, tp=2: {sent:,} "
              f"(float32 logits: {ROWS * 81 * LLAMA3_VOCAB * 4:,})")
    finally:
        runner.shutdown()


def test_tp_workers_force_at_most_one_sync_per_step(ray_tp, tokenizer):
    from tiny_model import tiny_loaded

    loaded = tiny_loaded(tokenizer, seed=4)
    config = EngineConfig(model="tiny", tree="2.2.2+ctx", max_num_seqs=ROWS, max_model_len=128, cpu_kernels="torch",
                          matrix_prior=False)
    engine = tp_engine(loaded, config, 2, sync_audit=True)
    try:
        for i in range(ROWS):
            params = (SamplingParams(max_tokens=8, ignore_eos=True) if i % 2 else
                      SamplingParams(max_tokens=8, temperature=0.8, seed=i, ignore_eos=True))
            engine.add_request([5 + i, 77, 300, 12], params)
        while engine.has_unfinished():
            engine.step()
        counts = ray.get([w.call.remote(lambda w: list(w.sync_counts)) for w in engine.runner.workers])
        assert counts[0] and max(counts[0]) == 1 and min(counts[0]) == 1  # rank 0: the copy of its ids
        assert max(counts[1]) == 0  # the other ranks send nothing back
        assert len(pickle.dumps(counts)) > 0
    finally:
        engine.shutdown()
