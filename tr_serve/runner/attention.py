"""Attention for the runner's forwards: scaled-dot-product attention with native grouped-query
attention under the runner's 4D mask.

Why: transformers' ``sdpa`` attention, given a mask and more than one query token, copies every
key/value head ``num_attention_heads / num_key_value_heads`` times over the whole cache before
calling ``scaled_dot_product_attention`` (``repeat_kv``): for SmolLM2-135M (9 query heads on 3
key/value heads) at a 1024-token context that is ~150 MB of copies per forward, a cost that the
one-token forward does not pay and that grows with the context. ``enable_gqa=True`` maps each query
head to its key/value head inside the kernel instead: the same dot products in the same order (the
outputs are bit-identical to the copying path), without the copies.

The function is registered with transformers under :data:`NAME` and takes over only inside
:func:`runner_attention` (the runner's forwards, on CPU, with the runner's 4D mask); everywhere else,
including ``model.generate`` used as the lossless reference, it hands the call to transformers' own
``sdpa`` unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "tr_serve_sdpa"

_state = threading.local()


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: query [b, heads, q, d], key/value [b, kv_heads,
    kv, d], an additive 4D mask; returns ([b, q, heads, d], None)."""
    if (not getattr(_state, "active", False) or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.dtype == torch.bool or query.device.type != "cpu" or module.training
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)  # 2D masks (e.g. generate) are built as for sdpa


@contextlib.contextmanager
def runner_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside this block, a model that uses transformers' ``sdpa`` attends through
    :func:`gqa_sdpa_forward` on this thread. Other attention implementations are left alone."""
    config = getattr(model, "config", None)
    swap = config is not None and getattr(config, "_attn_implementation", None) == "sdpa"
    previous = getattr(_state, "active", False)
    if swap:
        config._attn_implementation = NAME
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous
        if swap:
            config._attn_implementation = "sdpa"
