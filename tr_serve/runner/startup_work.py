"""Start-up work that runs after the replica is ready, in slices between engine steps.

Why: a replica answers once its weights are loaded and it can run a forward. What only makes it
faster or draft better, the kernel plan's measurement (kernels/kernel_autotune.py) and the matrix prior
(runner/matrix_prior.py), took minutes for a 1B model on a 2-core CPU, during which every request
got 503. With a :class:`StartupWork` collecting (:func:`deferring`), those two take what is cached
at once and otherwise register a job here and return at once (torch's kernels, an empty prior);
the server then calls :meth:`StartupWork.advance` on the engine's step thread, between steps, so a
job never runs beside a forward and installs its result (the runner's plan, the matrix's empty
rows) at a step boundary. A missing latency table is a provisional one at once, the full one
measured while the engine is idle (runner/calibration.py), given up the moment a request or a
shutdown comes (and retried at the next idle moment), and cached for the next start. Outside a
collection (``LLM``, the benches, tests) everything is computed before the engine exists, as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from typing import Any, Callable, Iterator, Protocol

logger = logging.getLogger(__name__)


class StartupJob(Protocol):
    """One piece of deferred start-up work, advanced in slices. Optional attributes: ``order``
    (lower runs first, default 0) and ``idle_only`` (True: a job whose work cannot be cut into
    slices, advanced only while the engine has no request; its ``advance`` takes a fourth argument,
    ``interrupted()``, which it polls between forwards to give up at once, so neither a new request
    nor a shutdown waits for it)."""

    name: str

    def advance(self, seconds: float, runner: Any, matrix: Any) -> bool:
        """Work for about ``seconds`` (one sample may run over); install what is done into
        ``runner`` / ``matrix`` (either may be None); True once the job has finished."""


class StartupWork:
    """The deferred jobs of one engine, run in the order they were registered."""

    def __init__(self) -> None:
        self.jobs: list[StartupJob] = []
        self.done: list[str] = []
        self.failed: list[str] = []
        self.seconds = 0.0  # spent in advance(), all jobs together

    def add(self, job: StartupJob) -> None:
        self.jobs.append(job)
        self.jobs.sort(key=lambda j: getattr(j, "order", 0))  # stable: registration order within an order

    def extend(self, other: "StartupWork") -> None:
        self.jobs.extend(other.jobs)

    @property
    def pending(self) -> list[str]:
        return [job.name for job in self.jobs]

    def advance(self, seconds: float, runner: Any = None, matrix: Any = None, idle: bool = False,
                interrupted: Callable[[], bool] = lambda: False) -> bool:
        """Run the jobs for about ``seconds``; True once none is left. ``idle``: the engine has no
        request, none admitted nor waiting (only then do ``idle_only`` jobs run, polling
        ``interrupted``: true once a request or a shutdown waits). A job that raises is dropped
        (logged): the engine goes on with what it has, torch's kernels or a partial prior."""
        start = time.perf_counter()
        end = start + seconds
        try:
            while True:
                ready = [j for j in self.jobs if idle or not getattr(j, "idle_only", False)]
                if not ready:
                    break
                job = ready[0]
                try:
                    left = max(0.0, end - time.perf_counter())
                    advance: Any = job.advance  # an idle_only job's advance also takes the interruption check
                    finished = (advance(left, runner, matrix, interrupted) if getattr(job, "idle_only", False)
                                else advance(left, runner, matrix))
                except Exception:
                    logger.exception("start-up work %r failed; serving goes on without it", job.name)
                    self.jobs.remove(job)
                    self.failed.append(job.name)
                    continue
                if finished:
                    self.jobs.remove(job)
                    self.done.append(job.name)
                    logger.info("start-up work %r done", job.name)
                if time.perf_counter() >= end or (not finished and interrupted()):
                    break
        finally:
            self.seconds += time.perf_counter() - start
        return not self.jobs

    def status(self) -> dict[str, Any]:
        return {"pending": self.pending, "done": list(self.done), "failed": list(self.failed),
                "seconds": round(self.seconds, 1)}


_current: contextvars.ContextVar[StartupWork | None] = contextvars.ContextVar("tr_serve_startup_work", default=None)


@contextlib.contextmanager
def deferring(work: StartupWork | None = None) -> Iterator[StartupWork]:
    """Collect the start-up work of the engines built in this block (this thread and the threads
    ``asyncio.to_thread`` starts from it: a context variable) into ``work`` instead of doing it."""
    work = work if work is not None else StartupWork()
    token = _current.set(work)
    try:
        yield work
    finally:
        _current.reset(token)


def current() -> StartupWork | None:
    """The collection in effect here, or None: do the work now."""
    return _current.get()
