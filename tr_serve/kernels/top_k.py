"""The top-k token ids of every row of a step's logits, and with them the argmax, in one pass on CPU.

Why: after each verify forward the engine needs the model's argmax after every verified node
(acceptance) and, under Token Recycling, the top-k of the same rows (the matrix's new rows). As
torch ops that is two blocked passes of ~5 small calls each, and the first calls after a forward
run with cold caches (the forward has just streamed ~650 MB of weights through them): measured
in place of the engine's, SmolLM2-135M (V = 49152), 2 threads, the argmax took 0.36-0.41 ms per
step at 1 row and the matrix's top-8 another 0.2 ms. Measured right after an LM head, this
kernel returned both in 57 us for 1 row, 106 for 5, 289 for 20 (torch: 182 + 202, 285 + 269,
422 + 556 us), before the faster scan below.

Per row it keeps the k largest values seen so far, largest first, and scans the row 64 floats at a
time: four 16-float blocks with no value above the current k-th are skipped together after a few
vector compares, so only a few dozen of the 49152 values are ever inserted. (The test of a compare's
lanes used to be a loop over them, which compiled to ~40 scalar extracts per block and made the scan
bound by instructions: measured right after an LM head, k = 8, 2 threads, 1 row 88 -> 67 us, 8 rows
199 -> 116 us, 18 rows 461 -> 217 us; 140 -> 36 us for 18 rows already in cache.)

A value is inserted after every value greater or equal to it, so equal values stay in index order
and ``[:, 0]`` is the first index of the maximum: exactly ``torch.argmax``. A row holding a NaN
(where ``torch.argmax`` answers the NaN's index) or fewer than k values above -inf is flagged and
:func:`top_k_rows` leaves the whole call to torch. The top-k may order equal values differently
from ``torch.topk`` (which leaves ties unspecified); it only feeds drafts.

Nothing here is required: without a compiler or torch's libgomp, or when the self-check fails,
:func:`top_k_rows` returns None and the caller uses torch. ``TR_SERVE_TOP_K=0`` turns it off.
The C code is ``tr_serve/kernels/csrc/top_k.c``, built with the other kernels into one library
(:mod:`tr_serve.kernels.native`).
"""

from __future__ import annotations

import ctypes

import torch

from tr_serve.kernels import native

MAX_K = 64  # csrc/top_k.h's TOP_K_MAX (tests/kernels/test_csrc.py)

def _self_check(lib: ctypes.CDLL) -> bool:
    g = torch.Generator().manual_seed(0)
    for n, v, k in ((1, 64, 1), (3, 160, 8), (5, 4096, 8)):
        x = torch.randn(n, v, generator=g)
        x[0, 7] = x[0, 70 % v] = x[0].max() + 1  # a tie for the maximum: the first index wins
        top = _run(lib, x, k)
        if top is None or not torch.equal(top[:, 0], x.argmax(dim=-1)):
            return False
        if not torch.equal(x.gather(1, top), torch.topk(x, k, dim=-1).values):
            return False
    return True


KERNEL = native.Kernel("top-k", "top_k", "TR_SERVE_TOP_K", _self_check)


def check_args(logits: torch.Tensor, k: int) -> None:
    """What the kernel assumes (raises otherwise): fp32 CPU logits [n >= 1, V] with V a multiple of
    16, contiguous rows, and 1 <= k <= min(64, V)."""
    native.check_floats("top-k: logits", logits, 2)
    n, v = logits.shape
    if n < 1 or v < 16 or v % 16:
        raise ValueError(f"top-k: logits {tuple(logits.shape)}: no rows, or a vocabulary not a multiple of 16")
    if logits.stride(1) != 1 or (n > 1 and logits.stride(0) < v):
        raise ValueError("top-k: each row of logits must be contiguous, rows apart")
    if not isinstance(k, int) or not 1 <= k <= min(MAX_K, v):
        raise ValueError(f"top-k: k = {k} outside [1, {min(MAX_K, v)}]")


def _run(lib: ctypes.CDLL, logits: torch.Tensor, k: int) -> torch.Tensor | None:
    check_args(logits, k)
    n, v = logits.shape
    out = torch.empty(n, k, dtype=torch.long)
    flags = torch.empty(n, dtype=torch.int32)
    lib.tr_top_k(logits.data_ptr(), logits.stride(0), n, v, k, out.data_ptr(), flags.data_ptr(),
                 torch.get_num_threads())
    return None if bool(flags.any()) else out


def top_k_indices(logits: torch.Tensor, k: int, block: int = 128) -> torch.Tensor:
    """``torch.topk(logits, k, dim=-1).indices`` for [n, V] logits, in two short passes: the k
    blocks of ``block`` logits with the largest maxima hold the top k (a logit outside them is below
    k block maxima), so only those blocks are ranked. Measured at V = 49152, 2 threads: 16 rows
    0.86 -> 0.22 ms. Falls back to ``torch.topk`` where V does not split into at least k blocks."""
    n, v = logits.shape
    if v % block or v // block < k:
        return torch.topk(logits, k, dim=-1).indices
    blocks = logits.reshape(n, v // block, block)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [n, k] the blocks holding the top k
    candidates = blocks.gather(1, best[:, :, None].expand(n, k, block)).reshape(n, k * block)
    top = candidates.topk(k, dim=-1).indices  # [n, k] into the candidates, best first
    return best.gather(1, top // block) * block + top % block


def top_k_rows(logits: torch.Tensor, k: int) -> torch.Tensor | None:
    """[n, k] int64 indices of each row's k largest ``logits`` [n, V], largest first, ``[:, 0]``
    equal to ``logits.argmax(dim=-1)``; None where this kernel does not apply (not fp32 on CPU,
    V not a multiple of 16, k above 64 or V, a row with a NaN or fewer than k finite-ranked
    values, or no kernel here): the caller then uses torch. A k below 1 or above V, or logits that
    are not 2-D, are the caller's error (ValueError), as ``torch.topk`` would say."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("top-k: logits must be a 2-D tensor [rows, vocabulary]")
    if not isinstance(k, int) or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"top-k: k = {k} outside [1, {logits.shape[1]}]")
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.shape[0] == 0
            or logits.shape[1] % 16 or k > MAX_K or logits.stride(1) != 1
            or (logits.shape[0] > 1 and logits.stride(0) < logits.shape[1])):
        return None
    lib = KERNEL.get()
    if lib is None:
        return None
    return _run(lib, logits, k)
