"""Faster fp32 linear kernels for the small token counts of decoding and tree verification on CPU.

Why: torch's fp32 ``F.linear`` on CPU calls MKL sgemm, whose small-M paths are slow on some CPUs
(measured on this 2-core AMD EPYC: the model's linears cost 46 ms for 1 token, 73 ms for 2, 67 ms
for 8). Other kernels compute the same fp32 dot products much faster:

- ``mkl_nt``: ``weight @ x.T`` (MKL's tall-skinny path; one row is padded to two, because MKL's
  one-row path is a slow GEMV);
- ``onednn``: oneDNN's linear on a weight prepacked once (``torch.ops.mkldnn``), which keeps the
  cost almost flat from 3 to 16 tokens;
- ``panel``: this package's small-M GEMM on weights prepacked in 16-wide panels, compiled for this
  CPU at start-up when a C compiler is there (:mod:`tr_serve.runner.panel_gemm`): every weight read
  once per call feeds all rows, so 8 rows cost about what 1 does and 16 rows little more.

Sibling projections that read the same input (an attention block's q/k/v, an MLP's gate/up) run as
one GEMM over their concatenated weights (:class:`FusedGroup`): one pass over the input, fewer and
wider kernel calls. Each output element is still the dot product of one input row with one weight
row, in fp32.

Which kernel wins depends on the CPU and the token count, so :func:`select_plan` measures every
kernel on the model's own linear calls at start-up (cached on disk) and keeps, per token count, the
fastest; a count may also run padded to a larger measured count when that is faster (oneDNN's
one-row path, for one, is slower than its four-row one), and at most one prepacked copy of the
weights is kept (:func:`plan_from_seconds`). Timing is interleaved over kernels and counts and
repeated (min of N); a pair whose every sample ran while other processes held the CPUs (Linux
pressure stall information) is timed again, and counts whose best time is far above a larger
count's are measured again, so that one noisy moment at start-up is not cached forever. A
measurement stops after :data:`MEASURE_SECONDS`; one taken mostly on a busy machine is cached as
provisional and measured again at a later start on a quiet machine, and a plan measured by older
code is never reused (:data:`PLAN_VERSION` is in the cache key). Results are fp32 like torch's, with
a different summation order: rounding-level differences only, exactly as between torch's own
kernels for different batch shapes.

The plan is active only inside :func:`KernelPlan.active` (the runner's forwards), so the same model
object used elsewhere, e.g. ``model.generate`` as the lossless reference, keeps torch's kernels.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import platform
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Generator, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tr_serve.runner import layer_driver, panel_gemm, tree_attention

logger = logging.getLogger(__name__)

KERNELS = ("torch", "mkl_nt", "onednn", "panel")
PREPACKED = ("onednn", "panel")  # kernels that keep a repacked copy of every weight (memory: one more model)
# token counts measured; above the last: torch. 256 and 512 are prefill chunks (the engine's default
# max_prefill_tokens is 512): measured here through the runner, whole prefill forwards of 150-512
# prompt tokens (one to four prompts) took 1.01-1.22x as long with torch's linear as with the panel GEMM
POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
PACK_HINT = 8  # oneDNN picks its weight layout for this many rows; measured flat from 3 to 16 here
# part of the cache key: bump it whenever a kernel or the plan's rules change what a plan would pick,
# so plans measured by older code are measured again (what each change was: git log of this line)
PLAN_VERSION = 14
ROUNDS = 5  # interleaved timing rounds per (count, kernel); the minimum is kept
CONTENDER = 1.5  # after two rounds, kernels slower than this times the best at a count stop being timed there
RECHECK = 1.10  # a count whose best time exceeds a larger count's by this factor is measured again
PAD_GAIN = 0.95  # pad a count up to a larger measured one only when that is at least 5% faster
# The panel GEMM's times at the token counts the decoder layers' C loop takes (runner/layer_driver.py:
# every linear on the panel GEMM at exactly the step's count, up to MAX_WIDTH_C_LOOP tokens) count as
# this fraction when kernels are compared: the plan times the linear layers alone, and only the panel
# GEMM lets the C loop replace the layers' Python loop, whose overhead is not in those times. Measured
# on this 2-core AMD EPYC (SmolLM2-135M, context 256): a plan that took mkl_nt at 1 and 2 tokens on
# linears 2% faster than the panel GEMM's (19.45 vs 19.82 ms) ran one-token forwards in 26.1 ms (min of
# 30; median 35.4) against 19.4 (24.3) with the panel GEMM, two-token ones in 29.7 against 20.7 ms.
# No credit where the C loop is not available here (:func:`c_loop_credit`).
C_LOOP_CREDIT = 0.85
C_LOOP_TOKENS = tree_attention.MAX_WIDTH_C_LOOP
WIDE_NARROW_POINT = 16  # the count at which the panel GEMM's two row-block shapes for 13-16 rows are compared
PANEL_DEFAULT = (True, False)  # the panel GEMM's (wide_narrow, prefetch_l2) when the plan's rounds time it
STALL_LIMIT = 0.25  # a sample during which tasks waited for a CPU over 25% of its time was disturbed
MAX_RETRY_SECONDS = 30.0  # time spent re-timing pairs that only had disturbed samples, at most
MEASURE_SECONDS = 90.0  # a measurement stops adding rounds after this long (a busy machine slows every pass)
BUSY_SHARE = 0.5  # a plan with more disturbed samples is provisional: measured again at a quiet start
QUIET_SHARE = 0.05  # quiet: tasks waited for a CPU less than 5% of the last 10 s

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


def _pack(calls: list, kernel: str = "onednn") -> None:
    """Prepack every call's weight for ``kernel`` ("onednn" or "panel")."""
    for m in calls:
        if kernel == "onednn" and m.packed is None:
            m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), PACK_HINT)
        elif kernel == "panel" and m.panels is None:
            m.panels = panel_gemm.pack(m.weight)


def _unpack(calls: list, kernel: str = "onednn") -> None:
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


def _time_pass(calls: list, inputs: dict[int, torch.Tensor], kernel: str, clock=time.perf_counter) -> float:
    """Seconds to run every call once (in model order, so weights stream from memory as in a forward)."""
    t0 = clock()
    for m in calls:
        run_kernel(m, inputs[m.in_features], kernel)
    return clock() - t0


def _cpu_stall() -> float | None:
    """Seconds for which runnable tasks of this machine have waited for a CPU since boot (Linux
    pressure stall information, "some"); None where the kernel does not report it."""
    try:
        with open("/proc/pressure/cpu") as f:
            return int(f.readline().rsplit("total=", 1)[1]) / 1e6
    except (OSError, ValueError, IndexError):
        return None


class Timings:
    """The fastest sample per (count, kernel), and which pairs had a clean sample: one during which
    no task of the machine waited for a CPU for more than :data:`STALL_LIMIT` of its time, so other
    processes did not take our cores. A pair whose samples were all disturbed may look far slower
    than it is."""

    def __init__(self):
        self.best: dict[tuple[int, str], float] = {}
        self.clean: set[tuple[int, str]] = set()
        self.samples = 0
        self.disturbed = 0

    def add(self, n: int, kernel: str, seconds: float, disturbed: bool) -> None:
        self.samples += 1
        self.best[n, kernel] = min(self.best.get((n, kernel), float("inf")), seconds)
        if disturbed:
            self.disturbed += 1
        else:
            self.clean.add((n, kernel))

    def table(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for (n, k), t in sorted(self.best.items()):
            out.setdefault(n, {})[k] = t
        return out


def _time_rounds(calls, inputs, kernels_at: dict[int, list[str]], rounds: int, timings: Timings,
                 deadline: float = float("inf"), clock=None, first_round: int = 0, stop=None,
                 now=time.perf_counter, evict=None) -> Iterator[None]:
    """``rounds`` interleaved rounds: every (count, kernel) once per round, kernels in a rotating
    order and counts alternately ascending and descending, so a slow moment of the machine lands on
    different pairs in different rounds. After ``deadline`` (on the ``now`` clock) only pairs never
    timed are timed; ``stop(timings)`` True after a sample ends the rounds. ``evict()``, when given,
    runs before each sample, untimed. A generator: it yields after every sample, so a deferred
    measurement can pause there (:class:`PlanMeasurement`)."""
    counts = sorted(n for n, ks in kernels_at.items() if ks)
    for r in range(first_round, first_round + rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            ks = kernels_at[n]
            for i in range(len(ks)):
                k = ks[(i + r) % len(ks)]
                if (n, k) in timings.best and now() > deadline:
                    continue
                if evict is not None:
                    evict()
                if clock is not None:  # CPU time of one thread: descheduling does not count, nothing to check
                    with _one_thread():
                        timings.add(n, k, _time_pass(calls, inputs[n], k, clock), False)
                    yield
                    continue
                before = _cpu_stall()
                seconds = _time_pass(calls, inputs[n], k)
                after = _cpu_stall()
                disturbed = before is not None and after is not None and after - before > STALL_LIMIT * seconds
                timings.add(n, k, seconds, disturbed)
                yield
                if stop is not None and stop(timings):
                    return


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread for one sample of a busy machine's proxy measurement (thread CPU time),
    then the thread count as it was: between samples the engine may run steps on all of them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class _WorkClock:
    """Seconds spent measuring: it runs only between :meth:`resume` and :meth:`pause`, so the time
    a deferred measurement waits between its slices does not use up its time budget."""

    def __init__(self, running: bool = False):
        self.spent = 0.0
        self._since: float | None = time.perf_counter() if running else None

    def resume(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def pause(self) -> None:
        if self._since is not None:
            self.spent += time.perf_counter() - self._since
            self._since = None

    def now(self) -> float:
        return self.spent + (time.perf_counter() - self._since if self._since is not None else 0.0)


def suspect_points(seconds: dict[int, dict[str, float]]) -> list[int]:
    """Counts whose best time exceeds the best time of a larger count by more than :data:`RECHECK`:
    more rows cost more work, so this is most likely a noisy measurement (it may also be real: a
    kernel's path for few rows can be slow, which padding then covers)."""
    points = sorted(seconds)
    best = {n: min(seconds[n].values()) for n in points}
    out = []
    for i, n in enumerate(points):
        if any(best[n] > RECHECK * best[m] for m in points[i + 1:]):
            out.append(n)
    return out


def c_loop_credit() -> float:
    """:data:`C_LOOP_CREDIT` where the decoder layers' C loop can run in this process
    (:func:`layer_driver.available`), else 1.0: no credit."""
    return C_LOOP_CREDIT if layer_driver.available() else 1.0


def _compared(n: int, kernel: str, seconds: float, credit: float) -> float:
    """The time the plan compares for ``kernel`` at ``n`` tokens run unpadded: the panel GEMM's
    times ``credit`` where the decoder layers' C loop takes the step (:data:`C_LOOP_CREDIT`)."""
    return seconds * credit if kernel == "panel" and n <= C_LOOP_TOKENS else seconds


def _fastest_plan(seconds: dict[int, dict[str, float]], credit: float = C_LOOP_CREDIT
                  ) -> tuple[KernelPlan, list[float]]:
    """Per count, the fastest kernel (:func:`_compared` times), or the fastest kernel of a larger
    count with the call padded to that count when that is at least 1 / :data:`PAD_GAIN` times
    faster (a padded call gets no C loop, so no credit); with each count's compared time."""
    points = sorted(seconds)
    own_k = {n: min(seconds[n], key=lambda k: (_compared(n, k, seconds[n][k], credit), k)) for n in points}
    own_t = {n: _compared(n, own_k[n], seconds[n][own_k[n]], credit) for n in points}
    pad_k = {n: min(seconds[n], key=lambda k: (seconds[n][k], k)) for n in points}
    pad_t = {n: seconds[n][pad_k[n]] for n in points}
    kernels, rows, times = [], [], []
    for i, n in enumerate(points):
        larger = points[i + 1:]
        target = min(larger, key=lambda m: (pad_t[m], m)) if larger else None
        if target is not None and pad_t[target] < PAD_GAIN * own_t[n]:
            kernels.append(pad_k[target])
            rows.append(target)
            times.append(pad_t[target])
        else:
            kernels.append(own_k[n])
            rows.append(n)
            times.append(own_t[n])
    padded = any(r != n for r, n in zip(rows, points))
    return KernelPlan(tuple(points), tuple(kernels), tuple(rows) if padded else None), times


def plan_from_seconds(seconds: dict[int, dict[str, float]], credit: float = C_LOOP_CREDIT) -> KernelPlan:
    """The fastest plan (:func:`_fastest_plan`, the panel GEMM credited by ``credit``:
    :func:`c_loop_credit` in use) that keeps at most one prepacked copy of the weights
    (:data:`PREPACKED`): when the fastest uses two, the plan without one of them that loses least
    (sum over counts of its time over the fastest plan's time)."""
    plan, times = _fastest_plan(seconds, credit)
    used = [k for k in PREPACKED if k in plan.kernels]
    if len(used) <= 1:
        return plan
    options = []
    for drop in used:
        kept = {n: {k: t for k, t in ts.items() if k != drop} for n, ts in seconds.items()}
        alt, alt_times = _fastest_plan(kept, credit)
        loss = sum(a / b for a, b in zip(alt_times, times))
        options.append((loss, PREPACKED.index(drop), alt))
    return min(options, key=lambda o: o[:2])[2]


def _measure(calls, inputs, kernels: list[str], points: tuple[int, ...], rounds: int, deadline: float,
             clock=None, timings: Timings | None = None, done: int = 0, now=time.perf_counter,
             evict=None) -> Generator[None, None, Timings]:
    """The timing schedule: ``min(2, rounds)`` interleaved rounds of every kernel (``done`` of them
    already in ``timings``), then the other rounds for the kernels that can still win; pairs with no
    clean sample again; counts slower than a larger count again. ``clock`` None: wall time with
    stall checks; else that (CPU-time) clock. ``deadline`` is on the ``now`` clock."""
    timings = timings if timings is not None else Timings()
    start = now()
    first = min(2, rounds)
    yield from _time_rounds(calls, inputs, {n: list(kernels) for n in points}, first - done, timings, deadline, clock,
                            done, now=now, evict=evict)
    # only kernels that can still win keep being timed (and those only a busy machine has seen)
    seconds = timings.table()
    contenders = {n: [k for k in kernels if seconds[n][k] <= CONTENDER * min(seconds[n].values())
                      or (n, k) not in timings.clean] for n in points}
    yield from _time_rounds(calls, inputs, contenders, rounds - first, timings, deadline, clock, first, now=now,
                            evict=evict)
    # pairs with no clean sample (the machine was busy each time): again, twice, then for as long as
    # the measurement took so far (at most MAX_RETRY_SECONDS), all within the deadline
    retry_until = min(deadline, now() + min(MAX_RETRY_SECONDS, now() - start))
    retry = 0
    while now() < deadline and (retry < 2 or now() < retry_until):
        missing = {n: [k for k in contenders[n] if (n, k) not in timings.clean] for n in points}
        if not any(missing.values()):
            break
        yield from _time_rounds(calls, inputs, missing, 1, timings, deadline, clock, now=now, evict=evict)
        retry += 1
    for _ in range(2):  # counts that look slower than a larger count: measured again, with their neighbours
        suspects = suspect_points(timings.table())
        if not suspects or now() > deadline:
            break
        again = set()
        for n in suspects:
            i = points.index(n)
            again.update(points[max(0, i - 1): i + 2])
        yield from _time_rounds(calls, inputs, {n: contenders[n] for n in sorted(again)}, rounds, timings, deadline,
                                clock, now=now, evict=evict)
    return timings


# What one measurement packs and times. The plan picks one kernel per token count for every linear
# of the forward, so it compares whole forwards' linears; it times a sample of them:
STREAM_BYTES = 128 << 20  # the first blocks whose weights reach this (each block's calls stand for every block's)
EVICT_BYTES = 64 << 20  # a part smaller than this is timed after this many bytes are written: out of the caches
# the prepacked copies a measurement holds at a time: one copy of the model's largest weight, or this
# much where that is smaller (a small model's parts would only cost time)
PACK_FLOOR_BYTES = 64 << 20


def _weight_bytes(call) -> int:
    return call.weight.numel() * call.weight.element_size()


def _shape(call) -> tuple[int, int, bool]:
    return call.out_features, call.in_features, call.bias is not None


def measurement_sample(calls: list) -> list[tuple[Any, float]]:
    """(call, how many of the forward's calls it stands for), in model order.

    Why a sample: timing every kernel at every count over a whole 1B model's linears is minutes of
    CPU. Where the model is a stack of identical blocks (same shapes in the same order, as
    transformers' decoder layers), the first blocks whose weights reach :data:`STREAM_BYTES`
    stand for all of them (weight = blocks / sampled blocks): enough bytes that a pass streams its
    weights from memory, as a forward does, rather than from a cache. Calls outside the blocks (the
    LM head) are timed themselves. Anything else: every call, weight 1."""
    blocks: dict[int, list] = {}
    for c in calls:
        layer = getattr(c, "layer", None)
        if layer is not None:
            blocks.setdefault(layer, []).append(c)
    if len(blocks) < 2 or len({tuple(_shape(c) for c in cs) for cs in blocks.values()}) != 1:
        return [(c, 1.0) for c in calls]
    chosen, size = set(), 0
    for layer, cs in blocks.items():  # in model order
        chosen.add(layer)
        size += sum(_weight_bytes(c) for c in cs)
        if size >= STREAM_BYTES:
            break
    weight = len(blocks) / len(chosen)
    out = []
    for c in calls:
        layer = getattr(c, "layer", None)
        if layer is None:
            out.append((c, 1.0))
        elif layer in chosen:
            out.append((c, weight))
    return out


@dataclass
class _Part:
    """Consecutive calls of the sample packed together, and the kernels timed together over them:
    one phase per group of prepacked kernels whose copies fit the memory bound."""

    calls: list
    weight: float
    phases: list[list[str]]

    @property
    def bytes(self) -> int:
        return sum(_weight_bytes(c) for c in self.calls)


def _parts(sample: list[tuple[Any, float]], kernels: list[str], budget: int) -> list[_Part]:
    """The sample cut into parts whose prepacked copies together stay within ``budget`` bytes (the
    largest weight: one extra copy of it at a time). Parts of one weight are cut evenly, so none is
    a small remainder; a call too large to pack for every prepacked kernel at once gets a phase per
    kernel (the kernels without a copy are timed in the first)."""
    prepacked = [k for k in kernels if k in PREPACKED]
    plain = [k for k in kernels if k not in PREPACKED]
    limit = budget / max(1, len(prepacked))
    runs: list[tuple[float, list]] = []  # consecutive calls of one weight
    for c, w in sample:
        if runs and runs[-1][0] == w:
            runs[-1][1].append(c)
        else:
            runs.append((w, [c]))
    parts = []
    for w, cs in runs:
        pieces = max(1, math.ceil(sum(_weight_bytes(c) for c in cs) / max(1.0, limit)))
        target = sum(_weight_bytes(c) for c in cs) / pieces
        current, size = [], 0
        for c in cs:
            b = _weight_bytes(c)
            if current and size + b > limit:  # never over the limit (but a single call may be)
                parts.append(_Part(current, w, []))
                current, size = [], 0
            current.append(c)
            size += b
            if size >= target:
                parts.append(_Part(current, w, []))
                current, size = [], 0
        if current:
            parts.append(_Part(current, w, []))
    for part in parts:
        if part.bytes * len(prepacked) <= budget or len(prepacked) <= 1:
            part.phases = [list(kernels)]
        else:
            part.phases = [plain + prepacked[:1]] + [[k] for k in prepacked[1:]]
    return parts


def _measurement(calls: list, points: tuple[int, ...], rounds: int,
                 clock: _WorkClock) -> Generator[None, None, tuple[KernelPlan, dict[int, dict[str, float]], dict]]:
    """:func:`measure_plan` as a generator that yields after every sample and every packed weight
    group; its deadline runs on ``clock`` (work time)."""
    kernels = available_kernels()
    sample = measurement_sample(calls)
    budget = max(PACK_FLOOR_BYTES, max(_weight_bytes(c) for c in calls))
    parts = _parts(sample, kernels, budget)
    work = [(part, phase) for part in parts for phase in part.phases]
    shares = [part.bytes * len(phase) for part, phase in work]
    widths = sorted({c.in_features for c, _ in sample})
    now = clock.now
    seconds_total: dict[tuple[int, str], float] = {}
    variants_total: dict[tuple[int, tuple[bool, bool]], float] = {}
    samples = disturbed = 0
    proxy: bool | None = None
    evict_buffer: torch.Tensor | None = None
    with torch.inference_mode():
        inputs = {n: {w: torch.randn(n, w) for w in widths} for n in points}
        for (part, phase), share in zip(work, shares):
            evict = None
            if part.bytes < EVICT_BYTES:
                if evict_buffer is None:
                    evict_buffer = torch.empty(EVICT_BYTES // 4)
                evict = functools.partial(evict_buffer.fill_, 0.0)
            packed = [k for k in phase if k in PREPACKED]
            try:
                for k in packed:
                    for c in part.calls:
                        _pack([c], k)
                        yield
                deadline = now() + MEASURE_SECONDS * share / sum(shares)
                shapes = list({_shape(c): c for c in part.calls}.values())
                for n in points:  # warm-up: one call per distinct shape (first touches, oneDNN primitive creation)
                    for k in phase:
                        _time_pass(shapes, inputs[n], k)
                        yield
                timings = None
                if proxy is None:  # decided once, on the first part: is the machine too busy for wall time?
                    busy = _cpu_busy()
                    if busy is None or busy < BUSY_SHARE:
                        probe = Timings()  # the first round in wall time, given up once most samples are disturbed
                        yield from _time_rounds(part.calls, inputs, {n: list(phase) for n in points}, 1, probe,
                                                deadline, stop=lambda t: t.samples >= 8 and t.disturbed > BUSY_SHARE
                                                * t.samples, now=now, evict=evict)
                        if probe.disturbed <= BUSY_SHARE * probe.samples:
                            timings = yield from _measure(part.calls, inputs, phase, points, rounds, deadline,
                                                          timings=probe, done=1, now=now, evict=evict)
                    proxy = timings is None
                cpu_clock = time.thread_time if proxy else None
                if timings is None:
                    timings = yield from _measure(part.calls, inputs, phase, points, rounds, deadline, cpu_clock,
                                                  now=now, evict=evict)
                samples += timings.samples
                disturbed += timings.disturbed
                for key, t in timings.best.items():
                    seconds_total[key] = seconds_total.get(key, 0.0) + part.weight * t
                if "panel" in phase:
                    best = yield from _panel_variant_times(part.calls, inputs, points, rounds, cpu_clock, deadline,
                                                           now, evict)
                    for (n, v), t in best.items():
                        if v == PANEL_DEFAULT:  # the plan's own rounds timed the defaults too
                            t = min(t, timings.best.get((n, "panel"), float("inf")))
                        variants_total[n, v] = variants_total.get((n, v), 0.0) + part.weight * t
            finally:
                for k in packed:
                    _unpack(part.calls, k)  # one part's copies at a time
    seconds: dict[int, dict[str, float]] = {}
    for (n, k), t in sorted(seconds_total.items()):
        seconds.setdefault(n, {})[k] = t
    settings = _choose_panel_settings(variants_total, seconds, points) if "panel" in kernels else {}
    plan = dataclasses.replace(plan_from_seconds(seconds, c_loop_credit()), **settings)
    info = {"samples": samples, "disturbed": disturbed, "seconds_spent": round(now(), 3),
            "clock": "one thread, thread CPU time (busy machine)" if proxy else "wall",
            "provisional": bool(proxy) or disturbed > BUSY_SHARE * samples,
            "parts": len(parts), "sampled_calls": len(sample), "calls": len(calls)}
    if proxy:
        logger.info("kernel timing: the CPUs are busy; kernels ranked on one thread by CPU time (provisional plan)")
    elif disturbed:
        logger.info("kernel timing: %d of %d samples ran while the CPUs were contended", disturbed, samples)
    return plan, seconds, info


def measure_plan(calls: list, points: tuple[int, ...] = POINTS,
                 rounds: int = ROUNDS) -> tuple[KernelPlan, dict[int, dict[str, float]], dict]:
    """Time every kernel at every count over ``calls`` (a forward's linears) and build the plan.
    Returns the plan, the seconds per count and kernel (the fastest sample; of a whole forward's
    linears, estimated from :func:`measurement_sample`) and how the samples went.

    Bounded in memory: the prepacked kernels' copies are made for one part of the sample at a
    time, together at most one copy of the model's largest weight (:func:`_parts`); and in time:
    :data:`MEASURE_SECONDS` of measuring, after which every pair not yet timed is timed once.

    On a busy machine (CPU pressure before starting, or most first-round samples disturbed), wall
    time of a multi-threaded kernel mostly measures the scheduler (an OpenMP team waits for its
    descheduled members at every barrier). The kernels are then ranked on one thread by that
    thread's CPU time instead, which descheduling does not inflate: a proxy for the real thread
    count, so the plan is provisional (measured again at a quiet start)."""
    steps = _measurement(calls, points, rounds, _WorkClock(running=True))
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def _panel_variants(n: int) -> list[tuple[bool, bool]]:
    """The panel GEMM's settings (wide_narrow, prefetch_l2) worth timing at ``n`` rows."""
    variants = [PANEL_DEFAULT, (True, True)]
    if n == WIDE_NARROW_POINT:
        variants += [(False, False), (False, True)]
    return variants


def _panel_variant_times(calls, inputs, points: tuple[int, ...], rounds: int, clock=None,
                         deadline: float = float("inf"), now=time.perf_counter,
                         evict=None) -> Generator[None, None, dict[tuple[int, tuple[bool, bool]], float]]:
    """The fastest sample of each panel GEMM setting (:func:`_panel_variants`) at every count up to
    :data:`panel_gemm.PREFETCH_L2_MAX_ROWS`, in interleaved rounds (after ``deadline``, no round past
    the first). The library is put back on its defaults after every sample: between samples the
    engine may run steps."""
    counts = [n for n in points if n <= panel_gemm.PREFETCH_L2_MAX_ROWS]
    best: dict[tuple[int, tuple[bool, bool]], float] = {}
    for r in range(rounds):
        if r > 0 and now() > deadline:
            break
        for n in (counts if r % 2 == 0 else counts[::-1]):
            variants = _panel_variants(n)
            for i in range(len(variants)):
                wide_narrow, l2 = variants[(i + r) % len(variants)]
                if evict is not None:
                    evict()
                try:
                    panel_gemm.set_wide_narrow(wide_narrow)
                    panel_gemm.set_prefetch_l2((n,) if l2 else ())
                    with _one_thread() if clock is not None else contextlib.nullcontext():
                        seconds = _time_pass(calls, inputs[n], "panel", clock or time.perf_counter)
                finally:
                    panel_gemm.set_wide_narrow(PANEL_DEFAULT[0])
                    panel_gemm.set_prefetch_l2(())
                best[n, (wide_narrow, l2)] = min(best.get((n, (wide_narrow, l2)), float("inf")), seconds)
                yield
    return best


def _choose_panel_settings(variants: dict[tuple[int, tuple[bool, bool]], float],
                           seconds: dict[int, dict[str, float]], points: tuple[int, ...]) -> dict:
    """The panel GEMM's settings for the plan from each setting's time (:func:`_panel_variant_times`,
    summed over the sample's parts): at every count up to its :data:`panel_gemm.PREFETCH_L2_MAX_ROWS`,
    its prefetch into L1 or L2, and at :data:`WIDE_NARROW_POINT` also its row blocks for 13-16 rows;
    per count the fastest is kept and its time becomes the panel GEMM's in ``seconds``. Returns
    them as :class:`KernelPlan` fields. Why measured: blocks of 4 rows over 6 panels ran 16 rows
    2.4% faster on a CPU with two 512-bit multiply-adds per cycle per core, blocks of 8 over 3
    panels 11% faster on a Zen 4 with one; on that Zen 4 a prefetch into L2 ran 1-12 rows 4-16%
    faster and 24-48 rows up to 8% slower."""
    wide_narrow, prefetch_l2 = PANEL_DEFAULT[0], []
    for n in points:
        if (n, PANEL_DEFAULT) not in variants:
            prefetch_l2.append(False)
            continue
        chosen = min(_panel_variants(n), key=lambda v: (variants.get((n, v), float("inf")), v != PANEL_DEFAULT))
        seconds[n]["panel"] = variants[n, chosen]
        prefetch_l2.append(chosen[1])
        if n == WIDE_NARROW_POINT:
            wide_narrow = chosen[0]
    return {"panel_wide_narrow": wide_narrow, "panel_prefetch_l2": tuple(prefetch_l2)}


def plan_key(calls: list) -> str:
    shapes = sorted({(m.out_features, m.in_features, m.bias is not None) for m in calls})
    raw = (f"v{PLAN_VERSION}|{shapes}|{len(calls)}|{platform.machine()}|{platform.processor()}"
           f"|threads{torch.get_num_threads()}|{torch.__version__}|{available_kernels()}"
           f"|panel-{panel_gemm.KERNEL.digest}"  # a plan timed with another panel GEMM is measured again
           f"|credit{c_loop_credit()}")  # a plan chosen with the C loop's credit is not reused where the loop is off
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def _cpu_busy() -> float | None:
    """Share of the last 10 s during which tasks waited for a CPU (pressure stall), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("avg10=", 1)[1].split()[0]) / 100
    except (OSError, ValueError, IndexError):
        return None


def _parse_plan(data: dict) -> tuple[KernelPlan, bool]:
    """A cached plan and whether it is provisional (measured on a busy machine); refused (measured
    again) unless it is the plan its own recorded seconds give."""
    if data.get("version") != PLAN_VERSION:
        raise ValueError(f"plan version {data.get('version')} is not {PLAN_VERSION}")
    rows = data.get("rows")
    l2 = data["panel_prefetch_l2"]
    plan = KernelPlan(tuple(data["points"]), tuple(data["kernels"]), tuple(rows) if rows is not None else None,
                      bool(data["panel_wide_narrow"]), tuple(bool(x) for x in l2) if l2 is not None else None)
    seconds = {int(n): {k: float(t) for k, t in ts.items()} for n, ts in data["seconds"].items()}
    derived = dataclasses.replace(plan_from_seconds(seconds, c_loop_credit()), panel_wide_narrow=plan.panel_wide_narrow,
                                  panel_prefetch_l2=plan.panel_prefetch_l2)
    if sorted(seconds) != list(plan.points) or derived != plan:
        raise ValueError("the plan does not follow from its recorded timings")
    return plan, bool(data.get("measurement", {}).get("provisional", False))


def _cached_plan(path) -> KernelPlan | None:
    """The plan cached at ``path``; None when absent, unreadable, or provisional while the machine
    is quiet now (a plan measured on a busy machine is measured again at a quiet start)."""
    from tr_serve.disk_cache import load_json

    loaded = load_json(path, _parse_plan, "kernel plan")
    if loaded is None:
        return None
    plan, provisional = loaded
    busy = _cpu_busy()
    if provisional and busy is not None and busy < QUIET_SHARE:
        logger.info("the cached kernel plan was measured on a busy machine: measuring again")
        return None
    return plan


def _save_plan(path, plan: KernelPlan, seconds: dict[int, dict[str, float]], info: dict) -> None:
    from tr_serve.disk_cache import save_json

    save_json(path, {"version": PLAN_VERSION, "points": plan.points, "kernels": plan.kernels,
                     "rows": plan.rows, "panel_wide_narrow": plan.panel_wide_narrow,
                     "panel_prefetch_l2": plan.panel_prefetch_l2,
                     "seconds": {str(n): t for n, t in seconds.items()},
                     "measurement": info}, "kernel plan")


def _pack_plan(calls: list, plan: KernelPlan) -> None:
    for k in PREPACKED:
        if k in plan.kernels:
            _pack(calls, k)


class PlanMeasurement:
    """A model's kernel plan measured after the replica is ready (runner/startup_work.py): the
    measurement of :func:`measure_plan` in slices of about the time :meth:`advance` is given, then
    the chosen kernel's copy of the weights packed one weight group per pause, then the plan cached
    and installed in the runner that runs ``model`` (its forwards used torch's kernels until then).
    Its time budget counts only the slices (:class:`_WorkClock`)."""

    name = "kernel plan"
    order = 0  # first: everything else runs faster on it

    def __init__(self, model: nn.Module, calls: list, path):
        self.model, self.calls, self.path = model, calls, path
        self.clock = _WorkClock()
        self.plan: KernelPlan | None = None
        self._steps = self._run()

    def _run(self) -> Generator[None, None, KernelPlan]:
        logger.info("measuring CPU linear kernels after start-up, between steps (cached in %s)", self.path)
        plan, seconds, info = yield from _measurement(self.calls, POINTS, ROUNDS, self.clock)
        for k in PREPACKED:
            if k in plan.kernels:
                for c in self.calls:
                    _pack([c], k)
                    yield
        _save_plan(self.path, plan, seconds, info)
        return plan

    def advance(self, seconds: float, runner: Any = None, matrix: Any = None) -> bool:
        if self.plan is not None:
            return True
        end = time.perf_counter() + seconds
        self.clock.resume()
        try:
            while True:
                next(self._steps)
                if time.perf_counter() >= end:
                    return False
        except StopIteration as stop:
            self.plan = stop.value
        finally:
            self.clock.pause()
        self.model._tr_kernel_plan = self.plan
        self.model._tr_plan_measurement = None
        if runner is not None and getattr(runner, "model", None) is self.model:
            runner.kernel_plan = self.plan  # between two steps: the next forward runs on it
        logger.info("kernel plan measured in %.1f s of slices: %s", self.clock.now(), self.plan)
        return True


def select_plan(model: nn.Module) -> KernelPlan | None:
    """The kernel plan for ``model`` on this CPU: loaded from the cache or measured (several seconds
    for SmolLM2-135M). None when the model has no fp32 CPU linears.

    Inside :func:`tr_serve.runner.startup_work.deferring` (a replica starting): a cached plan at
    once; otherwise None (torch's kernels, nothing packed) and a :class:`PlanMeasurement` that
    measures it after the replica is ready."""
    from tr_serve.disk_cache import load_or_make
    from tr_serve.model_loader import cache_root
    from tr_serve.runner import startup_work

    cached = getattr(model, "_tr_kernel_plan", None)
    if cached is not None:
        return cached
    if not kernel_linears(model):
        return None
    fuse_siblings(model)
    calls = kernel_calls(model)
    path = cache_root() / "kernels" / f"{plan_key(calls)}.json"

    work = startup_work.current()
    if work is not None:
        plan = _cached_plan(path)
        if plan is None:
            if getattr(model, "_tr_plan_measurement", None) is None:
                model._tr_plan_measurement = PlanMeasurement(model, calls, path)
                work.add(model._tr_plan_measurement)
            return None
        _pack_plan(calls, plan)
        model._tr_kernel_plan = plan
        return plan

    def measure() -> KernelPlan:
        logger.info("measuring CPU linear kernels (cached in %s)", path)
        plan, seconds, info = measure_plan(calls)
        _save_plan(path, plan, seconds, info)
        _pack_plan(calls, plan)
        return plan

    # one process measures a plan while any other about to measure the same one (the ranks of a
    # tensor-parallel replica, parallel test workers) waits for it, then reads it
    plan, measured = load_or_make(path, lambda: _cached_plan(path), measure)
    if not measured:
        _pack_plan(calls, plan)
    model._tr_kernel_plan = plan
    return plan
