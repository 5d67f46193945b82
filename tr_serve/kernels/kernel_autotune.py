"""The kernel plan: which of :mod:`tr_serve.kernels.cpu_kernels`' kernels serves each token count,
measured on the model's own linear calls on this CPU.

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
code is never reused (:data:`PLAN_VERSION` is in the cache key). How a kernel is timed on a shared
machine: :mod:`tr_serve.kernels.kernel_timing`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import platform
import time
from typing import Any, Generator

import torch
from torch import nn

from tr_serve.kernels import cpu_kernels, kernel_sample, kernel_timing, layer_driver, panel_gemm, tree_attention
from tr_serve.kernels.cpu_kernels import PREPACKED, KernelPlan, fuse_siblings, kernel_calls, kernel_linears
from tr_serve.kernels.kernel_timing import Timings, WorkClock, one_thread, time_rounds, time_schedule

logger = logging.getLogger(__name__)

# token counts measured; above the last: torch. 256 and 512 are prefill chunks (a step's
# max_num_batched_tokens set that high): measured here through the runner, whole prefill forwards of 150-512
# prompt tokens (one to four prompts) took 1.01-1.22x as long with torch's linear as with the panel GEMM
POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# part of the cache key: bump it whenever a kernel or the plan's rules change what a plan would pick,
# so plans measured by older code are measured again (what each change was: git log of this line)
PLAN_VERSION = 14
ROUNDS = 5  # interleaved timing rounds per (count, kernel); the minimum is kept
PAD_GAIN = 0.95  # pad a count up to a larger measured one only when that is at least 5% faster
# The panel GEMM's times at the token counts the decoder layers' C loop takes (kernels/layer_driver.py:
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
MEASURE_SECONDS = 90.0  # a measurement stops adding rounds after this long (a busy machine slows every pass)
BUSY_SHARE = 0.5  # a plan with more disturbed samples is provisional: measured again at a quiet start
QUIET_SHARE = 0.05  # quiet: tasks waited for a CPU less than 5% of the last 10 s


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


def _measurement(calls: list, points: tuple[int, ...], rounds: int,
                 clock: WorkClock) -> Generator[None, None, tuple[KernelPlan, dict[int, dict[str, float]], dict]]:
    """:func:`measure_plan` as a generator that yields after every sample and every packed weight
    group; its deadline runs on ``clock`` (work time)."""
    kernels = cpu_kernels.available_kernels()
    sample = kernel_sample.measurement_sample(calls)
    budget = max(kernel_sample.PACK_FLOOR_BYTES, max(kernel_sample.weight_bytes(c) for c in calls))
    parts = kernel_sample.memory_parts(sample, kernels, budget)
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
            if part.bytes < kernel_sample.EVICT_BYTES:
                if evict_buffer is None:
                    evict_buffer = torch.empty(kernel_sample.EVICT_BYTES // 4)
                evict = functools.partial(evict_buffer.fill_, 0.0)
            packed = [k for k in phase if k in PREPACKED]
            try:
                for k in packed:
                    for c in part.calls:
                        cpu_kernels.pack([c], k)
                        yield
                deadline = now() + MEASURE_SECONDS * share / sum(shares)
                shapes = list({kernel_sample.call_shape(c): c for c in part.calls}.values())
                for n in points:  # warm-up: one call per distinct shape (first touches, oneDNN primitive creation)
                    for k in phase:
                        kernel_timing.time_pass(shapes, inputs[n], k)
                        yield
                timings = None
                if proxy is None:  # decided once, on the first part: is the machine too busy for wall time?
                    busy = kernel_timing.cpu_busy()
                    if busy is None or busy < BUSY_SHARE:
                        probe = Timings()  # the first round in wall time, given up once most samples are disturbed
                        yield from time_rounds(part.calls, inputs, {n: list(phase) for n in points}, 1, probe,
                                                deadline, stop=lambda t: t.samples >= 8 and t.disturbed > BUSY_SHARE
                                                * t.samples, now=now, evict=evict)
                        if probe.disturbed <= BUSY_SHARE * probe.samples:
                            timings = yield from time_schedule(part.calls, inputs, phase, points, rounds, deadline,
                                                          timings=probe, done=1, now=now, evict=evict)
                    proxy = timings is None
                cpu_clock = time.thread_time if proxy else None
                if timings is None:
                    timings = yield from time_schedule(part.calls, inputs, phase, points, rounds, deadline, cpu_clock,
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
                    cpu_kernels.unpack(part.calls, k)  # one part's copies at a time
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
    linears, estimated from :func:`.kernel_sample.measurement_sample`) and how the samples went.

    Bounded in memory: the prepacked kernels' copies are made for one part of the sample at a
    time, together at most one copy of the model's largest weight
    (:func:`.kernel_sample.memory_parts`); and in time: :data:`MEASURE_SECONDS` of measuring, after
    which every pair not yet timed is timed once.

    On a busy machine (CPU pressure before starting, or most first-round samples disturbed), wall
    time of a multi-threaded kernel mostly measures the scheduler (an OpenMP team waits for its
    descheduled members at every barrier). The kernels are then ranked on one thread by that
    thread's CPU time instead, which descheduling does not inflate: a proxy for the real thread
    count, so the plan is provisional (measured again at a quiet start)."""
    steps = _measurement(calls, points, rounds, WorkClock(running=True))
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
                    with one_thread() if clock is not None else contextlib.nullcontext():
                        seconds = kernel_timing.time_pass(calls, inputs[n], "panel", clock or time.perf_counter)
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
           f"|threads{torch.get_num_threads()}|{torch.__version__}|{cpu_kernels.available_kernels()}"
           f"|panel-{panel_gemm.KERNEL.digest}"  # a plan timed with another panel GEMM is measured again
           f"|credit{c_loop_credit()}")  # a plan chosen with the C loop's credit is not reused where the loop is off
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


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
    busy = kernel_timing.cpu_busy()
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
            cpu_kernels.pack(calls, k)


class PlanMeasurement:
    """A model's kernel plan measured after the replica is ready (runner/startup_work.py): the
    measurement of :func:`measure_plan` in slices of about the time :meth:`advance` is given, then
    the chosen kernel's copy of the weights packed one weight group per pause, then the plan cached
    and installed in the runner that runs ``model`` (its forwards used torch's kernels until then).
    Its time budget counts only the slices (:class:`WorkClock`)."""

    name = "kernel plan"
    order = 0  # first: everything else runs faster on it

    def __init__(self, model: nn.Module, calls: list, path):
        self.model, self.calls, self.path = model, calls, path
        self.clock = WorkClock()
        self.plan: KernelPlan | None = None
        self._steps = self._run()

    def _run(self) -> Generator[None, None, KernelPlan]:
        logger.info("measuring CPU linear kernels after start-up, between steps (cached in %s)", self.path)
        plan, seconds, info = yield from _measurement(self.calls, POINTS, ROUNDS, self.clock)
        for k in PREPACKED:
            if k in plan.kernels:
                for c in self.calls:
                    cpu_kernels.pack([c], k)
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
