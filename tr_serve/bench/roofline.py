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
multiply-adds on the widest float vectors the CPU has, one per thread of torch's OpenMP team.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import torch

from tr_serve.model_shape import attention_shape
from tr_serve.runner import native

CHAINS = 12  # accumulators per thread: enough to hide a multiply-add's latency on 1-2 units, and with w
# and x, 14 registers: within the 16 of AVX2

SOURCE = r"""
#include <stdint.h>
#include <omp.h>

/* the widest vector the target has, so that CHAINS accumulators stay in registers (16 of them on
   AVX2 and SSE: a 64-byte vector there takes two, and 24 spilled to the stack) */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vec __attribute__((vector_size(LANES * 4)));

/* CHAINS independent chains of ITERS fused multiply-adds of LANES floats per thread; the sum of
   every lane goes to out so that nothing is optimised away. Returns LANES (0: no threads, no iterations). */
int tr_fma_peak(int64_t iters, int nthreads, float *out) {
    if (iters < 1 || nthreads < 1) return 0;
    float total = 0.0f;
    #pragma omp parallel num_threads(nthreads) reduction(+:total)
    {
        /* w and x depend on run-time values, so the compiler can fold nothing out of the loop */
        const vec w = (vec){0} + (0.999999f + 1e-9f * (float)nthreads);
        const float x = 1e-7f * (float)(omp_get_thread_num() + 1);
        vec acc[CHAINS];
        for (int j = 0; j < CHAINS; j++) acc[j] = (vec){0} + (float)j;
        for (int64_t i = 0; i < iters; i++)
            for (int j = 0; j < CHAINS; j++) acc[j] = acc[j] * w + x;
        for (int j = 0; j < CHAINS; j++)
            for (int l = 0; l < LANES; l++) total += acc[j][l];
    }
    *out = total;
    return LANES;
}
"""


def _self_check(lib: ctypes.CDLL) -> bool:
    out = ctypes.c_float(0.0)
    return lib.tr_fma_peak(ctypes.c_int64(10), 1, ctypes.byref(out)) in (4, 8, 16) and out.value > 0.0


KERNEL = native.Kernel("fp32 peak loop", "fma_peak", f"#define CHAINS {CHAINS}\n" + SOURCE, "TR_SERVE_FMA_PEAK",
                       "tr_fma_peak", [ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_float)], _self_check)


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
