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

Given a :class:`~tr_serve.runner.step_attention.StepAttention` (the runner's step wherever its native
CPU tree attention does not run), the block passes no mask at all: the mask function registered
under :data:`NAME` builds none, the cache hands back its whole buffers, and every attention call is
the step's (each row over its own slots, key/value heads never copied), on any device.
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

from tr_serve.runner.step_attention import StepAttention

NAME = "tr_serve_sdpa"

_state = threading.local()


def gqa_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: query [b, heads, q, d], key/value [b, kv_heads,
    kv, d], an additive 4D mask; returns ([b, q, heads, d], None). Inside a step's block
    (:func:`runner_attention` given a step), key/value are the cache layer's whole buffers [rows,
    kv_heads, max_len, d] and the mask is None: the step attends."""
    step = getattr(_state, "step", None) if getattr(_state, "active", False) else None
    if step is not None:
        # a sliding window is not applied, as the runner's 4D mask never applied one either
        unsupported = [name for name in ("position_bias", "softcap", "s_aux") if kwargs.get(name) is not None]
        if module.training or unsupported:
            raise NotImplementedError(f"{type(module).__name__}: the runner's step attention has no "
                                      f"{unsupported or 'training mode'}")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return step.attend_padded(query, key, value, scale), None
    if (not getattr(_state, "active", False) or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.dtype == torch.bool or query.device.type != "cpu" or module.training
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def runner_mask(*args, **kwargs):
    """transformers' mask function for :data:`NAME`: none inside a step's block (the step holds
    what the mask would say), else what ``sdpa`` builds (e.g. for ``generate``)."""
    if getattr(_state, "active", False) and getattr(_state, "step", None) is not None:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, gqa_sdpa_forward)
AttentionMaskInterface.register(NAME, runner_mask)


def takes_step(model: torch.nn.Module) -> bool:
    """Whether transformers' forward of ``model`` attends through :func:`gqa_sdpa_forward` inside
    :func:`runner_attention`, so that a step can take over (models on ``sdpa``)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) in ("sdpa", NAME)


@contextlib.contextmanager
def runner_attention(model: torch.nn.Module, step: StepAttention | None = None) -> Iterator[None]:
    """Inside this block, a model that uses transformers' ``sdpa`` attends through
    :func:`gqa_sdpa_forward` on this thread, through ``step`` if given (then the model gets no
    mask). Other attention implementations are left alone."""
    config = getattr(model, "config", None)
    swap = config is not None and getattr(config, "_attn_implementation", None) == "sdpa"
    previous = getattr(_state, "active", False), getattr(_state, "step", None)
    if swap:
        config._attn_implementation = NAME
    _state.active, _state.step = True, step
    try:
        yield
    finally:
        _state.active, _state.step = previous
        if swap:
            config._attn_implementation = "sdpa"
