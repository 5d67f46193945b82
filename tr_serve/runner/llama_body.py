"""The decoder body of a transformers Llama model, called layer by layer without the framework
around it: the same modules and the same tensor operations in the same order, so the hidden
states are bit-identical to ``model.model(...)`` (with torch's attention; the runner's native
tree attention, :mod:`tr_serve.kernels.tree_attention`, sums in another order).

Why: on CPU a one-token forward of a small model spends a good part of its time outside the
kernels. transformers' per-layer wrappers (gradient-checkpointing layer calls, keyword-argument
plumbing, deprecation and output-capture decorators, the attention-interface lookup, the mask
preparation) cost about 2 ms of a 40 ms SmolLM2-135M forward on one thread (measured: 40.1 -> 38.0
ms for 1 token, 61.8 -> 59.7 ms for 16), at every forward, whatever the token count.

Only plain Llama models take this path (:func:`body_for`), on CPU, and on any other device with the
runner's step attention (:mod:`tr_serve.runner.step_attention`); any other architecture, attention
implementation or a model in training mode runs transformers' own forward. Where the
native kernels take the whole step (tree attention, every linear on the panel GEMM), the layers'
loop itself runs in C (:mod:`tr_serve.kernels.layer_driver`), with the same results.
"""

from __future__ import annotations

import sys
import weakref
from typing import Callable

import torch
import torch.nn.functional as F

from tr_serve.model_shape import attention_shape
from tr_serve.kernels import cpu_kernels, layer_driver, layer_ops, tree_attention
from tr_serve.runner.step_attention import StepAttention

_ATTENTION = ("sdpa", "tr_serve_sdpa")  # the implementations whose arithmetic the body reproduces
_TRANSFORMERS_FORWARD = "_tr_transformers_forward"  # set on a model by use_transformers_forward


def body_for(model: torch.nn.Module) -> Callable | None:
    """``body(input_ids, position_ids, mask, cache) -> packed hidden states`` for ``model`` (a
    ``LlamaForCausalLM``), or None when its forward must go through transformers."""
    cached = model.__dict__.get("_tr_llama_body")
    if cached is not None and cached[0] == _signature(model):
        return cached[1]
    body = _build(model)
    model.__dict__["_tr_llama_body"] = (_signature(model), body)
    return body


def use_transformers_forward(model: torch.nn.Module, on: bool = True) -> None:
    """Make the runner call transformers' own forward for ``model`` on any device, as it does on
    GPUs: ``scripts/gpu_check.py --device cpu`` checks the GPU path (its cache keyword, mask and
    attention) on a CPU this way."""
    model.__dict__[_TRANSFORMERS_FORWARD] = on


def _signature(model) -> tuple:
    weight = next(model.parameters(), None)
    device = weight.device.type if weight is not None else None
    return (model.training, device, getattr(getattr(model, "config", None), "_attn_implementation", None),
            bool(model.__dict__.get(_TRANSFORMERS_FORWARD)))


def _build(model) -> Callable | None:
    if type(model).__name__ != "LlamaForCausalLM" or model.training or _signature(model)[3]:
        return None  # marked to run transformers' own forward (use_transformers_forward)
    inner = getattr(model, "model", None)
    config = model.config
    if inner is None or getattr(config, "_attn_implementation", None) not in _ATTENTION:
        return None
    if getattr(config, "pretraining_tp", 1) != 1:
        return None
    layers = list(inner.layers[: config.num_hidden_layers])
    if not layers or any(type(layer).__name__ != "LlamaDecoderLayer" for layer in layers):
        return None
    rotary = getattr(sys.modules.get(type(model).__module__), "apply_rotary_pos_emb", None)
    if rotary is None:
        return None
    drivers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per KV cache: (panels, the C loop's model)

    def body(input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None, cache,
             real: torch.Tensor | None = None, widths: list[int] | None = None,
             queries: tree_attention.StepQueries | None = None, native: bool = False,
             step: StepAttention | None = None) -> torch.Tensor:
        """real: indices of the real tokens in the flattened [b * s] batch (None: all); widths:
        real tokens per row, the first of each row (None: s each). The linear layers run over the
        real tokens only (rows packed). On the slot cache with ascending rows, attention runs per
        segment of consecutive cache rows of one width (:meth:`SlotKVCache.plan_segments`), so no
        row pays for another row's width, or, given ``queries``, through the native tree attention
        in one call per layer (then ``mask`` is not needed); otherwise over the padded [b, heads,
        s, d] layout. ``native``: on the packed layout, the layers' norms, rotary embedding, cache
        writes and gated activation run through :mod:`tr_serve.kernels.layer_ops` (the caller
        checks :func:`supports_layer_ops`). Given ``step`` (then ``mask`` is None), every layer writes
        the packed tokens' keys and values into the cache, in any order of rows, and attends
        through it. Returns the real tokens' hidden states, packed in row order: [t, hidden]."""
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, position_ids)
        b, s = input_ids.shape
        segments = None
        if step is not None:
            cache.plan_packed(widths if widths is not None else [s] * b)
        elif hasattr(cache, "plan_segments"):
            segments = cache.plan_segments(widths if widths is not None else [s] * b)
        if real is not None or segments is not None or step is not None:  # pack: [1, t, ...]
            flat = (lambda y: y.reshape(b * s, -1)[real][None]) if real is not None else (lambda y: y.reshape(1, b * s, -1))
            h = flat(h)
            cos, sin = flat(cos.expand(b, s, -1)), flat(sin.expand(b, s, -1))
        t = h.shape[1]
        if native and segments is not None:
            h, cos, sin = h.contiguous(), cos.contiguous(), sin.contiguous()
            driver = c_loop(cpu_kernels.active_plan(), cache, t) if queries is not None else None
            if driver is not None:
                rows, slots = cache.packed_targets()
                return layer_driver.run(driver, h, cos, sin, rows, slots, queries)
            return _native_layers(layers, inner.norm, h, cos, sin, cache, segments, mask, queries)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (h.shape[0], t, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = rotary(q, k, cos, sin)
            if step is not None:
                slot = cache.layers[i]
                slot.write_packed(k[0].transpose(0, 1), v[0].transpose(0, 1))
                o = step.attend_packed(q[0].transpose(0, 1), slot.keys, slot.values, attn.scaling).reshape(1, t, -1)
            elif segments is not None and queries is not None:
                slot = cache.layers[i]
                slot.write_packed(k[0].transpose(0, 1), v[0].transpose(0, 1))
                o = tree_attention.attend(q[0].transpose(0, 1), slot.keys, slot.values, queries, attn.scaling)[None]
            elif segments is not None:
                cache.layers[i].write_packed(k[0].transpose(0, 1), v[0].transpose(0, 1))
                o = _attend_segments(cache.layers[i], segments, q, mask, attn.scaling)
            else:
                if real is not None:
                    q, k, v = (_unpack(y, real, b, s) for y in (q, k, v))
                k, v = cache.layers[i].update(k, v, i)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                                   enable_gqa=q.shape[1] != k.shape[1])
                o = o.transpose(1, 2).reshape(b, s, -1)
                if real is not None:
                    o = o.reshape(b * s, -1)[real][None]
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return inner.norm(h).reshape(-1, h.shape[-1])  # packed, row order

    def c_loop(plan, cache, tokens: int) -> layer_driver.DriverModel | None:
        """The C loop for a step of ``tokens`` packed tokens on ``cache`` under ``plan``, given the
        tree attention's queries and the native layer ops; None where the Python loop runs it."""
        return _driver(drivers, layers, inner.norm, cache) if layer_driver.applies(plan, tokens) else None

    # the runner asks first (an attribute of the function: the body stays a plain callable)
    body.c_loop_takes = lambda plan, cache, tokens: c_loop(plan, cache, tokens) is not None  # type: ignore[attr-defined]
    return body


def _driver(drivers: weakref.WeakKeyDictionary, layers, final_norm, cache) -> layer_driver.DriverModel | None:
    """The C loop's view of the model for ``cache`` (:func:`layer_driver.prepare`, None where it
    declines), decided again when the first layer's fused panels are not the ones it was decided on
    (the kernel plan packed the weights again)."""
    group = getattr(layers[0].self_attn.q_proj, "group", None)
    panels = group.panels if group is not None else None
    seen = drivers.get(cache)
    if seen is None or seen[0] is not panels:
        seen = drivers[cache] = (panels, layer_driver.prepare(layers, final_norm, cache))
    return seen[1]


def _native_layers(layers, final_norm, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, segments,
                   mask: torch.Tensor | None, queries: tree_attention.StepQueries | None) -> torch.Tensor:
    """The layers over the packed tokens h [1, t, hidden] with :mod:`tr_serve.kernels.layer_ops`:
    the same modules' weights and matrix products, three native calls for the rest of a layer.
    A layer's residual add is done by the next norm (``pending``)."""
    t = h.shape[1]
    rows, slots = cache.packed_targets()
    pending = None
    for i, layer in enumerate(layers):
        attn, slot = layer.self_attn, cache.layers[i]
        norm = layer.input_layernorm
        x = layer_ops.add_rms_norm(h, pending, norm.weight, norm.variance_epsilon)
        d = attn.head_dim
        q = attn.q_proj(x).view(t, -1, d)  # [t, heads, d]: views of one GEMM's output where fused
        k, v = attn.k_proj(x).view(t, -1, d), attn.v_proj(x).view(t, -1, d)
        layer_ops.rope_store(q, k, v, cos, sin, slot.keys, slot.values, rows, slots)
        if queries is not None:
            o = tree_attention.attend(q, slot.keys, slot.values, queries, attn.scaling)[None]
        else:
            # [1, heads, t, d], contiguous as torch's rotary embedding gave it (strided was slower)
            o = _attend_segments(slot, segments, q.transpose(0, 1).contiguous()[None], mask, attn.scaling)
        post = layer.post_attention_layernorm
        x = layer_ops.add_rms_norm(h, attn.o_proj(o), post.weight, post.variance_epsilon)
        mlp = layer.mlp
        pending = mlp.down_proj(layer_ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
    out = layer_ops.add_rms_norm(h, pending, final_norm.weight, final_norm.variance_epsilon)
    return out.reshape(-1, out.shape[-1])  # packed, row order


def supports_layer_ops(model) -> bool:
    """Whether :func:`_native_layers` computes what this model's layers do: Llama RMSNorms, SiLU
    MLPs, head and hidden sizes the kernels take, fp32."""
    config = model.config
    inner = getattr(model, "model", None)
    if inner is None or getattr(config, "hidden_act", None) != "silu" or config.hidden_size % 16:
        return False
    head_dim = attention_shape(config).head_dim
    if head_dim % 2:
        return False
    try:
        norms = [inner.norm] + [n for layer in inner.layers
                                for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    except AttributeError:
        return False
    return all(type(n).__name__ == "LlamaRMSNorm" and n.weight.dtype == torch.float32 for n in norms) and all(
        type(layer.mlp).__name__ == "LlamaMLP" for layer in inner.layers)


def _attend_segments(layer, segments, q: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Packed queries [1, heads, t, d] of the step's real tokens, whose keys and values are in the
    layer's cache slots already: attend one segment at a time at its own width over a view of its
    rows' cache. Returns [1, t, heads * d] in the packed order."""
    gqa = q.shape[1] != layer.keys.shape[1]
    outs = []
    for seg in segments:
        n, w = seg.batch_end - seg.batch_start, seg.width
        qs = q[0, :, seg.packed_start : seg.packed_end].unflatten(1, (n, w)).transpose(0, 1)  # [n, heads, w, d]
        keys, values = layer.view(seg.first_row, seg.end_row)
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask[seg.batch_start : seg.batch_end, :, :w],
                                           scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(n * w, -1))
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[None]


def _unpack(y: torch.Tensor, real: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """[1, heads, t, d] packed -> [b, heads, s, d], zeros at the padded positions."""
    heads, d = y.shape[1], y.shape[3]
    out = y.new_zeros(b * s, heads, d)
    out[real] = y[0].transpose(0, 1)
    return out.view(b, s, heads, d).transpose(1, 2)
