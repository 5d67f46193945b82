"""The step-latency model: the calibrated table, corrected per batch shape by measured steps."""

from __future__ import annotations

import pytest

from tr_serve.tr.step_latency import LatencyTable, StepLatency


def test_latency_table_interpolates_and_extrapolates():
    t = LatencyTable((1, 3, 5), (1.0, 2.0, 4.0))
    assert t(1) == 1.0 and t(2) == 1.5 and t(4) == 3.0
    assert t(7) == 6.0  # last slope
    assert t(0) == 1.0


def test_step_latency_adds_a_per_shape_offset_and_caps_spikes():
    # measured on CPU: 13 rows cost the one-row table plus a few ms whatever their tokens; a
    # ratio would also scale the price of every drafted token
    table = LatencyTable((1, 16, 32), (0.030, 0.040, 0.060))
    latency = StepLatency(table, alpha=0.5)
    latency.observe(13, 13, 0.045, width=1)
    offset = 0.045 - table(13)
    assert latency(13, 13, 1) == pytest.approx(0.045)
    assert latency(13, 29, 2) == pytest.approx(table(29) + offset)  # nearest seen width, the table's slope
    assert latency(13, 29, 2) - latency(13, 13, 1) == pytest.approx(table(29) - table(13))
    latency.observe(13, 13, 1.0, width=1)  # a 1 s hiccup of the machine counts as 1.5x the prediction
    assert latency(13, 13, 1) == pytest.approx(0.045 + 0.5 * (1.5 * 0.045 - 0.045))
    assert latency(4, 13, 1) == table(13)  # another row count: the table until it is measured


def test_padded_width_is_priced_per_row_count():
    # 8 rows, 12 query tokens in all: 1 wide row padded to 5 costs more than the same tokens
    # spread 1-2 per row, because attention runs every row at the padded width
    latency = StepLatency(LatencyTable((1, 64), (1.0, 1.1)), alpha=1.0)
    latency.observe(8, 12, 1.1, width=2)
    latency.observe(8, 12, 2.0, width=5)
    assert latency(8, 12, 2) < latency(8, 12, 5)
    assert latency(8, 12, 8) == latency(8, 12, 5)  # same power-of-two width bucket (5-8)
    assert latency(8, 12, 16) == latency(8, 12, 5)  # unseen width: the nearest seen one
    assert StepLatency.bucket(16) != StepLatency.bucket(17)  # the runner's attention paths part at 16


def test_row_counts_measured_at_start_up_price_unseen_row_counts():
    # calibration measured 8 and 32 rows (runner/calibration.py): between them the offset is
    # interpolated, below 8 from one row's none, past 32 in proportion to the rows
    table = LatencyTable((1, 512), (0.010, 0.020), row_offsets=((8, 1, 0.004), (32, 1, 0.012), (32, 16, 0.030)))
    latency = StepLatency(table)
    assert latency(8, 8, 1) == pytest.approx(table(8) + 0.004)  # measured
    assert latency(32, 512, 16) == pytest.approx(table(512) + 0.030)
    assert latency(1, 4, 4) == table(4)  # one row: the table itself
    assert latency(4, 4, 1) == pytest.approx(table(4) + 0.004 * 3 / 7)
    assert latency(20, 20, 1) == pytest.approx(table(20) + 0.004 + 0.008 * 12 / 24)
    assert latency(64, 64, 1) == pytest.approx(table(64) + 0.012 * 2)
    latency.observe(20, 20, 0.050, width=1)  # what the engine measures then takes over
    assert latency(20, 20, 1) == pytest.approx(0.050)
    assert StepLatency(LatencyTable((1, 64), (1.0, 1.1)))(4, 8, 1) == LatencyTable((1, 64), (1.0, 1.1))(8)
