"""Faster fp32 linear kernels for the small token counts of decoding and tree verification on CPU.

Why: torch's fp32 ``F.linear`` on CPU calls MKL sgemm, whose small-M paths are slow on some CPUs
(measured on this 2-core AMD EPYC: the whole SmolLM2 forward costs 56 ms for 1 token, 90 ms for 2,
77 ms for 8). Two other kernels already in torch compute the same fp32 dot products much faster:

- ``mkl_nt``: ``weight @ x.T`` (MKL's tall-skinny path; one row is padded to two, because MKL's
  one-row path is a slow GEMV);
- ``onednn``: oneDNN's linear on a weight prepacked once (``torch.ops.mkldnn``), which keeps the
  cost almost flat from 3 to 16 tokens.

Which kernel wins depends on the CPU and the token count, so :func:`select_plan` measures every
kernel on the model's own linear shapes at start-up (cached on disk) and keeps, per token count, the
fastest. Results are fp32 like torch's, with a different summation order: rounding-level differences
only, exactly as between torch's own kernels for different batch shapes.

The plan is active only inside :func:`KernelPlan.active` (the runner's forwards), so the same model
object used elsewhere, e.g. ``model.generate`` as the lossless reference, keeps torch's kernels.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import logging
import platform
import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

KERNELS = ("torch", "mkl_nt", "onednn")
POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # token counts measured; above the last: torch
PACK_HINT = 8  # oneDNN picks its weight layout for this many rows; measured flat from 3 to 16 here

_state = threading.local()


@dataclass(frozen=True)
class KernelPlan:
    """``kernels[i]`` serves token counts in (points[i-1], points[i]]; counts above the last point use
    torch's own kernel."""

    points: tuple[int, ...]
    kernels: tuple[str, ...]

    def kernel_for(self, n: int) -> str:
        i = bisect.bisect_left(self.points, n)
        return self.kernels[i] if i < len(self.kernels) else "torch"

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        previous = getattr(_state, "plan", None)
        _state.plan = self
        try:
            yield
        finally:
            _state.plan = previous


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` whose forward follows the active :class:`KernelPlan` (torch's when none is).
    Swapped in by changing ``__class__``, so weights, hooks and sharding stay as they are."""

    packed: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan: KernelPlan | None = getattr(_state, "plan", None)
        if plan is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return run_kernel(self, x, plan.kernel_for(x.numel() // x.shape[-1]))


def run_kernel(linear: KernelLinear, x: torch.Tensor, kernel: str) -> torch.Tensor:
    if kernel == "torch" or (kernel == "onednn" and linear.packed is None):
        return F.linear(x, linear.weight, linear.bias)
    lead = x.shape[:-1]
    h = x.reshape(-1, x.shape[-1]).contiguous()  # [n, in]
    if kernel == "onednn":
        y = torch.ops.mkldnn._linear_pointwise(h, linear.packed, linear.bias, "none", [], "")
    else:  # mkl_nt: [out, in] @ [in, n], with n >= 2 (MKL's n = 1 path is a slow GEMV)
        n = h.shape[0]
        hh = torch.cat([h, h]) if n == 1 else h
        y = torch.mm(linear.weight, hh.T)[:, :n].T.contiguous()
        if linear.bias is not None:
            y = y + linear.bias
    return y.reshape(*lead, y.shape[-1])


def kernel_linears(model: nn.Module) -> list[KernelLinear]:
    """Turn every fp32 CPU ``nn.Linear`` of ``model`` into a :class:`KernelLinear` (idempotent)."""
    out = []
    for module in model.modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.__class__ = KernelLinear
            module.packed = None
        if isinstance(module, KernelLinear):
            out.append(module)
    return out


def _pack(linears: list[KernelLinear]) -> None:
    for m in linears:
        if m.packed is None:
            m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_HINT)


def _unpack(linears: list[KernelLinear]) -> None:
    for m in linears:
        m.packed = None


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _time_all(linears: list[KernelLinear], inputs: dict[int, torch.Tensor], kernel: str, repeats: int) -> float:
    """Seconds to run every linear once (in model order, so weights stream from memory as in a forward)."""
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        for m in linears:
            run_kernel(m, inputs[m.in_features], kernel)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_plan(linears: list[KernelLinear], points: tuple[int, ...] = POINTS, repeats: int = 1) -> tuple[KernelPlan, dict]:
    kernels = [k for k in KERNELS if k != "onednn" or onednn_available()]
    if "onednn" in kernels:
        _pack(linears)
    widths = sorted({m.in_features for m in linears})
    chosen, seconds = [], {}
    with torch.inference_mode():
        for n in points:
            inputs = {w: torch.randn(n, w) for w in widths}
            times = {k: _time_all(linears, inputs, k, repeats) for k in kernels}
            seconds[n] = times
            chosen.append(min(times, key=times.get))
    if "onednn" not in chosen:
        _unpack(linears)  # the packed copies cost as much memory as the weights
    return KernelPlan(tuple(points), tuple(chosen)), seconds


def plan_key(linears: list[KernelLinear]) -> str:
    shapes = sorted({(m.out_features, m.in_features, m.bias is not None) for m in linears})
    raw = f"{shapes}|{len(linears)}|{platform.machine()}|{platform.processor()}|threads{torch.get_num_threads()}|{torch.__version__}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def _parse_plan(data: dict) -> KernelPlan:
    plan = KernelPlan(tuple(data["points"]), tuple(data["kernels"]))
    if any(k not in KERNELS for k in plan.kernels) or len(plan.points) != len(plan.kernels):
        raise ValueError("unknown kernel or mismatched lengths")
    return plan


def select_plan(model: nn.Module) -> KernelPlan | None:
    """The kernel plan for ``model`` on this CPU: loaded from the cache or measured (a few seconds
    for SmolLM2-135M). None when the model has no fp32 CPU linears."""
    from tr_serve.disk_cache import load_json, save_json
    from tr_serve.model_loader import cache_root

    cached = getattr(model, "_tr_kernel_plan", None)
    if cached is not None:
        return cached
    linears = kernel_linears(model)
    if not linears:
        return None
    path = cache_root() / "kernels" / f"{plan_key(linears)}.json"
    plan = load_json(path, _parse_plan, "kernel plan")
    if plan is None:
        logger.info("measuring CPU linear kernels (cached in %s)", path)
        plan, seconds = measure_plan(linears)
        save_json(path, {"points": plan.points, "kernels": plan.kernels,
                         "seconds": {str(n): t for n, t in seconds.items()}}, "kernel plan")
    elif "onednn" in plan.kernels:
        _pack(linears)
    model._tr_kernel_plan = plan
    return plan
