"""How the kernel plan's measurement times a kernel on a machine other processes may share.

Why: one noisy moment at start-up must not be cached forever as a plan. Timing is interleaved
over kernels and counts and repeated (min of N); a pair whose every sample ran while other
processes held the CPUs (Linux pressure stall information) is timed again, and counts whose best
time is far above a larger count's are measured again (:func:`time_schedule`). On a busy machine
the samples can be taken on one thread by its CPU time instead (:func:`one_thread`), and a
deferred measurement counts only the time of its own slices (:class:`WorkClock`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Generator, Iterator

import torch

from tr_serve.kernels.cpu_kernels import run_kernel

CONTENDER = 1.5  # after two rounds, kernels slower than this times the best at a count stop being timed there
RECHECK = 1.10  # a count whose best time exceeds a larger count's by this factor is measured again
STALL_LIMIT = 0.25  # a sample during which tasks waited for a CPU over 25% of its time was disturbed
MAX_RETRY_SECONDS = 30.0  # time spent re-timing pairs that only had disturbed samples, at most


def time_pass(calls: list, inputs: dict[int, torch.Tensor], kernel: str, clock=time.perf_counter) -> float:
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


def time_rounds(calls, inputs, kernels_at: dict[int, list[str]], rounds: int, timings: Timings,
                 deadline: float = float("inf"), clock=None, first_round: int = 0, stop=None,
                 now=time.perf_counter, evict=None) -> Iterator[None]:
    """``rounds`` interleaved rounds: every (count, kernel) once per round, kernels in a rotating
    order and counts alternately ascending and descending, so a slow moment of the machine lands on
    different pairs in different rounds. After ``deadline`` (on the ``now`` clock) only pairs never
    timed are timed; ``stop(timings)`` True after a sample ends the rounds. ``evict()``, when given,
    runs before each sample, untimed. A generator: it yields after every sample, so a deferred
    measurement can pause there (:class:`.kernel_autotune.PlanMeasurement`)."""
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
                    with one_thread():
                        timings.add(n, k, time_pass(calls, inputs[n], k, clock), False)
                    yield
                    continue
                before = _cpu_stall()
                seconds = time_pass(calls, inputs[n], k)
                after = _cpu_stall()
                disturbed = before is not None and after is not None and after - before > STALL_LIMIT * seconds
                timings.add(n, k, seconds, disturbed)
                yield
                if stop is not None and stop(timings):
                    return


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread for one sample of a busy machine's proxy measurement (thread CPU time),
    then the thread count as it was: between samples the engine may run steps on all of them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class WorkClock:
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



def cpu_busy() -> float | None:
    """Share of the last 10 s during which tasks waited for a CPU (pressure stall), or None."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("avg10=", 1)[1].split()[0]) / 100
    except (OSError, ValueError, IndexError):
        return None

def time_schedule(calls, inputs, kernels: list[str], points: tuple[int, ...], rounds: int, deadline: float,
             clock=None, timings: Timings | None = None, done: int = 0, now=time.perf_counter,
             evict=None) -> Generator[None, None, Timings]:
    """The timing schedule: ``min(2, rounds)`` interleaved rounds of every kernel (``done`` of them
    already in ``timings``), then the other rounds for the kernels that can still win; pairs with no
    clean sample again; counts slower than a larger count again. ``clock`` None: wall time with
    stall checks; else that (CPU-time) clock. ``deadline`` is on the ``now`` clock."""
    timings = timings if timings is not None else Timings()
    start = now()
    first = min(2, rounds)
    yield from time_rounds(calls, inputs, {n: list(kernels) for n in points}, first - done, timings, deadline, clock,
                            done, now=now, evict=evict)
    # only kernels that can still win keep being timed (and those only a busy machine has seen)
    seconds = timings.table()
    contenders = {n: [k for k in kernels if seconds[n][k] <= CONTENDER * min(seconds[n].values())
                      or (n, k) not in timings.clean] for n in points}
    yield from time_rounds(calls, inputs, contenders, rounds - first, timings, deadline, clock, first, now=now,
                            evict=evict)
    # pairs with no clean sample (the machine was busy each time): again, twice, then for as long as
    # the measurement took so far (at most MAX_RETRY_SECONDS), all within the deadline
    retry_until = min(deadline, now() + min(MAX_RETRY_SECONDS, now() - start))
    retry = 0
    while now() < deadline and (retry < 2 or now() < retry_until):
        missing = {n: [k for k in contenders[n] if (n, k) not in timings.clean] for n in points}
        if not any(missing.values()):
            break
        yield from time_rounds(calls, inputs, missing, 1, timings, deadline, clock, now=now, evict=evict)
        retry += 1
    for _ in range(2):  # counts that look slower than a larger count: measured again, with their neighbours
        suspects = suspect_points(timings.table())
        if not suspects or now() > deadline:
            break
        again = set()
        for n in suspects:
            i = points.index(n)
            again.update(points[max(0, i - 1): i + 2])
        yield from time_rounds(calls, inputs, {n: contenders[n] for n in sorted(again)}, rounds, timings, deadline,
                                clock, now=now, evict=evict)
    return timings
