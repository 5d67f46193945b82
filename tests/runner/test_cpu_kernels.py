"""The CPU linear kernels: same fp32 results as F.linear (to rounding), used only inside a plan's
``active()`` block, chosen per token count, and measured once then cached on disk."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from tr_serve.runner import cpu_kernels as ck
from tr_serve.runner.model_runner import ModelRunner


def _linear(out_f: int, in_f: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("kernel", ["mkl_nt", "onednn", "torch"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [1, 2, 3, 8, 33])
def test_every_kernel_matches_f_linear(kernel, bias, n):
    lin = _linear(96, 40, bias)
    model = nn.Sequential(lin)
    [m] = ck.kernel_linears(model)
    ck._pack([m])
    x = torch.randn(1, n, 40)
    got = ck.run_kernel(m, x, kernel)
    want = F.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape == (1, n, 96)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_plan_buckets_token_counts():
    plan = ck.KernelPlan(points=(1, 2, 4), kernels=("mkl_nt", "torch", "onednn"))
    assert [plan.kernel_for(n) for n in (1, 2, 3, 4, 5, 500)] == ["mkl_nt", "torch", "onednn", "onednn", "torch", "torch"]


def test_kernels_only_inside_active(monkeypatch):
    lin = _linear(64, 32, bias=True)
    model = nn.Sequential(lin)
    ck.kernel_linears(model)
    assert type(lin) is ck.KernelLinear
    calls = []
    real = ck.run_kernel
    monkeypatch.setattr(ck, "run_kernel", lambda m, x, k: calls.append((x.shape[1], k)) or real(m, x, k))
    x = torch.randn(1, 3, 32)
    outside = model(x)
    assert calls == [] and torch.equal(outside, F.linear(x, lin.weight, lin.bias))  # reference untouched
    plan = ck.KernelPlan(points=(2, 8), kernels=("mkl_nt", "mkl_nt"))
    with plan.active():
        inside = model(x)
    assert calls == [(3, "mkl_nt")]
    torch.testing.assert_close(inside, outside, rtol=1e-5, atol=1e-5)
    model(x)
    assert len(calls) == 1  # deactivated on exit


def test_kernel_linears_is_idempotent_and_skips_other_dtypes():
    model = nn.Sequential(_linear(8, 8, False), _linear(8, 8, False).to(torch.bfloat16))
    first = ck.kernel_linears(model)
    again = ck.kernel_linears(model)
    assert first == again and len(first) == 1
    assert type(model[1]) is nn.Linear


def test_select_plan_measures_once_then_loads_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    measured = []
    real = ck.measure_plan
    monkeypatch.setattr(ck, "measure_plan", lambda linears: measured.append(1) or real(linears, points=(1, 2, 3)))
    plan = ck.select_plan(nn.Sequential(_linear(16, 8, False), _linear(8, 16, True)))
    assert measured == [1] and plan.points == (1, 2, 3) and set(plan.kernels) <= set(ck.KERNELS)
    [cached] = (tmp_path / "kernels").glob("*.json")
    assert json.loads(cached.read_text())["kernels"] == list(plan.kernels)
    again = ck.select_plan(nn.Sequential(_linear(16, 8, False, seed=1), _linear(8, 16, True, seed=1)))
    assert measured == [1] and again == plan  # same shapes, same CPU and threads: no second measurement
    cached.write_text("{not json")
    ck.select_plan(nn.Sequential(_linear(16, 8, False), _linear(8, 16, True)))
    assert measured == [1, 1]  # an unreadable cache is measured again, not trusted


def test_runner_logits_match_torch_kernels(tokenizer):
    from tests.tiny_model import tiny_loaded

    model = tiny_loaded(tokenizer, seed=5, init_range=0.05).model
    plan = ck.KernelPlan(points=(1, 2, 64), kernels=("mkl_nt", "mkl_nt", "onednn"))
    ck._pack(ck.kernel_linears(model))
    prompt = [[5, 17, 99, 3, 250, 8]]
    tokens = torch.tensor([[7, 9, 11, 13]])
    depths = torch.tensor([0, 1, 1, 2])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    results = []
    for p in (None, plan):
        runner = ModelRunner(model, 1, 32, kernel_plan=p)
        last, _ = runner.prefill(torch.tensor([0]), prompt)
        results.append((last, runner.verify(torch.tensor([0]), tokens, depths, tree)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-4, atol=1e-4)


def test_engine_uses_a_plan_only_for_fp32_cpu_auto(tokenizer, tmp_path, monkeypatch):
    from tests.tiny_model import tiny_loaded
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine

    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    loaded = tiny_loaded(tokenizer, seed=2)
    auto = Engine(loaded, EngineConfig(model="tiny", tree="top4", max_num_seqs=1, max_model_len=64))
    assert isinstance(auto.runner.kernel_plan, ck.KernelPlan)
    off = Engine(loaded, EngineConfig(model="tiny", tree="top4", max_num_seqs=1, max_model_len=64, cpu_kernels="torch"))
    assert off.runner.kernel_plan is None
    with pytest.raises(ValueError, match="cpu_kernels"):
        EngineConfig(cpu_kernels="fast")
