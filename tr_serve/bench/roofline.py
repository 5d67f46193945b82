"""The arithmetic floor of a verify forward: its multiply-adds, and this CPU's float32 peak.

Why: a ratio such as t(16)/t(1) can only fall to what the arithmetic of 16 tokens allows. One
token's forward is set by the weights' stream; 16 tokens' by their multiply-adds once those take
longer than the stream. ``tr-serve bench --latency`` prints both, measured on the machine at hand,
so a latency target can be checked against the floor before any kernel work: on this 2-core Zen 4
(235 GFLOPS with 2 threads), SmolLM2-135M's 16 tokens at context 256 are 4.59 GFLOP, at least
19.5 ms, while one token's weights streamed in 13.4-17 ms.

The count is the necessary arithmetic of a Llama-shaped model: every linear layer once per query
token (attention projections, gated MLP, LM head) and attention over the keys each query sees (the
prefix plus its tree ancestors and itself); norms, rotary embedding and softmax are left out (a few
FLOPs per activation, not per weight). The peak is a measured loop of independent fused
multiply-adds on the widest float vectors the CPU has, one per thread of torch's OpenMP team
(``tr_serve/kernels/csrc/fma_peak.c``, in the kernels' library: :mod:`tr_serve.kernels.native`).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch

from tr_serve.model_shape import attention_shape
from tr_serve.kernels import native

CHAINS = 12  # accumulators per thread of the peak loop: csrc/fma_peak.h's FMA_CHAINS (tests/kernels/test_csrc.py)

def _self_check(lib: ctypes.CDLL) -> bool:
    out = ctypes.c_float(0.0)
    return lib.tr_fma_peak(ctypes.c_int64(10), 1, ctypes.byref(out)) in (4, 8, 16) and out.value > 0.0


KERNEL = native.Kernel("fp32 peak loop", "fma_peak", "TR_SERVE_FMA_PEAK", _self_check)


def measure_peak_gflops(threads: int | None = None, seconds: float = 0.05, repeats: int = 5) -> float | None:
    """This CPU's float32 multiply-add peak in GFLOPS with ``threads`` threads (default: torch's),
    the best of ``repeats`` runs of about ``seconds`` each; None where the loop cannot be built."""
    threads = torch.get_num_threads() if threads is None else threads
    if not isinstance(threads, int) or threads < 1 or not seconds > 0 or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"peak loop: threads {threads}, seconds {seconds} and repeats {repeats} must be positive")
    lib = KERNEL.get()
    if lib is None:
        return None
    out = ctypes.c_float(0.0)
    iters = 1 << 16
    while True:  # grow the loop until one run takes long enough to time
        t0 = time.perf_counter()
        lanes = lib.tr_fma_peak(ctypes.c_int64(iters), threads, ctypes.byref(out))
        if time.perf_counter() - t0 >= seconds / 4 or iters >= 1 << 34:
            break
        iters *= 4
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        lib.tr_fma_peak(ctypes.c_int64(iters), threads, ctypes.byref(out))
        best = min(best, time.perf_counter() - t0)
    return 2 * lanes * CHAINS * iters * threads / best / 1e9


LLAMA_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def counts(config: Any) -> bool:
    """Whether :func:`forward_flops` can count this model: a Llama-shaped config (the fields it reads)."""
    return all(isinstance(getattr(config, f, None), int) for f in LLAMA_FIELDS)


def _dims(config: Any) -> tuple[int, int, int, int, int, int, int]:
    """(layers, hidden, heads, key/value heads, head size, intermediate, vocabulary) of a Llama-shaped
    config."""
    heads, kv_heads, head_dim = attention_shape(config)
    return (config.num_hidden_layers, config.hidden_size, heads, kv_heads, head_dim, config.intermediate_size,
            config.vocab_size)


def linear_macs_per_token(config: Any) -> int:
    """Multiply-adds of every linear layer for one token: q/k/v/o, the gated MLP (gate, up, down)
    and the LM head."""
    layers, hidden, heads, kv_heads, head_dim, inter, vocab = _dims(config)
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    return layers * per_layer + vocab * hidden


def forward_flops(config: Any, context: int, mask: torch.Tensor) -> int:
    """FLOPs (2 per multiply-add) of one verify forward of the tree ``mask`` [q, q] (True where a node
    sees another: its ancestors and itself) over a ``context``-token prefix: the linears for each of
    the q tokens, and attention scores and weighted values over the keys each node sees."""
    layers, _, heads, _, head_dim, _, _ = _dims(config)
    q = mask.shape[-1]
    keys_seen = q * context + int(mask.sum())
    attention = layers * heads * head_dim * 2 * keys_seen  # q.k and p.v: one multiply-add per key and lane each
    return 2 * (q * linear_macs_per_token(config) + attention)
