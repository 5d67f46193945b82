"""Faster fp32 linear kernels for the small token counts of decoding and tree verification on CPU.

Why: torch's fp32 ``F.linear`` on CPU calls MKL sgemm, whose small-M paths are slow on some CPUs
(measured on this 2-core AMD EPYC: the model's linears cost 46 ms for 1 token, 73 ms for 2, 67 ms
for 8). Other kernels compute the same fp32 dot products much faster:

- ``mkl_nt``: ``weight @ x.T`` (MKL's tall-skinny path; one row is padded to two, because MKL's
  one-row path is a slow GEMV);
- ``onednn``: oneDNN's linear on a weight prepacked once (``torch.ops.mkldnn``), which keeps the
  cost almost flat from 3 to 16 tokens;
- ``panel``: this package's small-M GEMM on weights prepacked in 16-wide panels, compiled for this
  CPU at start-up when a C compiler is there (:mod:`tr_serve.kernels.panel_gemm`): every weight read
  once per call feeds all rows, so 8 rows cost about what 1 does and 16 rows little more.

Sibling projections that read the same input (an attention block's q/k/v, an MLP's gate/up) run as
one GEMM over their concatenated weights (:class:`FusedGroup`): one pass over the input, fewer and
wider kernel calls. Each output element is still the dot product of one input row with one weight
row, in fp32.

Which kernel serves which token count is a :class:`KernelPlan`, measured per CPU and model by
:mod:`tr_serve.kernels.kernel_autotune`. Results are fp32 like torch's, with a different summation
order: rounding-level differences only, exactly as between torch's own kernels for different batch
shapes.

The plan is active only inside :func:`KernelPlan.active` (the runner's forwards), so the same model
object used elsewhere, e.g. ``model.generate`` as the lossless reference, keeps torch's kernels.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import re
import threading
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tr_serve.kernels import panel_gemm

KERNELS = ("torch", "mkl_nt", "onednn", "panel")
PREPACKED = ("onednn", "panel")  # kernels that keep a repacked copy of every weight (memory: one more model)
PACK_HINT = 8  # oneDNN picks its weight layout for this many rows; measured flat from 3 to 16 here

_state = threading.local()


@dataclass(frozen=True)
class KernelPlan:
    """``kernels[i]`` serves token counts in (points[i-1], points[i]]; counts above the last point use
    torch's own kernel. ``rows[i]``, when given, is the row count those calls are padded to (zero
    rows appended, their outputs dropped): a larger measured point that runs faster.
    ``panel_wide_narrow``: whether the panel GEMM runs 13-16 rows in its narrow row blocks
    (:func:`panel_gemm.set_wide_narrow`); ``panel_prefetch_l2[i]``, when given: whether its calls
    in point i's bucket prefetch the weights into L2 (:func:`panel_gemm.set_prefetch_l2`). The same
    results either way; the speed is measured per CPU. Those two are settings of the process's one
    panel GEMM library: :meth:`active` applies them, and they stay until another plan's block."""

    points: tuple[int, ...]
    kernels: tuple[str, ...]
    rows: tuple[int, ...] | None = None
    panel_wide_narrow: bool = True
    panel_prefetch_l2: tuple[bool, ...] | None = None

    def __post_init__(self):
        if len(self.points) != len(self.kernels) or (self.rows is not None and len(self.rows) != len(self.points)):
            raise ValueError("points, kernels and rows must have the same length")
        if any(k not in KERNELS for k in self.kernels):
            raise ValueError(f"unknown kernel in {self.kernels}")
        if list(self.points) != sorted(set(self.points)) or any(p < 1 for p in self.points):
            raise ValueError(f"points must be increasing positive counts, got {self.points}")
        if self.rows is not None and any(r < p for r, p in zip(self.rows, self.points)):
            raise ValueError("a padded row count is below its point")
        if self.panel_prefetch_l2 is not None and len(self.panel_prefetch_l2) != len(self.points):
            raise ValueError("panel_prefetch_l2 needs one entry per point")

    @functools.cached_property
    def prefetch_l2_rows(self) -> frozenset[int]:
        """The row counts whose panel GEMM calls prefetch into L2: every count of the buckets marked so."""
        if self.panel_prefetch_l2 is None:
            return frozenset()
        bounds = (0, *self.points)
        return frozenset(n for i, on in enumerate(self.panel_prefetch_l2) if on
                         for n in range(bounds[i] + 1, bounds[i + 1] + 1))

    def kernel_for(self, n: int) -> str:
        i = bisect.bisect_left(self.points, n)
        return self.kernels[i] if i < len(self.kernels) else "torch"

    def choice(self, n: int) -> tuple[str, int]:
        """(kernel, rows to run) for a call on ``n`` rows: rows == n unless the plan pads this
        count's bucket to a larger point."""
        i = bisect.bisect_left(self.points, n)
        if i >= len(self.kernels):
            return "torch", n
        if self.rows is None or self.rows[i] == self.points[i]:
            return self.kernels[i], n
        return self.kernels[i], self.rows[i]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        previous = getattr(_state, "plan", None)
        _state.plan = self
        if "panel" in self.kernels:
            panel_gemm.set_wide_narrow(self.panel_wide_narrow)
            panel_gemm.set_prefetch_l2(self.prefetch_l2_rows)
        try:
            yield
        finally:
            _state.plan = previous
            if previous is None:
                _state.stash = {}  # sibling outputs nobody asked for do not outlive the forward


class KernelLinear(nn.Linear):
    """An ``nn.Linear`` whose forward follows the active :class:`KernelPlan` (torch's when none is).
    Swapped in by changing ``__class__``, so weights, hooks and sharding stay as they are."""

    packed: torch.Tensor | None  # oneDNN's prepacked weight
    panels: torch.Tensor | None  # the panel GEMM's prepacked weight
    group: "FusedGroup | None"
    layer: int | None  # the index of the block it belongs to (``model.layers.3.mlp.up_proj``: 3), if any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan: KernelPlan | None = getattr(_state, "plan", None)
        if plan is None or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        if self.group is not None:
            return self.group.output(self, x, plan)
        return run_planned(self, x, plan)


class FusedGroup:
    """Linears that read the same input, run as one GEMM. The members' weights become row views of
    one concatenated tensor (same values, no extra memory; every view stays 64-byte aligned, so
    torch's own kernels see the weights exactly as before); the first member called with an input
    computes every member's output, and the others take theirs when called with the same input object
    (transformers' blocks pass one tensor to all siblings; inference tensors carry no version counter,
    and nothing modifies a block's normalised input in place between its sibling projections)."""

    def __init__(self, members: list[KernelLinear]):
        self.members = tuple(members)
        self.in_features = members[0].in_features
        self.out_features = sum(m.out_features for m in members)
        self.bounds = []
        start = 0
        for m in members:
            self.bounds.append((start, start + m.out_features))
            start += m.out_features
        weight = torch.cat([m.weight.detach() for m in members])
        for m, (a, b) in zip(members, self.bounds):
            m.weight.data = weight[a:b]
            m.group = self
        self.weight = weight
        has_bias = [m.bias is not None for m in members]
        self.bias = torch.cat([m.bias.detach() for m in members]) if all(has_bias) else None
        if any(has_bias) and not all(has_bias):
            raise ValueError("members must all have a bias or none")
        self.packed: torch.Tensor | None = None
        self.panels: torch.Tensor | None = None
        self.layer: int | None = getattr(members[0], "layer", None)

    @staticmethod
    def fusable(members: list[nn.Module]) -> bool:
        if len(members) < 2 or not all(type(m) is KernelLinear and m.group is None for m in members):
            return False
        first = members[0]
        if any(m.in_features != first.in_features for m in members):
            return False
        if len({m.bias is not None for m in members}) != 1:
            return False
        if any(not m.weight.is_contiguous() or m.weight.requires_grad for m in members):
            return False
        # each member's view must start 64-byte aligned, as torch's allocator aligns tensors
        offset = 0
        for m in members:
            if (offset * first.in_features * 4) % 64:
                return False
            offset += m.out_features
        return True

    def output(self, member: KernelLinear, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
        stash = _stash()
        entry = stash.get(id(self))
        if entry is None or entry[0] is not x or member not in entry[1]:
            y = run_planned(self, x, plan)
            entry = (x, {m: y[..., a:b] for m, (a, b) in zip(self.members, self.bounds)})
            stash[id(self)] = entry
        out = entry[1].pop(member)
        if not entry[1]:
            del stash[id(self)]
        return out


def active_plan() -> KernelPlan | None:
    """The plan of the enclosing :meth:`KernelPlan.active` block on this thread (None outside one)."""
    return getattr(_state, "plan", None)


def _stash() -> dict:
    stash = getattr(_state, "stash", None)
    if stash is None:
        stash = _state.stash = {}
    return stash


def run_planned(linear: KernelLinear | FusedGroup, x: torch.Tensor, plan: KernelPlan) -> torch.Tensor:
    n = x.numel() // x.shape[-1]
    kernel, rows = plan.choice(n)
    if rows == n:
        return run_kernel(linear, x, kernel)
    h = x.reshape(n, x.shape[-1])
    padded = torch.cat([h, h.new_zeros(rows - n, h.shape[1])])
    return run_kernel(linear, padded, kernel)[:n].reshape(*x.shape[:-1], linear.out_features)


def run_kernel(linear: KernelLinear | FusedGroup, x: torch.Tensor, kernel: str) -> torch.Tensor:
    if kernel == "torch" or (kernel == "onednn" and linear.packed is None) or (kernel == "panel" and linear.panels is None):
        return F.linear(x, linear.weight, linear.bias)
    if kernel == "panel":
        return panel_gemm.linear(x, linear.panels, linear.out_features, linear.bias)
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


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # read the same input in HF models
_LAYER_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def _layer_index(name: str) -> int | None:
    """The first numeric part of a module's name (``model.layers.3.mlp.up_proj``: 3): its block."""
    found = _LAYER_INDEX.search(name)
    return int(found.group(1)) if found else None


def kernel_linears(model: nn.Module) -> list[KernelLinear]:
    """Turn every fp32 CPU ``nn.Linear`` of ``model`` into a :class:`KernelLinear` (idempotent)."""
    out = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu":
            module.__class__ = KernelLinear
            module.packed = None
            module.panels = None
            module.group = None
            module.layer = _layer_index(name)
        if isinstance(module, KernelLinear):
            out.append(module)
    return out


def fuse_siblings(model: nn.Module) -> list[FusedGroup]:
    """Fuse each block's sibling projections (:data:`SIBLINGS`) into a :class:`FusedGroup`
    (idempotent: members already fused are left alone)."""
    groups = []
    for module in model.modules():
        for names in SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if all(isinstance(m, KernelLinear) for m in members):
                if members[0].group is not None and members[0].group.members == tuple(members):
                    groups.append(members[0].group)
                elif FusedGroup.fusable(members):
                    groups.append(FusedGroup(members))
    return groups


def kernel_calls(model: nn.Module) -> list[KernelLinear | FusedGroup]:
    """What a forward runs, in model order: each fused group once, every other kernel linear."""
    calls, seen = [], set()
    for m in kernel_linears(model):
        unit = m.group if m.group is not None else m
        if id(unit) not in seen:
            seen.add(id(unit))
            calls.append(unit)
    return calls


def pack(calls: list, kernel: str = "onednn") -> None:
    """Prepack every call's weight for ``kernel`` ("onednn" or "panel")."""
    for m in calls:
        if kernel == "onednn" and m.packed is None:
            m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_HINT)
        elif kernel == "panel" and m.panels is None:
            m.panels = panel_gemm.pack(m.weight)


def unpack(calls: list, kernel: str = "onednn") -> None:
    for m in calls:
        if kernel == "onednn":
            m.packed = None
        else:
            m.panels = None


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def available_kernels() -> list[str]:
    """The kernels this machine can run, in :data:`KERNELS` order."""
    out = ["torch", "mkl_nt"]
    if onednn_available():
        out.append("onednn")
    if panel_gemm.load() is not None:
        out.append("panel")
    return out

