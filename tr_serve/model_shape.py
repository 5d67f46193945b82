"""The attention shape of a transformers config, read in one place.

Why: configs leave ``num_key_value_heads`` out when every head has its own keys and values, and
``head_dim`` out when it is the hidden size over the heads; the KV cache, the native layers, tensor
parallelism and the benches' FLOP count must all read those defaults the same way.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class AttentionShape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(config: Any) -> AttentionShape:
    """Query heads, key/value heads and head size of ``config``, with transformers' defaults."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionShape(heads, kv_heads, head_dim)
