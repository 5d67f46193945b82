"""A Llama layer's per-token glue on CPU in three native calls: residual add + RMSNorm, rotary
embedding + KV-cache store, SiLU-gated product.

Why: between its matrix products a Llama layer runs ~45 small torch operations (RMSNorm is 7,
rotary ~14 for q and k, the two cache writes, SiLU and its product, the residual adds). On this
2-core CPU each costs microseconds of dispatch and runs on one core, and the first ones after a
GEMM meet cold caches: measured with torch's profiler in the runner (SmolLM2-135M, 30 layers, 2
threads, context 256), 5-6 ms of torch operations in a 1-token forward and 10.5 ms in a 16-token
one; in a 16-row step the two cache writes (advanced-index puts) alone took 35 us each. Here each
concern is one call per layer that walks the step's tokens row by row.

- :func:`add_rms_norm`: ``h += delta`` (the residual add, in place), then
  ``weight * (h * 1/sqrt(mean(h^2) + eps))`` as transformers' ``LlamaRMSNorm`` computes it, except
  that the sum of squares runs in this kernel's own fixed order (rounding-level differences).
- :func:`rope_store`: rotates the queries in place and writes the rotated keys and the values into
  their cache slots: ``x * cos + rotate_half(x) * sin``, bit for bit (compiled without contracting
  multiply-adds, so every product and sum rounds as in torch's separate operations).
- :func:`silu_mul`: ``silu(gate) * up`` with a vectorised ``exp`` (Cephes' polynomial, ~1 ulp from
  torch's), so rounding-level differences.

Every token's result is computed by the same code in the same order whatever else the step holds
(batch invariant), so a token verified in a tree gets exactly what a one-token step gives it. The
runner uses these where it uses the native tree attention (fp32 Llama on CPU, ``cpu_kernels:
auto``); without a compiler, on a failed self-check, or with ``TR_SERVE_LAYER_OPS=0``, the body
keeps torch's operations. The C code is ``tr_serve/kernels/csrc/layer_ops.c``, built with the other kernels
into one library (:mod:`tr_serve.kernels.native`).
"""

from __future__ import annotations

import ctypes

import torch

from tr_serve.kernels import native

def _self_check(lib: ctypes.CDLL) -> bool:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 64, generator=g)
    delta, w = torch.randn(5, 64, generator=g), torch.rand(64, generator=g) + 0.5
    want_h = h + delta
    want = w * (want_h * torch.rsqrt(want_h.pow(2).mean(-1, keepdim=True) + 1e-5))
    got = _add_rms_norm(lib, h, delta, w, 1e-5)
    if not (torch.equal(h, want_h) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)):
        return False
    x = torch.randn(3, 40, generator=g) * 6
    up = torch.randn(3, 40, generator=g)
    if not torch.allclose(_silu_mul(lib, x, up), torch.nn.functional.silu(x) * up, rtol=1e-5, atol=1e-6):
        return False
    q, k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 1, 16, generator=g), torch.randn(3, 1, 16, generator=g)
    cos, sin = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    keys, values = torch.zeros(2, 1, 8, 16), torch.zeros(2, 1, 8, 16)
    want_q, want_k = (y * cos[:, None] + _rotate_half(y) * sin[:, None] for y in (q, k))
    rows, slots = torch.tensor([1, 1, 0]), torch.tensor([3, 4, 0])
    _rope_store(lib, q, k, v, cos, sin, keys, values, rows, slots)
    return (torch.equal(q, want_q) and torch.equal(keys[rows, :, slots], want_k)
            and torch.equal(values[rows, :, slots], v))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


KERNEL = native.Kernel("layer ops", "layer_ops", "TR_SERVE_LAYER_OPS", _self_check)


def available() -> bool:
    return KERNEL.get() is not None


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride) of a [..., n] fp32 CPU tensor whose last dimension is contiguous and whose
    leading dimensions flatten to evenly spaced rows that do not overlap; at least one row of n >= 1."""
    native.check_floats("layer ops", x)
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"layer ops: an empty input {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise TypeError("layer ops take fp32 CPU tensors with a contiguous last dimension")
    n = x.numel() // x.shape[-1]
    lead = x.reshape(-1, x.shape[-1])  # a view when rows are evenly spaced
    if n > 1 and (lead.data_ptr() != x.data_ptr() or lead.stride(0) < x.shape[-1]):
        raise ValueError("rows must be evenly spaced and apart")
    return n, (lead.stride(0) if n > 1 else x.shape[-1])


def _lib() -> ctypes.CDLL:
    lib = KERNEL.get()
    if lib is None:
        raise RuntimeError("the layer ops kernel is not available on this machine")
    return lib


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (skipped when None), then the RMSNorm of every row of ``h`` [..., D]
    with ``weight`` [D]; returns a new contiguous tensor shaped like ``h``."""
    return _add_rms_norm(_lib(), h, delta, weight, eps)


def _add_rms_norm(lib, h, delta, weight, eps) -> torch.Tensor:
    t, hs = _rows(h)
    ds = 0
    if delta is not None:
        if delta.shape != h.shape:
            raise ValueError(f"delta {tuple(delta.shape)} does not match h {tuple(h.shape)}")
        ds = _rows(delta)[1]
    native.check_floats("layer ops: norm weight", weight, 1)
    if weight.shape[0] != h.shape[-1]:
        raise ValueError(f"layer ops: a norm weight of {weight.shape[0]} for a hidden size of {h.shape[-1]}")
    weight = weight.contiguous()
    out = torch.empty(h.shape, dtype=torch.float32)
    rc = lib.tr_add_rms_norm(h.data_ptr(), hs, delta.data_ptr() if delta is not None else None, ds, out.data_ptr(),
                             h.shape[-1], weight.data_ptr(), t, h.shape[-1], eps, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"layer ops: a hidden size of {h.shape[-1]} is not a multiple of 16")
    return out


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """q [t, heads, d], k and v [t, kv_heads, d] (each token's heads contiguous, tokens evenly
    spaced: views of one projection output are fine); cos/sin [t, d]. Rotates ``q`` in place and
    writes token j's rotated keys and its values at slot ``slots[j]`` of cache row ``rows[j]`` of
    ``keys``/``values`` [rows, kv_heads, max_len, d] (contiguous)."""
    _rope_store(_lib(), q, k, v, cos, sin, keys, values, rows, slots)


def _rope_store(lib, q, k, v, cos, sin, keys, values, rows, slots) -> None:
    for x in (q, k, v, cos, sin, keys, values):
        native.check_floats("layer ops: rope_store's q, k, v, cos, sin and cache", x)
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or keys.dim() != 4:
        raise ValueError("layer ops: q, k, v [tokens, heads, head size] and a cache [rows, heads, slots, head size]")
    t, heads, d = q.shape
    kv_heads = k.shape[1]
    if t < 1 or heads < 1 or kv_heads < 1 or d < 2 or d % 2:
        raise ValueError(f"layer ops: rotary embedding of q {tuple(q.shape)}, k {tuple(k.shape)}: no tokens, "
                         "no heads or an odd head size")
    if k.shape != (t, kv_heads, d) or v.shape != k.shape or keys.shape[1] != kv_heads or keys.shape[3] != d:
        raise ValueError("q, k, v and the cache do not agree on tokens, heads or head size")
    for x, n in ((q, heads), (k, kv_heads), (v, kv_heads)):
        if x.stride(2) != 1 or x.stride(1) != d or (t > 1 and x.stride(0) < n * d):
            raise ValueError("each token's heads must be contiguous, tokens apart")
    if not (keys.is_contiguous() and values.is_contiguous() and keys.shape == values.shape):
        raise ValueError("the cache buffers must be contiguous and of one shape")
    if cos.numel() != t * d or sin.numel() != t * d:
        raise ValueError(f"layer ops: cos/sin of {cos.numel()}/{sin.numel()} values for {t} tokens of {d}")
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    rows, slots = native.as_long_index(rows), native.as_long_index(slots)
    native.check_indices("layer ops: cache rows", rows, t)
    native.check_indices("layer ops: cache slots", slots, t)  # their values: checked by the kernel (code 3)
    rc = lib.tr_rope_store(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                           cos.data_ptr(), sin.data_ptr(), t, heads, kv_heads, d, keys.data_ptr(),
                           values.data_ptr(), keys.shape[2], keys.shape[0], rows.data_ptr(), slots.data_ptr(),
                           torch.get_num_threads())
    if rc == 3:
        raise IndexError(f"layer ops: a cache row or slot outside the cache's {keys.shape[0]} rows of "
                         f"{keys.shape[2]} slots (rows {rows.tolist()}, slots {slots.tolist()})")
    if rc != 0:
        raise ValueError(f"layer ops: a head size of {d} is odd")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for gate/up [..., I] (rows evenly spaced); a new contiguous tensor."""
    return _silu_mul(_lib(), gate, up)


def _silu_mul(lib, gate, up) -> torch.Tensor:
    native.check_floats("layer ops: gate", gate)
    native.check_floats("layer ops: up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    t, gs = _rows(gate)
    us = _rows(up)[1]
    out = torch.empty(gate.shape, dtype=torch.float32)
    lib.tr_silu_mul(gate.data_ptr(), gs, up.data_ptr(), us, out.data_ptr(), t, gate.shape[-1],
                    torch.get_num_threads())
    return out
