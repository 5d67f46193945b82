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
