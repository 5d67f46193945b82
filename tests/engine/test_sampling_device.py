"""The sampling path stays on the model's device: its generators, the tensors it computes and the
factories it calls (on CUDA, a CPU generator makes ``torch.multinomial`` raise on the logits).

On a CPU-only machine every tensor is on the CPU anyway, so the checks are about what the code asks
for: the generator is requested for the runner's device (a fake CUDA device stands in for it), no
tensor is moved off its device (``.cpu()`` / ``.to()``), every factory names its device, and a host
tensor is created only for the walk's results (index lists the KV compaction reads on the host)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import tr_serve.tr.verifier as verifier_module
from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.sampling_params import SamplingParams

FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.full, torch.zeros, torch.ones, torch.empty,
             torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace, torch.scalar_tensor}
TRANSFERS = {torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.to}


class DeviceAudit(TorchFunctionMode):
    """Records every torch call made while active: factories and their ``device`` argument,
    transfers, and the device of every tensor produced."""

    def __init__(self):
        super().__init__()
        self.factories: list[tuple[str, object, object]] = []  # (name, device kwarg, data)
        self.transfers: list[str] = []
        self.outputs: list[tuple[str, torch.device]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", None) or repr(func)
        if func in FACTORIES:
            self.factories.append((name, kwargs.get("device"), args[0] if args else None))
        if func in TRANSFERS:
            self.transfers.append(name)
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and func not in FACTORIES:
                self.outputs.append((name, leaf.device))
        return out


def _engine(tokenizer, tmp_path, monkeypatch) -> Engine:
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    return Engine(tiny_loaded(tokenizer, seed=3), EngineConfig(model="tiny", tree="top4", max_num_seqs=2,
                                                                max_model_len=64))


def test_generator_is_requested_on_the_runner_device(tokenizer, tmp_path, monkeypatch):
    engine = _engine(tokenizer, tmp_path, monkeypatch)
    fake_device = torch.device("cuda", 3)  # stands in for the GPU the runner's model lives on
    requested = []
    real_generator = torch.Generator

    class RecordingGenerator:
        def __init__(self, device=None):
            requested.append(device)
            self._gen = real_generator()

        def manual_seed(self, seed):
            self._gen.manual_seed(seed)
            return self

    monkeypatch.setattr(engine.runner, "device", fake_device)
    with monkeypatch.context() as m:
        m.setattr(torch, "Generator", RecordingGenerator)
        engine.add_request([5, 77, 300, 12], SamplingParams(max_tokens=4, temperature=0.8, seed=1))
        engine.add_request([5, 77, 300, 13], SamplingParams(max_tokens=4))  # greedy: no generator
    assert requested == [fake_device]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (20, 0.9)])
def test_every_tensor_of_the_sampling_path_stays_on_the_device(tokenizer, tmp_path, monkeypatch, top_k, top_p):
    engine = _engine(tokenizer, tmp_path, monkeypatch)
    device = engine.runner.device
    audits = {"first": [], "walk": []}
    generators = []

    real_first = engine._first_token

    def first_token(req, logits):
        generators.append((req.generator.device, logits.device))
        with DeviceAudit() as audit:
            token = real_first(req, logits)
        audits["first"].append(audit)
        return token

    real_walk = verifier_module.walk_tree

    def walk_tree(draft, logits, tree, temperature, top_k, top_p, generator):
        generators.append((generator.device, logits.device))
        with DeviceAudit() as audit:
            nodes, emitted = real_walk(draft, logits, tree, temperature, top_k, top_p, generator)
        audits["walk"].append((audit, nodes, emitted))
        return nodes, emitted

    monkeypatch.setattr(engine, "_first_token", first_token)
    monkeypatch.setattr(verifier_module, "walk_tree", walk_tree)
    for i in range(2):
        engine.add_request([5 + i, 77, 300, 12], SamplingParams(max_tokens=8, temperature=0.9, top_k=top_k,
                                                                top_p=top_p, seed=11 + i))
    while engine.has_unfinished():
        engine.step()

    assert audits["first"] and audits["walk"], "the sampling path did not run"
    assert all(g == logit_device == device for g, logit_device in generators)
    for audit in audits["first"]:
        assert audit.transfers == []
        assert audit.factories == []
        assert audit.outputs and all(d == device for _, d in audit.outputs)
    for audit, nodes, emitted in audits["walk"]:
        assert audit.transfers == []
        assert audit.outputs and all(d == device for _, d in audit.outputs), audit.outputs
        # the only factories: the walk's two host results, built from the drawn ints with device="cpu"
        assert [(name, str(dev)) for name, dev, _ in audit.factories] == [("tensor", "cpu"), ("tensor", "cpu")]
        assert [data for _, _, data in audit.factories] == [nodes.tolist(), emitted.tolist()]
        assert all(isinstance(x, int) for _, _, data in audit.factories for x in data)
