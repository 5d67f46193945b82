"""Measure forward latency by query-token count on the actual device, cached per model and device."""

from __future__ import annotations

import hashlib
import logging
import platform
import statistics
import time
from typing import Callable

import torch

from tr_serve.disk_cache import load_json, load_or_make, save_json
from tr_serve.model_loader import cache_root
from tr_serve.kernels import layer_driver, layer_ops, panel_gemm, tree_attention
from tr_serve.runner.decoder_runner import DecoderRunner
from tr_serve.runner.step_io import StepRunner, StepSampling
from tr_serve.tr.step_latency import LatencyTable

logger = logging.getLogger(__name__)

# 17 and 20: past 16 rows the panel GEMM starts another block of rows over each block of weights,
# which costs a step, not a slope; interpolating 16 -> 24 hid it, so a 13-row step bought drafts
# below their price (docs/token-recycling.md, "Decisions")
# 5-10: the panel GEMM changes how many panels and rows it takes at once at 7, 9 and 10 rows
# (docs/kernels.md), steps that interpolation from 6, 8 and 12 would misprice
POINTS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 17, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 648)


def device_name(device: torch.device) -> str:
    """What the latency table is keyed by: the accelerator's name, or the CPU and its torch threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()}-{platform.processor() or 'cpu'}-threads{torch.get_num_threads()}"


def calibration_key(model_id: str, runner: StepRunner, recycle_k: int = 0) -> str:
    attention = "tree-attention" if getattr(runner, "tree_attention", False) else "sdpa"  # the kernels timed
    if isinstance(runner, DecoderRunner):
        attention = runner.name
    if getattr(runner, "layer_ops", False):
        attention += "+layer-ops"
    kernels = "-".join(k.digest for k in (panel_gemm.KERNEL, tree_attention.KERNEL, layer_ops.KERNEL,
                                          layer_driver.KERNEL))
    if layer_driver.KERNEL.get() is None:
        kernels += "-no-driver"  # the layers' Python loop: a one-token forward here about 1.7x as long
    # the widths the tree attention (and so the C loop) takes: which path a one-row step of 17-64 tokens timed
    attention += f"-widths{tree_attention.MAX_WIDTH}-{tree_attention.MAX_WIDTH_ROWS}-{tree_attention.MAX_WIDTH_C_LOOP}"
    # a table measured at other counts, otherwise or with other compiled kernels is measured again
    # where the forward runs: the workers' device and world size under tensor parallelism
    where = getattr(runner, "device_name", None) or device_name(runner.device)
    raw = (f"{model_id}|{where}|{runner.dtype}|{torch.__version__}|{runner.kernel_plan}|"
           f"{attention}|{kernels}|{POINTS}|median|verify_step-k{recycle_k}|rows{ROW_COUNTS}x{ROW_WIDTHS}")
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


# several rows at once: the row counts (at most the runner's) and tokens per row measured beside the
# one-row table; on a GPU a step of many short rows costs its rows' attention, which one row cannot show
ROW_COUNTS = (8, 32)
ROW_WIDTHS = (1, 4, 16)


class CalibrationInterrupted(Exception):
    """:func:`measure` gave up between two forwards (its rows left empty): a request or a shutdown came."""


def measure(runner: StepRunner, max_tokens: int, context: int = 256, repeats: int = 5,
            recycle_k: int = 0, row_counts: tuple[int, ...] = ROW_COUNTS,
            interrupted: Callable[[], bool] = lambda: False) -> LatencyTable:
    """Latency of one verify step of ``q`` tokens on row 0 over a ``context``-token prefix, as the
    engine calls it (``verify_step``: the forward, the reduction to ids with ``recycle_k`` top-k
    ids per node, and their way to the host; under tensor parallelism the round trip): the median
    over ``repeats`` interleaved rounds (every count once per round, the order reversed every other
    round, so a busy moment of the machine lands on different counts), counts above 128 once; the
    row is left empty afterwards.

    Why the median, not the minimum: the budget prices drafts by the table's slope, and serving
    runs at the machine's typical speed. Measured here (2 threads, context 300), the minimum of 3
    put 24 tokens at 50 ms and 4-12 tokens all at 35 ms; the median forward took 62-66 ms for 24
    tokens and 33 / 36 / 40 ms for 4 / 8 / 12 tokens over 4 rows, so the budget bought drafts at
    16 rows for half their price (a static batch of 16: 5% fewer steps for 9% more forward time).

    ``interrupted`` is polled before every forward: once true, the rows are freed and
    :class:`CalibrationInterrupted` raised, so a measurement after ready never holds up a request."""
    try:
        return _measure(runner, max_tokens, context, repeats, recycle_k, row_counts, interrupted)
    except CalibrationInterrupted:
        for r in range(min(runner.num_rows, max((1, *row_counts)))):
            runner.free(r)
        raise


def _give_up_if(interrupted: Callable[[], bool]) -> None:
    if interrupted():
        raise CalibrationInterrupted


def _measure(runner: StepRunner, max_tokens: int, context: int, repeats: int, recycle_k: int,
             row_counts: tuple[int, ...], interrupted: Callable[[], bool]) -> LatencyTable:
    row = torch.tensor([0])
    context = max(1, min(context, runner.max_len - max_tokens - 1))
    points = [q for q in POINTS if q <= max_tokens and context + q <= runner.max_len] or [1]
    runner.free(0)
    high = min(1000, runner.vocab_size)  # any valid ids: latency does not depend on them
    greedy = StepSampling((None,), recycle_k)
    runner.prefill_step(row, [[10 + i % (high - 10) for i in range(context)]], greedy)
    inputs = {q: (torch.randint(10, high, (1, q)), torch.arange(q), torch.ones(q, q, dtype=torch.bool).tril(), None,
                  greedy) for q in points}
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    timed: dict[int, list[float]] = {q: [] for q in points}
    for q in points:
        _give_up_if(interrupted)
        runner.verify_step(row, *inputs[q])  # warm-up for this shape
    for r in range(repeats):
        for q in (points if r % 2 == 0 else points[::-1]):
            if r > 0 and q > 128:
                continue
            _give_up_if(interrupted)
            sync()
            t0 = time.perf_counter()
            runner.verify_step(row, *inputs[q])  # ends with the copy of its ids to the host
            sync()
            timed[q].append(time.perf_counter() - t0)
    runner.free(0)
    seconds = [statistics.median(timed[q]) for q in points]
    # a forward over more tokens never costs less: a running minimum from the right removes noise
    for i in range(len(seconds) - 2, -1, -1):
        seconds[i] = min(seconds[i], seconds[i + 1])
    table = LatencyTable(tuple(points), tuple(seconds))
    offsets = _row_offsets(runner, table, context, max(3, repeats // 2), recycle_k, row_counts, sync,
                           interrupted)
    return LatencyTable(table.tokens, table.seconds, offsets)


def _row_offsets(runner: StepRunner, table: LatencyTable, context: int, repeats: int, recycle_k: int,
                 row_counts: tuple[int, ...], sync, interrupted: Callable[[], bool]) -> tuple[tuple[int, int, float], ...]:
    """(rows, tokens per row, median seconds over the one-row table) of steps on several rows,
    each over a ``context``-token prefix; the rows are left empty afterwards."""
    out = []
    high = min(1000, runner.vocab_size)
    for n in row_counts:
        if n > runner.num_rows:
            continue
        rows = torch.arange(n)
        widths = [w for w in ROW_WIDTHS if context + w <= runner.max_len and n * w <= table.tokens[-1]]
        if not widths:
            continue
        greedy = StepSampling((None,) * n, recycle_k)
        for r in range(n):
            runner.free(r)
        _give_up_if(interrupted)
        runner.prefill_step(rows, [[10 + (i + r) % (high - 10) for i in range(context)] for r in range(n)], greedy)
        for w in widths:
            inputs = (torch.randint(10, high, (n, w)), torch.arange(w), torch.ones(w, w, dtype=torch.bool).tril(),
                      None, greedy)
            _give_up_if(interrupted)
            runner.verify_step(rows, *inputs)  # warm-up for this shape
            timed = []
            for _ in range(repeats):
                _give_up_if(interrupted)
                sync()
                t0 = time.perf_counter()
                runner.verify_step(rows, *inputs)
                sync()
                timed.append(time.perf_counter() - t0)
            out.append((n, w, statistics.median(timed) - table(n * w)))
        for r in range(n):
            runner.free(r)
    return tuple(out)


QUICK_POINTS = (1, 8, 64)  # a provisional table's counts (those up to the step's largest)
QUICK_SECONDS = 3.0  # a provisional table stops adding counts after this long (at least two)


def provisional(runner: StepRunner, max_tokens: int, recycle_k: int = 0, context: int = 1) -> LatencyTable:
    """A latency table from one verify step per count of :data:`QUICK_POINTS` over a one-token
    context, for a replica starting without a cached table (runner/startup_work.py): about 5 s on a
    1B model on 2 busy cores, where :func:`measure` takes minutes; the budget's online correction
    adjusts it while serving. The context's prefill is the warm-up. Not cached: ``tr-serve
    prepare`` measures the full table ahead of time."""
    row = torch.tensor([0])
    context = max(1, min(context, runner.max_len - max_tokens - 1))
    points = [q for q in QUICK_POINTS if q <= max_tokens and context + q <= runner.max_len] or [1]
    high = min(1000, runner.vocab_size)
    greedy = StepSampling((None,), recycle_k)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    runner.free(0)
    runner.prefill_step(row, [[10 + i % (high - 10) for i in range(context)]], greedy)

    def step(q: int) -> float:
        inputs = (torch.randint(10, high, (1, q)), torch.arange(q), torch.ones(q, q, dtype=torch.bool).tril(), None,
                  greedy)
        sync()
        t0 = time.perf_counter()
        runner.verify_step(row, *inputs)
        sync()
        return time.perf_counter() - t0

    start = time.perf_counter()
    seconds: list[float] = []
    for q in points:
        if len(seconds) >= 2 and time.perf_counter() - start > QUICK_SECONDS:
            break
        seconds.append(step(q))
    runner.free(0)
    for i in range(len(seconds) - 2, -1, -1):  # more tokens never cost less
        seconds[i] = min(seconds[i], seconds[i + 1])
    logger.info("provisional latency table (not cached; `tr-serve prepare` measures the full one): %s",
                dict(zip(points, (round(t, 4) for t in seconds))))
    return LatencyTable(tuple(points[:len(seconds)]), tuple(seconds))


IDLE_CALIBRATION_SECONDS = 45.0  # after ready, a full table is measured only where it should take about this long


def measure_seconds(table: LatencyTable, max_tokens: int, num_rows: int, context: int = 256) -> float:
    """What :func:`measure` should take, from a (provisional) table: its prefill, every count's
    warm-up and repeats, the steps of several rows."""
    total = table(context)
    for q in (q for q in POINTS if q <= max_tokens):
        total += (1 + (5 if q <= 128 else 1)) * table(q)
    for n in (n for n in ROW_COUNTS if n <= num_rows):
        total += table(n * context) + sum(4 * table(n * w) for w in ROW_WIDTHS)
    return total


class IdleCalibration:
    """The full latency table measured after the replica is ready (runner/startup_work.py): in one
    piece while the engine has no request (it holds row 0 throughout), given up between two
    forwards when a request or a shutdown comes, with the kernel plan installed by then; cached for
    the next start and adopted by the running engine's budget in place of its provisional table."""

    name = "latency table"
    order = 1  # after the kernel plan, which it is keyed by
    idle_only = True

    def __init__(self, runner: StepRunner, model_id: str, max_tokens: int, recycle_k: int,
                 adopt: Callable[[LatencyTable], None] | None = None):
        self.runner, self.model_id, self.max_tokens, self.recycle_k = runner, model_id, max_tokens, recycle_k
        self.adopt = adopt  # the running engine's budget takes the full table
        self.interruptions = 0  # measurements given up for a request or a shutdown

    def advance(self, seconds: float, runner=None, matrix=None, interrupted: Callable[[], bool] = lambda: False) -> bool:
        """The whole table, or False when ``interrupted`` cut it short (measured again from the
        start at the next idle moment: a half table interleaves rounds with nothing)."""
        path = cache_root() / "calibration" / f"{calibration_key(self.model_id, self.runner, self.recycle_k)}.json"
        table = load_json(path, lambda data: parse_table(data, self.max_tokens), "calibration")
        if table is None:
            try:
                table = measure(self.runner, self.max_tokens, recycle_k=self.recycle_k, interrupted=interrupted)
            except CalibrationInterrupted:
                self.interruptions += 1
                return False
            _save_table(path, table, self.runner, self.model_id)
        if self.adopt is not None:
            self.adopt(table)
        return True


def _save_table(path, table: LatencyTable, runner: StepRunner, model_id: str) -> None:
    save_json(path, {"tokens": table.tokens, "seconds": table.seconds,
                     "row_offsets": [list(o) for o in table.row_offsets],
                     "device": getattr(runner, "device_name", None) or device_name(runner.device), "model": model_id},
              "calibration")


def load_or_measure(runner: StepRunner, model_id: str, max_tokens: int, recycle_k: int = 0,
                    adopt: Callable[[LatencyTable], None] | None = None) -> LatencyTable:
    """The cached table, else measured and cached; inside a deferring start-up
    (runner/startup_work.py) a missing table is a :func:`provisional` one instead, and the full
    one is measured after ready where that should be short (:class:`IdleCalibration`), then
    handed to ``adopt`` (on the step thread, between steps)."""
    from tr_serve.runner import startup_work

    path = cache_root() / "calibration" / f"{calibration_key(model_id, runner, recycle_k)}.json"
    work = startup_work.current()
    if work is not None:
        cached = load_json(path, lambda data: parse_table(data, max_tokens), "calibration")
        if cached is not None:
            return cached
        table = provisional(runner, max_tokens, recycle_k)
        expected = measure_seconds(table, max_tokens, runner.num_rows)
        if expected <= IDLE_CALIBRATION_SECONDS:
            work.add(IdleCalibration(runner, model_id, max_tokens, recycle_k, adopt))
        else:
            logger.info("a full latency table would take about %.0f s: not measured while serving "
                        "(`tr-serve prepare` measures it ahead of time)", expected)
        return table

    def calibrate() -> LatencyTable:
        where = getattr(runner, "device_name", None) or device_name(runner.device)
        logger.info("calibrating forward latency on %s (cached in %s)", where, path)
        table = measure(runner, max_tokens, recycle_k=recycle_k)
        _save_table(path, table, runner, model_id)
        return table

    table, _ = load_or_make(path, lambda: load_json(path, lambda data: parse_table(data, max_tokens), "calibration"),
                            calibrate)
    return table


def parse_table(data: dict, max_tokens: int) -> LatencyTable | None:
    """A cached table, or None when it does not reach the largest of :data:`POINTS` up to
    ``max_tokens`` query tokens (what :func:`measure` measures for them: a step of 392 tokens
    reads a table measured up to 384, not one that has to reach 392)."""
    table = LatencyTable(tuple(data["tokens"]), tuple(data["seconds"]),
                         tuple((int(r), int(w), float(o)) for r, w, o in data.get("row_offsets", ())))
    needed = max([q for q in POINTS if q <= max_tokens] or [POINTS[0]])
    return table if table.tokens and table.tokens[-1] >= needed else None
