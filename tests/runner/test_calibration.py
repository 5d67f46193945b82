"""The engine's latency calibration: interleaved rounds, the median per count, a running minimum from the
right (a forward over more tokens never costs less), the row left empty."""

from __future__ import annotations

import types

import pytest

from tr_serve.runner import calibration
from tr_serve.runner.model_runner import ModelRunner


def test_measure_interleaves_rounds_and_keeps_the_median(tokenizer, monkeypatch):
    from tests.tiny_model import tiny_loaded

    runner = ModelRunner(tiny_loaded(tokenizer).model, 1, 64)
    order = []
    real = runner.verify_step  # what the engine calls, and so what calibration times

    def verify_step(rows, tokens, depths, mask, lengths, sampling):
        order.append(tokens.shape[1])
        assert runner.length(0) == 16  # the context stays in the row
        return real(rows, tokens, depths, mask, lengths, sampling)

    runner.verify_step = verify_step
    state = {"calls": 0, "timed": {}}

    def perf_counter():  # start stamps 0; an end stamp returns this count's duration this round
        state["calls"] += 1
        if state["calls"] % 2:
            return 0.0
        q = order[-1]
        state["timed"][q] = state["timed"].get(q, 0) + 1
        spikes = {(2, 1): 9.0, (4, 2): 9.0, (1, 2): 0.8}  # (count, round): a busy moment, a fast one
        return spikes.get((q, state["timed"][q]), {1: 1.0, 2: 1.5, 3: 1.4, 4: 2.0}[q])

    monkeypatch.setattr(calibration, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(calibration, "POINTS", (1, 2, 3, 4))
    table = calibration.measure(runner, max_tokens=4, context=16, repeats=3)
    assert order[:4] == [1, 2, 3, 4]  # warm-up
    assert order[4:] == [1, 2, 3, 4, 4, 3, 2, 1, 1, 2, 3, 4]  # interleaved, alternating direction
    assert table.tokens == (1, 2, 3, 4)
    # median per count: 1 -> 1.0 (the fast round dropped), 2 -> 1.5 (the spike dropped), 4 -> 2.0;
    # then the running minimum from the right: 2 -> 1.4
    assert table.seconds == pytest.approx((1.0, 1.4, 1.4, 2.0))
    assert runner.length(0) == 0


def test_measure_times_large_counts_once(tokenizer, monkeypatch):
    from tests.tiny_model import tiny_loaded

    runner = ModelRunner(tiny_loaded(tokenizer).model, 1, 400)
    seen = []
    real = runner.verify_step
    runner.verify_step = lambda rows, tokens, *rest: seen.append(tokens.shape[1]) or real(rows, tokens, *rest)
    monkeypatch.setattr(calibration, "POINTS", (8, 192))
    table = calibration.measure(runner, max_tokens=192, context=32, repeats=3)
    assert seen.count(8) == 4 and seen.count(192) == 2  # warm-up + 3 rounds; warm-up + once
    assert table.tokens == (8, 192) and table.seconds[0] <= table.seconds[1]
    assert all(isinstance(t, float) and t > 0 for t in table.seconds)


def test_a_changed_native_kernel_keys_a_new_table_and_plan(tokenizer, monkeypatch):
    """The latency table and the kernel plan were measured with the compiled kernels of their day:
    a kernel whose source changed (the panel GEMM's grouping, say) is timed again, not priced with
    the old figures."""
    from tests.tiny_model import tiny_loaded
    from tr_serve.kernels import cpu_kernels, kernel_autotune, layer_driver, panel_gemm, tree_attention

    model = tiny_loaded(tokenizer).model
    runner = ModelRunner(model, 1, 64)
    calls = cpu_kernels.kernel_calls(model)
    table, plan = calibration.calibration_key("m", runner), kernel_autotune.plan_key(calls)
    assert calibration.calibration_key("m", runner) == table  # stable
    monkeypatch.setattr(tree_attention.KERNEL, "source", tree_attention.KERNEL.source + "\n")
    assert calibration.calibration_key("m", runner) != table and kernel_autotune.plan_key(calls) == plan
    monkeypatch.undo()
    monkeypatch.setattr(panel_gemm.KERNEL, "source", panel_gemm.KERNEL.source + "\n")
    assert calibration.calibration_key("m", runner) != table and kernel_autotune.plan_key(calls) != plan
    monkeypatch.undo()
    monkeypatch.setattr(layer_driver.KERNEL, "source", layer_driver.KERNEL.source + "\n")  # the layers' C loop
    assert calibration.calibration_key("m", runner) != table and kernel_autotune.plan_key(calls) == plan
    monkeypatch.undo()
    monkeypatch.setattr(layer_driver.KERNEL, "tried", True)
    monkeypatch.setattr(layer_driver.KERNEL, "lib", None)  # no driver on this machine: the Python loop's table
    assert calibration.calibration_key("m", runner) != table


def test_measure_adds_steps_of_several_rows(tokenizer):
    from tests.tiny_model import tiny_loaded

    runner = ModelRunner(tiny_loaded(tokenizer).model, 8, 64)
    table = calibration.measure(runner, max_tokens=64, context=16, repeats=1, row_counts=(4, 8, 16))
    measured = {(rows, width) for rows, width, _ in table.row_offsets}
    # 16 rows: more than the runner has; 4 x 16 and 8 x 16 tokens: past the table (48 tokens fit a 64-slot row)
    assert table.tokens[-1] == 48 and measured == {(4, 1), (4, 4), (8, 1), (8, 4)}
    assert all(runner.length(r) == 0 for r in range(8))  # every row left empty
    parsed = calibration.parse_table({"tokens": list(table.tokens), "seconds": list(table.seconds),
                                      "row_offsets": [list(o) for o in table.row_offsets]}, 48)
    assert parsed == table


def test_a_cached_table_serves_the_step_sizes_it_was_measured_for():
    """A table measured for 392-token steps ends at 384 (the largest count measured up to 392): it
    is read back for 392, not measured again at every start; a table that stops short is not."""
    data = {"tokens": [1, 2, 384], "seconds": [0.01, 0.02, 0.3]}
    assert calibration.parse_table(data, 392).tokens[-1] == 384
    assert calibration.parse_table(data, 384) is not None and calibration.parse_table(data, 520) is None
    assert calibration.parse_table({"tokens": [1, 2, 648], "seconds": [0.01, 0.02, 0.4]}, 5000) is not None


def test_an_interrupted_measurement_gives_up_before_its_next_forward_and_frees_its_rows(tokenizer):
    """Polled before each forward: a request or a shutdown waits one forward at most, and no row
    is left holding calibration context (the next request's prefill would land on it)."""
    from tests.tiny_model import tiny_loaded

    runner = ModelRunner(tiny_loaded(tokenizer).model, 8, 64)
    forwards = []
    real = runner.verify_step
    runner.verify_step = lambda *a: forwards.append(1) or real(*a)
    calibration.measure(runner, max_tokens=8, context=16, repeats=3, row_counts=(8,))
    full = len(forwards)
    for stop_after in (0, 1, full // 2, full - 1):  # before the first forward ... before the last
        forwards.clear()
        polls = []

        def interrupted(stop_after=stop_after):
            polls.append(len(forwards))
            return len(forwards) >= stop_after

        with pytest.raises(calibration.CalibrationInterrupted):
            calibration.measure(runner, max_tokens=8, context=16, repeats=3, row_counts=(8,),
                                interrupted=interrupted)
        assert len(forwards) == stop_after
        assert all(runner.length(r) == 0 for r in range(8))


def test_the_idle_calibration_is_measured_again_after_an_interruption_and_cached(tokenizer, tmp_path, monkeypatch):
    from tests.tiny_model import tiny_loaded

    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "POINTS", (1, 2, 4))
    runner = ModelRunner(tiny_loaded(tokenizer).model, 1, 64)
    job = calibration.IdleCalibration(runner, "tiny", 4, 0)
    assert job.advance(1.0, interrupted=lambda: True) is False and job.interruptions == 1
    assert not list(tmp_path.rglob("*.json"))  # nothing half measured is cached
    assert job.advance(1.0, interrupted=lambda: False) is True
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1


def test_a_cuda_device_is_named_by_its_accelerator(monkeypatch):
    """The CUDA branch runs on CPU with torch's device query faked: the name is the card's."""
    import torch

    from tr_serve.runner import calibration

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: asked.append(device) or "NVIDIA H100")
    assert calibration.device_name(torch.device("cuda", 0)) == "NVIDIA H100"
    assert asked == [torch.device("cuda", 0)]
    assert "threads" in calibration.device_name(torch.device("cpu"))
