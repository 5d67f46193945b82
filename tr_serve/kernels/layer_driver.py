"""A verify step's decoder layers in one native call: the loop of :func:`llama_body._native_layers`
written in C, calling the same compiled kernels (panel GEMM, layer ops, tree attention) in the same
order on the same buffers, so its hidden states are bit-identical to the Python loop's.

Why: between its kernels, the Python loop spends about 10% of a one-token forward of SmolLM2-135M
(2 threads, context 256; sampled with py-spy: ~3.7 of ~37 ms) in module calls, views, argument
checks and ctypes marshalling, 16 calls per layer. Every one of them follows a GEMM that has just
streamed megabytes of weights through the caches, so the interpreter's objects are cold each time
(a 15 us kernel call measured 140-190 us right after a large memory pass). A plain C loop over
pointers has almost nothing to bring back into the cache.

It takes the steps that the native path takes with tree attention (``queries`` given), where every
linear layer of the step runs the panel GEMM (the kernel plan's choice for the step's token count),
the attention projections and the MLP's gate and up are fused siblings, no linear has a bias and all
widths are multiples of 16. Otherwise :func:`prepare` or :func:`applies` says no and the Python loop
runs. Without a compiler, on a failed self-check, or with ``TR_SERVE_LAYER_DRIVER=0``, likewise.
The C code is ``tr_serve/kernels/csrc/layer_driver.c``, linked with the kernels it calls into one library
(:mod:`tr_serve.kernels.native`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tr_serve.kernels import layer_ops, native, panel_gemm, tree_attention

def scratch_floats(t: int, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> int:
    """Floats of the scratch buffer the C loop carves up (see ``csrc/layer_driver.c``)."""
    q = heads * head_dim
    return t * (2 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * q + 3 * intermediate + hidden)


@dataclass
class DriverModel:
    """What the C loop needs of one model, built once (:func:`prepare`): its weights' addresses
    (the tensors stay referenced here, so the addresses stay valid) and its sizes."""

    tensors: list[torch.Tensor]  # the panels, norms and cache buffers behind ``pointers``
    pointers: ctypes.Array  # 8 per layer, in the order of ``csrc/layer_driver.c``
    final_norm: torch.Tensor
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    max_len: int
    eps: float
    scale: float


def _layer_tensors(layers, cache) -> list[torch.Tensor]:
    out = []
    for i, layer in enumerate(layers):
        attn, mlp, slot = layer.self_attn, layer.mlp, cache.layers[i]
        out += [attn.q_proj.group.panels, attn.o_proj.panels, mlp.gate_proj.group.panels, mlp.down_proj.panels,
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, slot.keys, slot.values]
    return out


def _fused(group, members) -> bool:
    return group is not None and group.members == tuple(members) and group.panels is not None and group.bias is None


def prepare(layers, final_norm, cache) -> DriverModel | None:
    """The model's :class:`DriverModel`, or None when the C loop does not compute what its layers
    do (other linear layouts, biases, widths, norms' epsilons, forward hooks on the linears, which
    the Python loop runs and the C loop would skip) or is not available here. Checked when first
    used for a cache (the runner's body keeps the result); hooks are registered at load time."""
    if not layers or not available():
        return None
    first = layers[0].self_attn
    d = first.head_dim  # the rest from the weights: a tensor-parallel shard holds fewer heads than its config says
    heads, kv_heads = first.q_proj.out_features // d, first.k_proj.out_features // d
    hidden, intermediate = first.o_proj.out_features, layers[0].mlp.gate_proj.out_features
    eps = layers[0].input_layernorm.variance_epsilon
    if _global_hooks() or cache.layers[0].keys.shape[1] != kv_heads:
        return None
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(m._forward_hooks or m._forward_pre_hooks for m in linears):
            return None  # e.g. tensor parallelism's all-reduce after o_proj and down_proj: Python's loop runs them
        if not (_fused(getattr(attn.q_proj, "group", None), (attn.q_proj, attn.k_proj, attn.v_proj))
                and _fused(getattr(mlp.gate_proj, "group", None), (mlp.gate_proj, mlp.up_proj))):
            return None
        if any(getattr(m, "panels", None) is None or m.bias is not None or getattr(m, "group", None) is not None
               for m in (attn.o_proj, mlp.down_proj)):
            return None
        shapes = (attn.q_proj.out_features, attn.k_proj.out_features, attn.o_proj.out_features,
                  mlp.gate_proj.out_features, attn.head_dim)
        if shapes != (heads * d, kv_heads * d, hidden, intermediate, d) or attn.scaling != first.scaling:
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.variance_epsilon != eps for n in norms):
            return None
    if final_norm.variance_epsilon != eps:
        return None
    if any(n % 16 for n in (hidden, heads * d, (heads + 2 * kv_heads) * d, 2 * intermediate)):
        return None  # the panel GEMM's outputs are written whole, rows of a multiple of 16 floats
    tensors = _layer_tensors(layers, cache)
    if any(x.dtype != torch.float32 or not x.is_contiguous() for x in tensors):
        return None
    pointers = (ctypes.c_void_p * len(tensors))(*[x.data_ptr() for x in tensors])
    return DriverModel(tensors, pointers, final_norm.weight.detach().contiguous(), hidden, heads, kv_heads, d,
                       intermediate, cache.layers[0].keys.shape[2], eps, first.scaling)


def available() -> bool:
    """Whether the C loop can run in this process: its own library and every kernel it calls
    compiled and passed their self-checks (and ``TR_SERVE_LAYER_DRIVER`` is not 0)."""
    return KERNEL.get() is not None and kernels_available()


def kernels_available() -> bool:
    """Whether every kernel the C loop calls (panel GEMM, layer ops, tree attention: linked into its
    library) passed its own self-check here and is not switched off: the loop runs only what the
    Python loop would run."""
    return all(k.get() is not None for k in (panel_gemm.KERNEL, layer_ops.KERNEL, tree_attention.KERNEL))


def _global_hooks() -> bool:
    """Whether hooks registered for every module's forward exist (torch.nn.modules.module)."""
    from torch.nn.modules import module

    return bool(getattr(module, "_global_forward_hooks", None) or getattr(module, "_global_forward_pre_hooks", None))


def applies(plan, tokens: int) -> bool:
    """Whether every linear layer of a step of ``tokens`` tokens runs the panel GEMM on exactly
    those rows under ``plan`` (no torch kernel, no padded row count)."""
    return plan is not None and plan.choice(tokens) == ("panel", tokens)


def run(model: DriverModel, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
        slots: torch.Tensor, queries: tree_attention.StepQueries) -> torch.Tensor:
    """The layers and the final norm over the packed tokens ``h`` [1, t, hidden] (updated in place,
    as the Python loop does); returns [t, hidden]."""
    lib = KERNEL.get()
    if lib is None:
        raise RuntimeError("the layer driver is not available on this machine")
    return _run(lib, model, h, cos, sin, rows, slots, queries)


def check_args(m: DriverModel, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor,
               slots: torch.Tensor, queries: tree_attention.StepQueries) -> None:
    """What the C loop assumes of a step (raises otherwise): ``h`` fp32 CPU contiguous [1, t, hidden]
    with t >= 1 (updated in place through its pointer), cos/sin of t x head size values, one int64
    cache row and slot per token within the cache, and the tree attention's queries for t tokens."""
    native.check_floats("layer driver: h", h, 3)
    native.check_floats("layer driver: cos", cos)
    native.check_floats("layer driver: sin", sin)
    if h.shape[0] != 1 or h.shape[1] < 1 or h.shape[2] != m.hidden or not h.is_contiguous():
        raise ValueError(f"layer driver: h {tuple(h.shape)} is not a contiguous [1, tokens >= 1, {m.hidden}]")
    t = h.shape[1]
    if cos.numel() != t * m.head_dim or sin.numel() != t * m.head_dim:
        raise ValueError(f"layer driver: cos/sin of {cos.numel()}/{sin.numel()} values for {t} tokens of "
                         f"{m.head_dim}")
    cache_rows = m.tensors[6].shape[0]  # the first layer's key cache [rows, kv_heads, max_len, d]
    for name, x in (("rows", rows), ("slots", slots)):
        native.check_indices(f"layer driver: cache {name}", x, t)
    native.check_bounds("layer driver: cache rows", rows, 0, cache_rows)
    native.check_bounds("layer driver: cache slots", slots, 0, m.max_len)
    tree_attention.check_queries(queries, t)
    tree_attention.check_query_bounds(queries, cache_rows, m.max_len)


def _run(lib: ctypes.CDLL, m: DriverModel, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         rows: torch.Tensor, slots: torch.Tensor, queries: tree_attention.StepQueries) -> torch.Tensor:
    rows, slots = native.as_long_index(rows), native.as_long_index(slots)
    check_args(m, h, cos, sin, rows, slots, queries)
    t = h.shape[1]
    dims = (ctypes.c_int64 * 8)(t, m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, m.max_len,
                                m.tensors[6].shape[0])
    out = torch.empty(t, m.hidden, dtype=torch.float32)
    scratch = torch.empty(scratch_floats(t, m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate),
                          dtype=torch.float32)
    cos, sin = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
    rc = lib.tr_decoder_layers(dims, m.pointers, len(m.pointers) // 8, h.data_ptr(), cos.data_ptr(),
                               sin.data_ptr(), rows.data_ptr(), slots.data_ptr(), queries.rows.data_ptr(),
                               queries.prefix.data_ptr(), queries.visible.data_ptr(), queries.visible.shape[1],
                               m.final_norm.data_ptr(), out.data_ptr(), scratch.data_ptr(), m.eps, m.scale,
                               torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"layer driver: a kernel failed (code {rc})")
    return out


def _self_check(lib: ctypes.CDLL) -> bool:
    """The C loop against the same kernels called one by one from Python, on one random layer:
    bit-identical, or the driver is not used."""
    if not kernels_available():
        return False
    g = torch.Generator().manual_seed(0)
    t, D, H, G, d, I, L = 3, 32, 4, 2, 16, 48, 24
    Q, QKV = H * d, (H + 2 * G) * d
    weights = [torch.randn(n, k, generator=g) * 0.2 for n, k in ((QKV, D), (D, Q), (2 * I, D), (D, I))]
    panels = [panel_gemm.pack(wt) for wt in weights]
    norm_in, norm_post, final = (torch.rand(D, generator=g) + 0.5 for _ in range(3))
    keys, values = torch.randn(2, G, L, d, generator=g), torch.randn(2, G, L, d, generator=g)
    h0 = torch.randn(1, t, D, generator=g)
    cos, sin = torch.rand(t, d, generator=g), torch.rand(t, d, generator=g)
    rows, slots = torch.tensor([1, 1, 1]), torch.tensor([5, 6, 7])
    local = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]], dtype=torch.bool)
    queries = tree_attention.step_queries([1], [5], [3], local)
    eps, scale = 1e-5, d ** -0.5

    # the Python loop's calls, as llama_body._native_layers makes them
    h, kc, vc = h0.clone(), keys.clone(), values.clone()
    x = layer_ops.add_rms_norm(h, None, norm_in, eps)
    qkv = panel_gemm.linear(x, panels[0], QKV)[0]
    q, k, v = qkv[:, :Q].view(t, H, d), qkv[:, Q : Q + G * d].view(t, G, d), qkv[:, Q + G * d :].view(t, G, d)
    layer_ops.rope_store(q, k, v, cos, sin, kc, vc, rows, slots)
    o = tree_attention.attend(q, kc, vc, queries, scale)[None]
    x = layer_ops.add_rms_norm(h, panel_gemm.linear(o, panels[1], D), norm_post, eps)
    gu = panel_gemm.linear(x, panels[2], 2 * I)
    pending = panel_gemm.linear(layer_ops.silu_mul(gu[..., :I], gu[..., I:]), panels[3], D)
    expected = layer_ops.add_rms_norm(h, pending, final, eps).reshape(t, D)

    h, kd, vd = h0.clone(), keys.clone(), values.clone()
    tensors = panels + [norm_in, norm_post, kd, vd]
    pointers = (ctypes.c_void_p * 8)(*[x.data_ptr() for x in tensors])
    model = DriverModel(tensors, pointers, final, D, H, G, d, I, L, eps, scale)
    got = _run(lib, model, h, cos, sin, rows, slots, queries)
    return torch.equal(got, expected) and torch.equal(kd, kc) and torch.equal(vd, vc)


KERNEL = native.Kernel("layer driver", "layer_driver", "TR_SERVE_LAYER_DRIVER", _self_check)
