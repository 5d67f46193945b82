"""A small-M fp32 GEMM for CPU (``y = x @ W.T`` for a few to a few dozen rows), compiled on this machine.

Why: a forward over a few query tokens streams every weight from memory once; with more rows, each
weight element read should feed more multiply-adds at no extra memory cost. MKL's small-M paths
and oneDNN's prepacked linear leave that on the table on some CPUs (measured on this 2-core AMD
EPYC, all of SmolLM2-135M's linears, 2 threads: 20 ms for 1 row with MKL, 29 ms for 8 and 35 ms
for 16 with oneDNN, while the weight stream alone takes ~20 ms and 16 rows are ~22 ms of
multiply-adds at the cores' peak).

This kernel stores each weight matrix as panels of 16 output features, ``[N/16][K][16]``, read
sequentially (with software prefetch) once per call. For each panel it keeps the 16 outputs of
every row in vector registers and, for each k, loads 16 weights once and multiplies them with each
row's ``x[m, k]`` (a fused multiply-add per row). Calls of up to 6 rows and of 9 work on 3-4 panels
at once (more weight streams in flight, as many as the registers hold: 4 up to 6 rows, 3 for 9; 5, 6
and 9 rows keep their running totals in the output to make room). 7-8 and 13-16 rows take 6 panels
at a time in blocks of 4 rows per sub-block of 64 k, the blocks after the first reading the
weights from the L1 cache: the stream's speed follows the number of panels read at once (13-16
rows only where the kernel plan measured that faster: :func:`set_wide_narrow`). Calls of
10-12 rows and 17 or more take 3 panels at a time and their rows in blocks of at most 8, shared out
evenly up to 128 rows (17 rows: 6 + 6 + 5; past 128, 128 rows at a time in blocks of 8), per
sub-block of 64 k (whole 128-k blocks above 24 rows): the
sub-block's weights come from memory for the first block and from the L1 cache for the rest, so 3
weight streams stay in flight (one panel at a time for 16 rows had left the stream at about 17 GB/s,
against 28 for one row), and the short passes over the L1 copy let the stream go on between them.
Every group of panels prefetches the next group's first lines before it ends (``pf_line``), so a new
group never starts cold. The same vector code is
written with GCC vector extensions and compiled with ``-march=native`` by the C compiler found at
start-up (``$CC``, ``cc`` or ``gcc``), so it uses AVX-512 where the CPU has it and AVX2 or NEON
elsewhere. It runs on torch's own OpenMP team (the library links ``libgomp.so.1``, which resolves to
the copy torch has already loaded), so it never competes with torch's threads. Per row count, the
weights are prefetched into L1 or into L2, as the kernel plan measured faster (:func:`set_prefetch_l2`).

Arithmetic: each output is the sum over k of ``x[m, k] * w[n, k]``, accumulated in fp32 by fused
multiply-adds in blocks of 128 k (blocks added in order). The order does not depend on the number
of rows or on which other rows are in the call: a row's result is bit-identical whatever M (batch
invariant), and close to torch's (a different summation order, as between any two BLAS kernels).

The C code is ``tr_serve/kernels/csrc/panel_gemm.c`` (its functions declared in ``panel_gemm.h``), built
with the other kernels into one library (:mod:`tr_serve.kernels.native`).

Nothing here is required: without a compiler, without torch's libgomp, or when the self-check
fails, :func:`load` returns None and the kernel plan never offers this kernel.
"""

from __future__ import annotations

import ctypes
from typing import Iterable

import torch
import torch.nn.functional as F

from tr_serve.kernels import native


PANEL = 16  # output features per panel


def _compiler() -> str | None:
    return native.compiler()


def _self_check(lib: ctypes.CDLL) -> bool:
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 48, 40), (1, 112, 40), (1, 96, 20), (1, 80, 24), (3, 112, 40), (5, 40, 300), (6, 112, 40),
                    (7, 80, 40), (8, 112, 300), (9, 112, 300), (10, 48, 300), (16, 32, 129), (19, 16, 8)):
        w = torch.randn(n, k, generator=g)
        x = torch.randn(m, k, generator=g)
        got = _run(lib, x, pack(w), n)
        if not torch.allclose(got, F.linear(x, w), rtol=1e-4, atol=1e-4):
            return False
    return True


KERNEL = native.Kernel("panel GEMM", "panel_gemm", "TR_SERVE_PANEL_GEMM", _self_check,
                       find_compiler=lambda: _compiler())  # csrc/panel_gemm.c


def load() -> ctypes.CDLL | None:
    """The compiled kernel (built once per machine into the tr_serve cache), or None when it is not
    available here. Never raises."""
    return KERNEL.load()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 weight -> panels [ceil(N/16), K, 16] (zero rows pad N to a multiple of 16)."""
    n, k = weight.shape
    n16 = -(-n // PANEL) * PANEL
    w = weight.detach().float()
    if n16 != n:
        w = torch.cat([w, w.new_zeros(n16 - n, k)])
    return w.reshape(n16 // PANEL, PANEL, k).transpose(1, 2).contiguous()


def check_args(x: torch.Tensor, panels: torch.Tensor, n: int) -> None:
    """What the kernel assumes of a call (raises otherwise): ``x`` fp32 CPU [..., K] with at least
    one row and K >= 1; ``panels`` fp32 CPU contiguous [ceil(n / 16), K, 16]."""
    native.check_floats("panel GEMM input", x)
    native.check_floats("panel GEMM panels", panels, 3)
    if x.dim() < 1 or x.shape[-1] < 1 or x.numel() == 0:
        raise ValueError(f"panel GEMM: no rows or no inputs in {tuple(x.shape)}")
    nb, k, lanes = panels.shape
    if lanes != PANEL or k != x.shape[-1] or not panels.is_contiguous():
        raise ValueError(f"panel GEMM: panels {tuple(panels.shape)} (contiguous: {panels.is_contiguous()}) do "
                         f"not pack a weight of {x.shape[-1]} inputs as [N/16, K, 16]")
    if not isinstance(n, int) or n < 1 or -(-n // PANEL) != nb:
        raise ValueError(f"panel GEMM: {n} outputs do not fill {nb} panels of {PANEL}")


def _run(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor:
    check_args(x, panels, n)
    if not x.is_contiguous():
        x = x.contiguous()
    k = x.shape[-1]
    nb = panels.shape[0]
    width = nb * PANEL
    y = torch.empty(*x.shape[:-1], width, dtype=torch.float32)
    rc = lib.tr_panel_gemm(x.data_ptr(), k, panels.data_ptr(), y.data_ptr(), width, x.numel() // k, k, nb,
                           torch.get_num_threads())
    if rc == 1:
        raise MemoryError("panel GEMM: out of memory")
    if rc != 0:
        raise ValueError(f"panel GEMM: sizes it does not take (x {tuple(x.shape)}, panels {tuple(panels.shape)})")
    return y if width == n else y[..., :n].contiguous()


def linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for fp32 CPU ``x`` [..., K], with ``panels = pack(W)`` and N = ``n``."""
    lib = KERNEL.get()
    if lib is None:
        raise RuntimeError("the panel GEMM is not available on this machine")
    y = _run(lib, x, panels, n)
    if bias is not None:
        y = y + bias
    return y



PREFETCH_L2_MAX_ROWS = 64  # csrc/panel_gemm.h's (tests/kernels/test_csrc.py): more rows always prefetch into L1
_wide_narrow = True  # the library's settings (its defaults); the setters skip calls that change nothing
_prefetch_l2: frozenset[int] = frozenset()


def set_wide_narrow(on: bool) -> None:
    """Whether calls of 13-16 rows take the narrow row blocks (blocks of 4 rows over 6 panels, the
    default) or blocks of 8 over 3 panels. The sums and their order are the same either way; which
    is faster depends on the CPU, so the kernel plan measures both (``kernel_autotune.measure_plan``)."""
    global _wide_narrow
    if bool(on) == _wide_narrow:
        return  # a plan re-applying its setting at each of its forwards
    lib = KERNEL.get()
    if lib is not None:
        lib.tr_panel_gemm_set_wide_narrow(int(bool(on)))
        _wide_narrow = bool(on)


def set_prefetch_l2(rows: Iterable[int]) -> None:
    """Calls of exactly these row counts (up to :data:`PREFETCH_L2_MAX_ROWS`) prefetch the weights into
    L2, every other count into L1 (the default). Same results either way; which is faster depends on
    the CPU and the row count, so the kernel plan measures both per token count."""
    global _prefetch_l2
    if isinstance(rows, frozenset) and rows == _prefetch_l2:
        return  # a plan's own set, applied at each of its forwards: nothing to rebuild
    lib = KERNEL.get()
    wanted = frozenset(int(r) for r in rows if 1 <= int(r) <= PREFETCH_L2_MAX_ROWS)
    if lib is None or wanted == _prefetch_l2:
        return
    for r in wanted ^ _prefetch_l2:
        lib.tr_panel_gemm_set_prefetch_l2(ctypes.c_int64(r), int(r in wanted))
    _prefetch_l2 = wanted
