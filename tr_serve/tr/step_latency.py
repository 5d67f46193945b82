"""The step-latency model of the cost-aware budget: a table measured on the device at start-up
(runner/calibration.py), corrected per batch shape by what serving measures."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyTable:
    """Forward latency (seconds) by total query tokens in the step, linearly interpolated, measured
    on one row; ``row_offsets``: (rows, tokens per row, seconds over the table) of steps measured
    on several rows at start-up (runner/calibration.py), which :class:`StepLatency` starts from."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    row_offsets: tuple[tuple[int, int, float], ...] = ()

    def __call__(self, q: int) -> float:
        i = bisect.bisect_left(self.tokens, q)
        if i < len(self.tokens) and self.tokens[i] == q:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.tokens):  # extrapolate with the last slope
            i = len(self.tokens) - 1
        t0, t1 = self.tokens[i - 1], self.tokens[i]
        s0, s1 = self.seconds[i - 1], self.seconds[i]
        return s0 + (s1 - s0) * (q - t0) / (t1 - t0)


class StepLatency:
    """Step latency by (rows, query tokens in the step, widest row).

    The start-up table is measured on one row. A batch of rows costs more than its token count
    says: the runner packs the rows' real tokens for the linear layers and the LM head (their cost
    follows the token count, as in the table), but every row attends over its own cache and runs
    its own small operations, a cost per row that does not grow with its drafted tokens; and a row
    wider than the native tree attention takes (16 tokens; 64 on several rows or in the layers' C
    loop) sends the whole step through a padded path. So while serving the engine observes each step and keeps, per (row count, power-of-two
    bucket of the widest row), the moving average of measured minus table: an additive offset.

    Why additive: measured at 13 rows over 300-token contexts (SmolLM2-135M, 2 threads), the steps
    cost the table plus 5-8 ms whether they verified 13 or 44 tokens. A ratio learned on plain steps
    (1.3-1.4 there) multiplied the table's cost of every extra token too, so the budget saw drafts
    at high row counts as 1.5-2x dearer than they were and verified almost none. An unseen width
    takes the nearest seen one of the same rows, an unseen row count the table alone. A step that
    took over ``spike`` times its prediction (a busy moment of the machine) counts as ``spike``
    times it, so one outlier cannot price a shape out of the plans for long.

    The offsets start from the table's ``row_offsets`` (row counts measured at start-up, e.g. 8 and
    32: on a GPU a step of 32 rows costs mostly its rows' attention, which a one-row table cannot
    show); a row count neither measured nor observed takes the offset interpolated between the
    measured ones (one row: none), proportional to rows past the last."""

    def __init__(self, table: LatencyTable, alpha: float = 0.2, spike: float = 1.5):
        self.alpha = alpha
        self.spike = spike
        self.adopt(table)

    def adopt(self, table: LatencyTable) -> None:
        """Price from ``table`` from now on; the offsets learned against the old table are
        relative to it, so they start over from the new table's own."""
        self.table = table
        self.offsets: dict[tuple[int, int], float] = {}  # (rows, width bucket) -> seconds over the table
        for rows, width, offset in table.row_offsets:
            self.offsets[(rows, self.bucket(width))] = offset
        self.measured_rows = sorted({rows for rows, _, _ in table.row_offsets})

    @staticmethod
    def bucket(tokens: int) -> int:
        """1, 2, 3-4, 5-8, 9-16, 17-32, ...: a width of 16 and one of 17 fall apart, as the
        runner's paths do (``tree_attention.MAX_WIDTH``)."""
        return (max(1, tokens) - 1).bit_length()

    def observe(self, rows: int, tokens: int, seconds: float, width: int | None = None) -> None:
        key = (rows, self.bucket(width or 1))
        base = self.table(tokens)
        old = self.offsets.get(key)
        if old is not None:
            seconds = min(seconds, self.spike * (base + old))
        offset = seconds - base
        self.offsets[key] = offset if old is None else old + self.alpha * (offset - old)

    def __call__(self, rows: int, tokens: int, width: int | None = None) -> float:
        wb = self.bucket(width or 1)
        offset = self._offset(rows, wb)
        if offset is None:
            offset = self._interpolated(rows, wb)
        return max(self.table(tokens) + offset, 1e-6)

    def _offset(self, rows: int, wb: int) -> float | None:
        offset = self.offsets.get((rows, wb))
        if offset is None:
            widths = [w for r, w in self.offsets if r == rows]
            if widths:
                offset = self.offsets[(rows, _nearest(widths, wb))]
        return offset

    def _interpolated(self, rows: int, wb: int) -> float:
        """The offset of an unseen row count from the row counts measured at start-up."""
        if not self.measured_rows or rows <= 1:
            return 0.0
        lower = max([1] + [r for r in self.measured_rows if r < rows])
        higher = [r for r in self.measured_rows if r > rows]
        low = 0.0 if lower == 1 else self._offset(lower, wb)
        if not higher:
            return low * rows / lower
        high = self._offset(higher[0], wb)
        return low + (high - low) * (rows - lower) / (higher[0] - lower)


def _nearest(keys, k: int) -> int:
    """The key closest to ``k`` (the lower one on a tie)."""
    return min(keys, key=lambda j: (abs(j - k), j))

