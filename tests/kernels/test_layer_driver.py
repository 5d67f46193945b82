"""The native loop over a verify step's decoder layers: bit-identical to the Python loop over the
same kernels, taken only where it computes what the layers do."""

from __future__ import annotations

import torch

from tr_serve.kernels import cpu_kernels as ck
from tr_serve.kernels import layer_driver, layer_ops
from tr_serve.kernels import tree_attention as ta
from tr_serve.runner.model_runner import ModelRunner
from tests.kernel_testutil import needs_kernel as _needs
from tests.tiny_model import prefill_and_verify, small_llama

needs_kernel = _needs(layer_driver.KERNEL)

PANEL = ck.KernelPlan(points=(64,), kernels=("panel",))


def _panel_llama(fuse: bool = True):
    model = small_llama()  # hidden 64, 4 heads of 16 on 2 key/value heads, intermediate 96
    ck.kernel_linears(model)
    if fuse:
        ck.fuse_siblings(model)
    ck.pack(ck.kernel_calls(model), "panel")
    return model



@needs_kernel
def test_verify_steps_through_the_driver_equal_the_python_loop_bit_for_bit(monkeypatch):
    model = _panel_llama()
    runs, silu = [], []
    real_run, real_silu = layer_driver.run, layer_ops.silu_mul
    monkeypatch.setattr(layer_driver, "run", lambda *a: runs.append(1) or real_run(*a))
    monkeypatch.setattr(layer_ops, "silu_mul", lambda *a: silu.append(1) or real_silu(*a))
    runner = ModelRunner(model, 4, 96, kernel_plan=PANEL)
    assert runner.layer_ops
    with_driver = prefill_and_verify(runner)
    assert len(runs) == 3  # the ragged prefill (44 tokens, one row of 40) and both verify steps
    assert not silu  # no layer ran in Python

    # the Python loop over the same kernels: the layer ops and the tree attention at every width
    monkeypatch.setattr(layer_driver, "applies", lambda plan, tokens: False)
    monkeypatch.setattr(ta, "takes", lambda rows, width, verify=True, c_loop=False: width <= 64)
    without = prefill_and_verify(ModelRunner(model, 4, 96, kernel_plan=PANEL))
    assert len(runs) == 3 and len(silu) == 3 * model.config.num_hidden_layers
    for a, b in zip(with_driver, without):
        assert torch.equal(a, b)


@needs_kernel
def test_a_wide_one_row_prefill_runs_in_the_c_loop_only_where_it_applies(monkeypatch):
    """17-64 tokens on one row: through the tree attention in the C loop when the loop takes the
    step, else torch's attention in the Python loop as before; the two agree to rounding."""
    model = _panel_llama()
    runs, real_run = [], layer_driver.run
    monkeypatch.setattr(layer_driver, "run", lambda *a: runs.append(a[-1]) or real_run(*a))
    prompt = [(7 * j + 3) % 500 for j in range(ta.MAX_WIDTH_C_LOOP)]
    last, _ = ModelRunner(model, 1, 96, kernel_plan=PANEL).prefill(torch.tensor([0]), [prompt])
    assert len(runs) == 1 and runs[0].visible.shape == (len(prompt), len(prompt))  # the queries of one row
    longer = ModelRunner(model, 1, 96, kernel_plan=ck.KernelPlan(points=(96,), kernels=("panel",)))
    longer.prefill(torch.tensor([0]), [prompt + [5]])
    assert len(runs) == 1  # one token past the C loop's width: torch's attention in the Python loop
    monkeypatch.setattr(layer_driver, "applies", lambda plan, tokens: False)  # a loop the C loop declines
    python, _ = ModelRunner(model, 1, 96, kernel_plan=PANEL).prefill(torch.tensor([0]), [prompt])
    assert len(runs) == 1
    torch.testing.assert_close(last, python, rtol=1e-4, atol=1e-4)


@needs_kernel
def test_the_driver_fills_the_cache_as_the_python_loop_does(monkeypatch):
    model = _panel_llama()
    caches = []
    for use in (True, False):
        if not use:
            monkeypatch.setattr(layer_driver, "applies", lambda plan, tokens: False)
        runner = ModelRunner(model, 2, 64, kernel_plan=PANEL)
        runner.prefill(torch.tensor([1]), [[3, 1, 4, 1, 5]])
        runner.verify(torch.tensor([1]), torch.tensor([[9, 2, 6]]), torch.tensor([0, 1, 1]),
                      torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))
        runner.compact(torch.tensor([1]), [torch.tensor([0, 2])])
        caches.append([(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers])
    for (k1, v1), (k2, v2) in zip(*caches):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert k1[1, :, :7].abs().sum() > 0 and k1[0].abs().sum() == 0  # row 1's slots written, row 0 untouched


def test_applies_only_where_every_linear_runs_the_panel_gemm_on_the_real_rows():
    assert not layer_driver.applies(None, 1)
    mixed = ck.KernelPlan(points=(2, 16, 64), kernels=("mkl_nt", "panel", "torch"))
    assert not layer_driver.applies(mixed, 2)
    assert layer_driver.applies(mixed, 3) and layer_driver.applies(mixed, 16)
    assert not layer_driver.applies(mixed, 17)
    assert not layer_driver.applies(mixed, 65)  # past the last point: torch's kernel
    padded = ck.KernelPlan(points=(8, 16), kernels=("panel", "panel"), rows=(8, 16))
    assert layer_driver.applies(padded, 8)
    padded = ck.KernelPlan(points=(8, 16), kernels=("panel", "panel"), rows=(16, 16))
    assert not layer_driver.applies(padded, 5)  # runs 16 rows, not 5


@needs_kernel
def test_prepare_declines_layers_it_does_not_compute():
    runner = ModelRunner(_panel_llama(), 1, 32, kernel_plan=PANEL)
    inner = runner.model.model
    assert layer_driver.prepare(list(inner.layers), inner.norm, runner.cache) is not None
    unfused = _panel_llama(fuse=False)
    assert layer_driver.prepare(list(unfused.model.layers), unfused.model.norm, runner.cache) is None
    biased = _panel_llama()
    biased.model.layers[1].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    assert layer_driver.prepare(list(biased.model.layers), biased.model.norm, runner.cache) is None
    eps = _panel_llama()
    eps.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-3
    assert layer_driver.prepare(list(eps.model.layers), eps.model.norm, runner.cache) is None
    hooked = _panel_llama()  # tensor parallelism all-reduces after o_proj and down_proj with hooks
    hooked.model.layers[1].mlp.down_proj.register_forward_hook(lambda module, args, out: out)
    assert layer_driver.prepare(list(hooked.model.layers), hooked.model.norm, runner.cache) is None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        assert layer_driver.prepare(list(inner.layers), inner.norm, runner.cache) is None
    finally:
        handle.remove()
    assert layer_driver.prepare(list(inner.layers), inner.norm, runner.cache) is not None


def test_switched_off_the_python_loop_runs(monkeypatch):
    monkeypatch.setattr(layer_driver.KERNEL, "tried", False)
    monkeypatch.setattr(layer_driver.KERNEL, "lib", None)
    monkeypatch.setenv("TR_SERVE_LAYER_DRIVER", "0")
    assert layer_driver.KERNEL.get() is None
    runner = ModelRunner(_panel_llama(), 1, 32, kernel_plan=PANEL)
    inner = runner.model.model
    assert layer_driver.prepare(list(inner.layers), inner.norm, runner.cache) is None
    runner.prefill(torch.tensor([0]), [[1, 2, 3]])
    assert runner.verify(torch.tensor([0]), torch.tensor([[4]]), torch.tensor([0]),
                         torch.ones(1, 1, dtype=torch.bool)).shape == (1, 1, 512)


@needs_kernel
def test_weights_packed_again_are_prepared_again(monkeypatch):
    model = _panel_llama()
    prepared = []
    real = layer_driver.prepare
    monkeypatch.setattr(layer_driver, "prepare", lambda *a: prepared.append(1) or real(*a))
    runner = ModelRunner(model, 1, 32, kernel_plan=PANEL)
    runner.prefill(torch.tensor([0]), [[1, 2, 3]])
    step = (torch.tensor([0]), torch.tensor([[4]]), torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))
    first = runner.verify(*step)
    runner.verify(*step)
    assert len(prepared) == 1  # once per cache
    calls = ck.kernel_calls(model)
    ck.unpack(calls, "panel")
    for m in calls:  # new weights, packed again: the driver must address the new panels
        m.weight.mul_(0.5)
    ck.pack(calls, "panel")
    changed = runner.verify(*step)
    assert len(prepared) == 2 and not torch.equal(changed, first)
    monkeypatch.setattr(layer_driver, "applies", lambda plan, tokens: False)
    assert torch.equal(runner.verify(*step), changed)  # the Python loop over the same new panels
