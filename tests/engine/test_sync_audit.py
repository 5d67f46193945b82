"""One forced device-to-host synchronisation per forward (runner/sync_audit.py): a step's
verification, and beside it a prefill chunk when a prompt is pending (a mixed step).

The runner runs on the audit's stand-in accelerator (``cpu:0``) with torch's kernels, the path a
GPU takes; every step of a whole generation is counted, prefill steps included, greedy and
sampled, at 1 and 32 rows, for plain decoding, the paper's tree, its hybrid and ``auto``.
(Under tensor parallelism the same count is taken in the workers: tests/tp/test_tp_step_ids.py.)"""

from __future__ import annotations

import pytest
import torch

from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.model.decoder import from_hf
from tr_serve.runner.decoder_runner import DecoderRunner
from tr_serve.runner.model_runner import ModelRunner
from tr_serve.runner.sync_audit import AUDIT_DEVICE, DeviceTensor, SyncAudit
from tr_serve.sampling_params import SamplingParams

ROWS = 32


def test_the_audit_counts_what_waits_for_the_device_and_nothing_on_the_host():
    with SyncAudit() as audit:
        x = torch.arange(6, device=AUDIT_DEVICE)
        assert isinstance(x, DeviceTensor) and isinstance(x * 2 + 1, DeviceTensor)
        host = torch.arange(6)
        host.tolist(), int(host[0]), bool(host.any()), host[host > 2]  # host tensors: free
        assert audit.count == 0
        x.tolist()
        int(x[0])
        bool((x > 3).any())
        x[x > 2]  # a boolean mask on the device: a nonzero in disguise
        x.nonzero()
        y = x.cpu()
        assert [name for name, _ in audit.events] == ["tolist", "__int__", "__bool__", "__getitem__", "nonzero",
                                                      "cpu"]
        assert not isinstance(y, DeviceTensor)  # on the host now: reading it costs nothing more
        y.tolist()
        x.index_select(0, torch.tensor([1, 2]).to(AUDIT_DEVICE))  # indices from the host: no wait
        assert audit.count == 6


@pytest.mark.parametrize("decoder", ["transformers", "compact"])
@pytest.mark.parametrize("tree", ["none", "2.2.2", "2.2.2+ctx", "auto"])
@pytest.mark.parametrize("rows", [1, ROWS])
def test_one_sync_per_engine_step(tokenizer, tmp_path, monkeypatch, tree, rows, decoder):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    loaded = tiny_loaded(tokenizer, seed=2)

    def runner(max_len: int):
        if decoder == "compact":  # runner/decoder_runner.py: its weights, then its cache on the device
            return DecoderRunner(from_hf(loaded.model, max_positions=max_len), ROWS, max_len, device=AUDIT_DEVICE)
        return ModelRunner(loaded.model, ROWS, max_len, tree_attention_enabled=False, device=AUDIT_DEVICE)

    audit = SyncAudit()
    with audit:  # the KV cache is made on the audited device
        engine = Engine(loaded, EngineConfig(model="tiny", tree=tree, budget="auto" if tree == "auto" else "fixed",
                                             max_num_seqs=ROWS, max_model_len=128, cpu_kernels="torch",
                                             matrix_prior=False, max_num_batched_tokens=64), runner=runner)
    for i in range(rows):
        params = (SamplingParams(max_tokens=10, ignore_eos=True) if i % 2 == 0 else  # greedy and sampled rows
                  SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True))
        engine.add_request([5 + i, 77, 300, 12, 5 + i, 77], params)
    per_step, forwards, events = [], [], []
    with audit:
        while engine.has_unfinished():
            audit.reset()
            before = engine.runner.forwards
            engine.step()
            per_step.append(audit.count)
            forwards.append(engine.runner.forwards - before)
            events += audit.events
    # every forward copies its ids back (the audit sees the device), and nothing else waits for it
    assert per_step == forwards, [e for e in events if e[0] != "cpu"]
    assert max(forwards) <= 2 and (rows == 1 or 2 in forwards)  # 32 prompts: mixed steps
    assert {name for name, _ in events} == {"cpu"}
