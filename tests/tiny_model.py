"""A tiny random-weight Llama that shares the embedded model's tokenizer: fast engine tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tr_serve.model_loader import LoadedModel


def tiny_loaded(tokenizer, seed: int = 0, init_range: float = 0.5, vocab_size: int = 512) -> LoadedModel:
    """Token ids stay below ``vocab_size``; the real tokenizer still decodes them (byte tokens)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=init_range, tie_word_embeddings=True)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, "tiny-random-llama", (int(tokenizer.eos_token_id),))


def small_llama() -> LlamaForCausalLM:
    """A 2-layer random Llama with grouped key/value heads of size 16: the shapes the runner's
    native kernels (tree attention, layer ops) take."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval().requires_grad_(False)


def prefill_and_verify(runner) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ragged prefill of three rows, a ragged tree step over them and a one-token step on one of
    them, through ``runner`` (a ``ModelRunner`` over :func:`small_llama`): their logits."""
    last, _ = runner.prefill(torch.tensor([0, 1, 3]), [[5, 9, 11], [7, 7, 300, 2, 8] * 8, [40]])
    tokens = torch.tensor([[3, 4, 5, 6], [8, 9, 0, 0], [1, 0, 0, 0]])
    depths = torch.tensor([[0, 1, 1, 2], [0, 1, 0, 0], [0, 0, 0, 0]])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    verified = runner.verify(torch.tensor([0, 1, 3]), tokens, depths, tree, torch.tensor([4, 2, 1]))
    alone = runner.verify(torch.tensor([1]), tokens[1:2, :1], depths[1:2, :1], tree[:1, :1])
    return last, verified, alone
