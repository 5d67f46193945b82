"""Deferred start-up work (runner/startup_work.py): an engine built inside ``deferring`` neither
measures a kernel plan nor computes a matrix prior; both run afterwards in slices between steps,
install themselves at a step boundary, keep the output plain decoding's, and leave recycling's
rows alone. The plan's measurement packs one part of a sampled forward at a time."""

from __future__ import annotations

import json

import pytest
import torch

from tests.tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.runner import calibration, matrix_prior
from tr_serve.kernels import cpu_kernels, kernel_autotune, kernel_sample, kernel_timing
from tr_serve.runner.startup_work import StartupWork, current, deferring
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.matrix import EMPTY

PROMPT = [5, 17, 99, 3, 250, 17, 99, 40]


def _fail(what: str):
    def fail(*a, **k):
        raise AssertionError(f"{what} ran before the engine was ready")
    return fail


def _plain(tokenizer) -> Engine:
    """Plain decoding on torch's kernels (nothing measured, nothing cached)."""
    return Engine(tiny_loaded(tokenizer, seed=3), EngineConfig(model="tiny", tree="none", max_num_seqs=1,
                                                               max_model_len=128, matrix_prior=False,
                                                               cpu_kernels="torch"))


def _generate(engine: Engine, prompt: list[int], tokens: int, between=None) -> list[int]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                out = o.token_ids
        if between is not None:
            between()
    return list(out)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(kernel_autotune, "POINTS", (1, 2, 4, 8))  # a short measurement: the tiny model's plan
    return tmp_path


def test_deferring_collects_only_inside_its_block():
    assert current() is None
    with deferring() as work:
        assert current() is work
        with deferring(StartupWork()) as inner:
            assert current() is inner
        assert current() is work
    assert current() is None


@pytest.mark.parametrize("tree", ["2.2.2", "auto"])
def test_a_deferred_engine_is_ready_at_once_then_measures_and_seeds_between_steps(tokenizer, fresh_cache,
                                                                                  monkeypatch, tree):
    loaded = tiny_loaded(tokenizer, seed=3)
    config = EngineConfig(model="tiny", tree=tree, max_num_seqs=2, max_model_len=128)
    want = _generate(_plain(tokenizer), PROMPT, 24)
    with monkeypatch.context() as m:
        m.setattr(kernel_autotune, "measure_plan", _fail("the kernel plan's measurement"))
        m.setattr(matrix_prior, "first_token_top_k", _fail("the matrix prior"))
        m.setattr(calibration, "measure", _fail("the full latency calibration"))
        with deferring() as work:
            engine = Engine(loaded, config)
    full_table = ["latency table"] if tree == "auto" else []  # the cost-aware budget's, measured while idle
    assert work.pending == ["kernel plan", *full_table, "matrix prior"]
    assert engine.runner.kernel_plan is None  # torch's kernels until the plan is measured
    assert engine.matrix.num_filled_rows() == 0
    assert not list((fresh_cache / "kernels").glob("*.json")) and not (fresh_cache / "matrix_prior").exists()

    # a first request before any start-up work, then the work interleaved with requests
    assert _generate(engine, PROMPT, 24) == want
    prior_job = work.jobs[-1]
    slices = []

    def one_slice():  # what the server's task does between two steps
        slices.append(work.advance(0.02, engine.runner, engine.matrix, not engine.has_unfinished()))

    reference = _generate(_plain(tokenizer), PROMPT[::-1], 16)
    while work.pending:
        assert _generate(engine, PROMPT[::-1], 16, between=one_slice) == reference
        one_slice()  # idle: the full latency table's turn
    assert len(slices) > 2 and work.failed == [] and sorted(work.done) == sorted(["kernel plan", *full_table, "matrix prior"])
    plan = engine.runner.kernel_plan
    assert plan is not None and plan.points == (1, 2, 4, 8)
    assert kernel_autotune.select_plan(loaded.model) is plan  # installed where select_plan finds it
    [cached] = (fresh_cache / "kernels").glob("*.json")
    assert kernel_autotune._parse_plan(json.loads(cached.read_text()))[0] == plan
    # the prior reached every row, and is cached as an eagerly computed one is
    assert (engine.matrix.table[:, 0] != EMPTY).all() and prior_job.filled == 512
    monkeypatch.setattr(matrix_prior, "first_token_top_k", _fail("the matrix prior"))
    assert torch.equal(matrix_prior.load_or_compute(loaded.model, loaded.model_id, 512, config.k, tokenizer.bos_token_id),
                       prior_job.table)
    assert _generate(engine, PROMPT, 24) == want  # with the measured plan and the prior
    if full_table:  # cached for the next start, keyed by the plan it ran on
        assert len(list((fresh_cache / "calibration").glob("*.json"))) == 1


def test_rows_of_a_deferred_prior_are_the_models_top_k(tokenizer, fresh_cache):
    """Forwards sized to the slices give the rows one forward per token gives (the k largest logits
    after [BOS, t], in order)."""
    loaded = tiny_loaded(tokenizer, seed=3)
    with deferring() as work:
        matrix_prior.load_or_compute(loaded.model, "tiny", 512, 4, 1)
    [job] = work.jobs
    while not job.advance(0.001):
        pass
    ids = torch.stack([torch.ones(512, dtype=torch.long), torch.arange(512)], dim=1)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(logits.gather(1, job.table.long()), logits.topk(4, dim=-1).values,
                               rtol=1e-5, atol=1e-5)


def test_recycled_rows_are_never_overwritten_by_the_prior(tokenizer, fresh_cache):
    loaded = tiny_loaded(tokenizer, seed=3)
    with deferring() as work:
        engine = Engine(loaded, EngineConfig(model="tiny", tree="2.2.2", max_num_seqs=1, max_model_len=128,
                                             cpu_kernels="torch"))
    assert work.pending == ["matrix prior"]
    [job] = work.jobs
    work.advance(0.0, engine.runner, engine.matrix)  # one forward's rows
    assert 0 < job.filled < 512
    recycled = torch.tensor([400, 401, 402])
    rows = torch.arange(8, dtype=torch.int32).repeat(3, 1)
    engine.matrix.recycle(recycled, rows)  # recycling writes rows the prior has not reached yet
    while not work.advance(0.05, engine.runner, engine.matrix):
        pass
    assert torch.equal(engine.matrix.table[recycled], rows)
    others = torch.ones(512, dtype=torch.bool)
    others[recycled] = False
    assert torch.equal(engine.matrix.table[others], job.table[others])


def test_a_failing_job_is_dropped_and_the_rest_goes_on():
    class Boom:
        name = "boom"

        def advance(self, seconds, runner, matrix):
            raise RuntimeError("no")

    class Once:
        name = "once"

        def advance(self, seconds, runner, matrix):
            return True

    work = StartupWork()
    work.add(Boom())
    work.add(Once())
    assert work.advance(1.0) and work.failed == ["boom"] and work.done == ["once"]
    assert work.status()["pending"] == []


def _stacked_calls(layers: int = 6):
    """Kernel calls of a stack of identical blocks and a head, as a decoder's."""
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(64, 256, bias=False)
            self.down = torch.nn.Linear(256, 64, bias=False)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block() for _ in range(layers))
            self.head = torch.nn.Linear(64, 1024, bias=False)

    model = Net().requires_grad_(False)
    return model, cpu_kernels.kernel_calls(model)


def test_the_sample_stands_for_every_block_and_keeps_the_head(monkeypatch):
    model, calls = _stacked_calls(6)
    block = 2 * 64 * 256 * 4
    monkeypatch.setattr(kernel_sample, "STREAM_BYTES", 2 * block)  # two blocks' weights
    sample = kernel_sample.measurement_sample(calls)
    assert [(c.layer, w) for c, w in sample] == [(0, 3.0), (0, 3.0), (1, 3.0), (1, 3.0), (None, 1.0)]
    # blocks of different shapes: every call, weight 1
    model.layers[5].up = torch.nn.Linear(64, 128, bias=False)
    model.layers[5].down = torch.nn.Linear(128, 64, bias=False)
    calls = cpu_kernels.kernel_calls(model)
    assert [w for _, w in kernel_sample.measurement_sample(calls)] == [1.0] * len(calls)


def test_the_measurement_packs_at_most_one_copy_of_the_largest_weight(monkeypatch):
    """Whatever the kernels, the prepacked copies held at any time stay within the largest weight's
    bytes; every prepacked kernel is still timed at every count, and the seconds stand for the
    whole forward (the sampled blocks weighted by the blocks they stand for)."""
    model, calls = _stacked_calls(6)
    monkeypatch.setattr(kernel_sample, "PACK_FLOOR_BYTES", 0)
    monkeypatch.setattr(kernel_sample, "STREAM_BYTES", 1)  # the first block stands for all six
    monkeypatch.setattr(cpu_kernels, "available_kernels", lambda: ["torch", "mkl_nt", "onednn", "panel"])
    monkeypatch.setattr(kernel_timing, "_cpu_stall", lambda: None)
    monkeypatch.setattr(kernel_timing, "cpu_busy", lambda: None)
    monkeypatch.setattr(kernel_autotune.panel_gemm, "set_wide_narrow", lambda on: None)
    monkeypatch.setattr(kernel_autotune.panel_gemm, "set_prefetch_l2", lambda rows: None)
    held, peak = {}, [0]

    def fake_pack(cs, kernel="onednn"):
        for c in cs:
            held[id(c), kernel] = kernel_sample.weight_bytes(c)
        peak[0] = max(peak[0], sum(held.values()))

    def fake_unpack(cs, kernel="onednn"):
        for c in cs:
            held.pop((id(c), kernel), None)

    cost = {"torch": 3.0, "mkl_nt": 2.0, "onednn": 1.5, "panel": 1.0}

    def fake_pass(cs, inputs, kernel, clock=None):
        for c in cs:
            if kernel in cpu_kernels.PREPACKED:
                assert (id(c), kernel) in held, "timed a prepacked kernel on a weight that is not packed"
        return cost[kernel] * sum(c.out_features * c.in_features for c in cs) * next(iter(inputs.values())).shape[0]

    monkeypatch.setattr(cpu_kernels, "pack", fake_pack)
    monkeypatch.setattr(cpu_kernels, "unpack", fake_unpack)
    monkeypatch.setattr(kernel_timing, "time_pass", fake_pass)
    largest = max(kernel_sample.weight_bytes(c) for c in calls)
    plan, seconds, info = kernel_autotune.measure_plan(calls, points=(1, 4), rounds=2)
    assert 0 < peak[0] <= largest and held == {}
    assert info["parts"] >= 2 and info["sampled_calls"] == 3 and info["calls"] == 13
    forward = 6 * 2 * 64 * 256 + 64 * 1024  # every block's two linears and the head
    for n in (1, 4):
        for k, c in cost.items():
            assert seconds[n][k] == pytest.approx(c * forward * n)
    assert set(plan.kernels) == {"panel"}


def test_a_deferred_measurement_counts_only_its_slices(monkeypatch):
    """The time budget runs on a clock that stops between slices: a measurement resumed after a
    long pause still has its budget."""
    clock = kernel_timing.WorkClock()
    assert clock.now() == 0.0
    clock.resume()
    t = clock.now()
    clock.pause()
    frozen = clock.now()
    assert frozen >= t and clock.now() == frozen


def test_a_job_that_needs_the_rows_waits_for_an_idle_engine():
    ran = []

    class Rows:
        name, idle_only = "rows", True

        def advance(self, seconds, runner, matrix, interrupted):
            ran.append("rows")
            return not interrupted()  # gives up when a request or a shutdown waits

    class Plan:
        name, order = "plan", 0

        def __init__(self):
            self.left = 2

        def advance(self, seconds, runner, matrix):
            ran.append("plan")
            self.left -= 1
            return self.left == 0

    work = StartupWork()
    work.add(Rows())
    work.add(Plan())
    assert work.pending == ["rows", "plan"]
    assert not work.advance(1.0, idle=False) and ran == ["plan", "plan"] and work.pending == ["rows"]
    assert not work.advance(1.0) and ran == ["plan", "plan"]  # not idle unless the caller says so
    assert not work.advance(1.0, idle=True, interrupted=lambda: True) and ran[-1] == "rows"
    assert work.pending == ["rows"]  # given up, not dropped: advanced again at the next idle moment
    assert work.advance(1.0, idle=True) and ran.count("rows") == 2 and work.done == ["plan", "rows"]


def test_the_full_latency_table_is_left_for_later_only_where_it_is_short(tokenizer, fresh_cache, monkeypatch):
    """A provisional table that prices the full measurement over the limit registers nothing (the
    1B case: minutes); a cheap one registers the idle calibration."""
    from tr_serve.runner.calibration import measure_seconds
    from tr_serve.tr.step_latency import LatencyTable

    slow = LatencyTable((1, 8), (0.6, 4.0))  # a 1B model's torch kernels on 2 busy cores
    fast = LatencyTable((1, 8), (0.02, 0.03))
    assert measure_seconds(slow, 392, 4) > calibration.IDLE_CALIBRATION_SECONDS
    assert measure_seconds(fast, 392, 4) < calibration.IDLE_CALIBRATION_SECONDS
    for table, want in ((slow, []), (fast, ["latency table"])):
        monkeypatch.setattr(calibration, "provisional", lambda *a, table=table, **k: table)
        with deferring() as work:
            Engine(tiny_loaded(tokenizer, seed=3), EngineConfig(model="tiny", tree="auto", max_num_seqs=1,
                                                                max_model_len=128, cpu_kernels="torch",
                                                                matrix_prior=False))
        assert work.pending == want


def test_the_running_engine_prices_drafts_by_the_full_table_once_it_is_measured(tokenizer, fresh_cache, monkeypatch):
    """Started on a provisional table (a few counts), the budget takes the full table the idle
    calibration measures, at a step boundary; online offsets start over against it."""
    monkeypatch.setattr(calibration, "POINTS", (1, 2, 4, 8, 16))
    with deferring() as work:
        engine = Engine(tiny_loaded(tokenizer, seed=3), EngineConfig(model="tiny", tree="auto", max_num_seqs=1,
                                                                     max_model_len=128, cpu_kernels="torch",
                                                                     matrix_prior=False))
    latency = engine.speculator.drafter.budget.latency
    assert work.pending == ["latency table"] and latency.table.tokens == calibration.QUICK_POINTS  # provisional
    latency.observe(1, 4, 10.0)  # an offset learned against the provisional table
    assert latency.offsets
    while not work.advance(1.0, engine.runner, engine.matrix, idle=True):
        pass
    assert latency.table.tokens == (1, 2, 4, 8, 16) and latency.offsets == {}
    assert _generate(engine, PROMPT, 12) == _generate(_plain(tokenizer), PROMPT, 12)
