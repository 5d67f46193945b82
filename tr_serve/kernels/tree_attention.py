"""Attention for a verify step's few query tokens per row, on CPU, compiled on this machine.

Why: torch's CPU flash attention is built for long query blocks. For the 1-16 query tokens a row
verifies it costs far more than its arithmetic (SmolLM2-135M, 2 threads, a 300-token context:
30 us per layer for 1 token, 98 us for 8; the dot products are ~3 MFLOP), and through the
per-segment calls of a 16-row step it grows with every row. This kernel takes the step's packed
query tokens as they are (each with its cache row, its row's prefix length and which of the
step's new slots it sees: its tree ancestors and itself), so one call per layer serves every row
and width, with no 4D mask and no padding.

Per (query token, key/value head) it computes, for the heads that share that key/value head (two
tokens of a row at once where the registers hold both, each key and value read once for the pair), the
scaled dot products over the visible slots, a softmax (max subtracted, a vectorised exp of the
Cephes polynomial, ~1 ulp), and the weighted sum of values. The order of every sum is fixed by
the code, not by the number of queries or rows in the call: a token's result is bit-identical
whatever else is in the step (batch invariant; torch's flash attention is not), and close to
torch's. It runs on torch's OpenMP team (:mod:`tr_serve.kernels.native`).

Nothing here is required: without a compiler, without torch's libgomp, for head sizes that are
not a multiple of 16 or when the self-check fails, :func:`load` returns None and the runner keeps
torch's attention. ``TR_SERVE_TREE_ATTENTION=0`` turns it off. The C code is
``tr_serve/kernels/csrc/tree_attention.c``, built with the other kernels into one library
(:mod:`tr_serve.kernels.native`).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tr_serve.kernels import native


# Widest row (query tokens) a step sends here; wider steps (prefill, big trees) keep torch's flash
# attention, which shares each key block across many queries. Measured through the runner
# (SmolLM2-135M, 2 threads, contexts 256 / 1024): this kernel is faster up to 16 tokens (16: 38.3
# vs 38.5 ms and 45.4 vs 48.3 ms) and slower from 32 (65.2 vs 61.8 ms and 79.2 vs 78.2 ms).
MAX_WIDTH = 16
# A step of several rows takes the kernel up to this width: torch's path pads every row to the
# widest, so one wide row made the whole step pay. Measured through the runner (2 threads, context
# 1000): 16 rows with one row of 17 tokens 145 -> 100 ms, of 32 tokens 191 -> 124 ms; 4 rows with
# one row of 48 tokens 164 -> 128 ms; 2 rows with one of 17 tokens 76 -> 54 ms.
MAX_WIDTH_ROWS = 64
# Any step up to this width, one row or prefill included, when the decoder layers' C loop runs it
# (kernels/layer_driver.py): with the layers' Python gone, this kernel beats the Python loop with
# torch's attention on one row. Measured as one-row prefills (SmolLM2-135M, 2 threads): 24 tokens
# 87 -> 57 ms, 32: 90 -> 62, 48: 118 -> 89, 64: 138 -> 107, 96: 214 -> 171, 128: 248 -> 221, but
# 200: 372 -> 379 and 400: 732 -> 852; the C loop needs the panel GEMM, which the kernel plan
# gives up to 64 tokens here.
MAX_WIDTH_C_LOOP = 64


def takes(rows: int, width: int, verify: bool = True, c_loop: bool = False) -> bool:
    """Whether a step of ``rows`` rows, the widest ``width`` query tokens, runs here; ``c_loop``:
    the decoder layers' C loop would run the step. Without the C loop a prefill keeps the one-row
    limit: the wider rule was measured on verify steps only."""
    return (width <= MAX_WIDTH or (verify and rows > 1 and width <= MAX_WIDTH_ROWS)
            or (c_loop and width <= MAX_WIDTH_C_LOOP))


class StepQueries(NamedTuple):
    """Where each of a step's packed query tokens attends (built once per forward, used by every
    layer): its cache row, its row's prefix length, and which of the step's new slots it sees."""

    rows: torch.Tensor  # [t] int64
    prefix: torch.Tensor  # [t] int64
    visible: torch.Tensor  # [t, W] uint8: query i sees new slot m of its row


def step_queries(rows: list[int], starts: list[int], widths: list[int], local: torch.Tensor) -> StepQueries:
    """For a step whose row i (cache row ``rows[i]``, ``starts[i]`` tokens before the step) has
    ``widths[i]`` real query tokens, the first of its slots; ``local`` [b or 1, W, W] bool: node
    sees node (its ancestors and itself)."""
    b, w = len(rows), local.shape[-1]
    local = local.expand(b, w, w)
    take = torch.cat([torch.arange(i * w, i * w + n) for i, n in enumerate(widths)])
    repeat = torch.tensor(widths)
    return StepQueries(torch.tensor(rows, dtype=torch.long).repeat_interleave(repeat),
                       torch.tensor(starts, dtype=torch.long).repeat_interleave(repeat),
                       local.reshape(b * w, w)[take].to(torch.uint8).contiguous())


def load() -> ctypes.CDLL | None:
    """The compiled kernel (built once per machine into the tr_serve cache), or None when it is not
    available here. Never raises."""
    return KERNEL.load()


def available() -> bool:
    return KERNEL.get() is not None


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, queries: StepQueries,
           scale: float) -> torch.Tensor:
    """q [t, heads, d] fp32 (the step's packed query tokens); keys/values one layer's cache
    buffers [rows, kv_heads, max_len, d] (the step's entries already written). Returns [t, heads * d]."""
    lib = KERNEL.get()
    if lib is None:
        raise RuntimeError("the tree attention kernel is not available on this machine")
    return _attend(lib, q, keys, values, queries, scale)


def check_queries(queries: StepQueries, t: int) -> None:
    """``queries`` describe ``t`` query tokens: contiguous int64 rows and prefixes, contiguous uint8
    visibility [t, W >= 1]. (Whether their rows and slots lie in the cache: :func:`check_query_bounds`,
    or the kernel itself, which refuses them with code 3.)"""
    native.check_indices("tree attention: query rows", queries.rows, t)
    native.check_indices("tree attention: query prefixes", queries.prefix, t)
    vis = queries.visible
    if not isinstance(vis, torch.Tensor) or vis.dtype is not torch.uint8 or not vis.is_cpu or vis.dim() != 2 \
            or not vis.is_contiguous():
        raise TypeError("tree attention: visibility must be a contiguous 2-D uint8 CPU tensor")
    if vis.shape[0] != t or vis.shape[1] < 1:
        raise ValueError(f"tree attention: visibility {tuple(vis.shape)} for {t} query tokens")


def check_query_bounds(queries: StepQueries, cache_rows: int, max_len: int) -> None:
    """Each query token's row lies in a cache of ``cache_rows`` rows, and its prefix plus the step's W
    new slots within the row's ``max_len`` slots."""
    native.check_bounds("tree attention: query rows", queries.rows, 0, cache_rows)
    native.check_bounds("tree attention: query prefixes", queries.prefix, 0, max_len - queries.visible.shape[1] + 1)


def _attend(lib: ctypes.CDLL, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, queries: StepQueries,
            scale: float) -> torch.Tensor:
    native.check_floats("tree attention: q", q, 3)
    native.check_floats("tree attention: keys", keys, 4)
    native.check_floats("tree attention: values", values, 4)
    if not (keys.is_contiguous() and values.is_contiguous()) or keys.shape != values.shape:
        raise ValueError("the KV cache buffers must be contiguous and of one shape")
    t, heads, d = q.shape
    cache_rows, kv_heads, max_len, kd = keys.shape
    if t < 1:
        raise ValueError("tree attention: no query tokens")
    if kd != d or min(heads, d) < 1 or not supports(heads, kv_heads, d):
        raise ValueError(f"tree attention does not take {heads} heads of size {d} on {kv_heads} key/value heads "
                         f"of size {kd}")
    check_queries(queries, t)
    q = q.contiguous()
    out = torch.empty(t, heads * d, dtype=torch.float32)
    rc = lib.tr_tree_attention(q.data_ptr(), out.data_ptr(), keys.data_ptr(), values.data_ptr(),
                               kv_heads * max_len * d, max_len * d, cache_rows, max_len, queries.rows.data_ptr(),
                               queries.prefix.data_ptr(), queries.visible.data_ptr(), queries.visible.shape[1],
                               t, heads, kv_heads, d, scale, torch.get_num_threads())
    if rc == 1:
        raise MemoryError("tree attention: out of memory")
    if rc == 3:
        raise IndexError(f"tree attention: a query's row or slots outside the cache's {cache_rows} rows of {max_len} "
                         f"slots (rows {queries.rows.tolist()}, prefixes {queries.prefix.tolist()}, "
                         f"{queries.visible.shape[1]} new slots)")
    if rc != 0:
        raise ValueError(f"tree attention does not take {heads} heads on {kv_heads} key/value heads of size {d}")
    return out


def supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    return kv_heads > 0 and heads % kv_heads == 0 and head_dim % 16 == 0 and heads // kv_heads <= 16 \
        and head_dim <= 256


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, queries: StepQueries,
              scale: float) -> torch.Tensor:
    """What :func:`attend` computes, with torch's attention one query token at a time."""
    t, heads, d = q.shape
    w = queries.visible.shape[1]
    outs = []
    for i in range(t):
        row, p = int(queries.rows[i]), int(queries.prefix[i])
        k, v = keys[row : row + 1, :, : p + w], values[row : row + 1, :, : p + w]
        seen = torch.cat([torch.ones(p, dtype=torch.bool), queries.visible[i].bool()])
        mask = torch.zeros(p + w).masked_fill_(~seen, float("-inf"))[None, None, None]
        o = F.scaled_dot_product_attention(q[i][None, :, None], k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=heads != keys.shape[1])
        outs.append(o.reshape(heads * d))
    return torch.stack(outs)


def _self_check(lib: ctypes.CDLL) -> bool:
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, d, w in ((9, 3, 64, 5), (4, 4, 32, 1), (8, 2, 128, 3)):
        keys = torch.randn(3, kv_heads, 40, d, generator=g)
        values = torch.randn(3, kv_heads, 40, d, generator=g)
        local = torch.rand(2, w, w, generator=g) > 0.5
        local |= torch.eye(w, dtype=torch.bool)
        queries = step_queries([2, 0], [17, 30], [w, max(1, w - 1)], local)
        q = torch.randn(int(queries.rows.numel()), heads, d, generator=g)
        got = _attend(lib, q, keys, values, queries, d ** -0.5)
        if not torch.allclose(got, reference(q, keys, values, queries, d ** -0.5), rtol=1e-4, atol=1e-5):
            return False
    return True


KERNEL = native.Kernel("tree attention", "tree_attention", "TR_SERVE_TREE_ATTENTION", _self_check)
