"""The compact decoder's runner (runner/decoder_runner.py): lossless through the engine on the
embedded model, its buckets, and one compiled graph per bucket."""

from __future__ import annotations

import pytest
import torch

from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.engine.prompt import encode_prompt
from tr_serve.runner.decoder_runner import DecoderRunner, bucket, token_bucket
from tr_serve.runner.sync_audit import AUDIT_DEVICE
from tr_serve.sampling_params import SamplingParams

QUESTIONS = ["Explain what a hash table is and how collisions are handled.", "What is TCP?",
             "Write a Python function that reverses a list."]


def _prompts(loaded) -> list[list[int]]:
    if loaded.model.config.vocab_size < 1000:  # the tiny model: ids it has, one prompt repeating itself
        return [[(7 * i + j % (5 + i)) % 400 + 3 for j in range(12 + 9 * i)] for i in range(len(QUESTIONS))]
    return [encode_prompt(loaded.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def _outputs(loaded, n: int = 40, **kw) -> dict[str, list[int]]:
    engine = Engine(loaded, EngineConfig(model=loaded.model_id, max_num_seqs=4, max_model_len=512, **kw))
    for i, prompt in enumerate(_prompts(loaded)):
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), f"g{i}")
        engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=7), f"s{i}")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert isinstance(engine.runner, DecoderRunner) == (kw.get("decoder") == "compact")
    return done


def test_bucket_example():
    assert bucket(5, 64) == 8 and bucket(33, 40) == 40 and bucket(0, 64, 8) == 8 and bucket(1, 1) == 1
    assert [token_bucket(n, None) for n in (1, 2, 3, 4, 5, 7, 9, 13, 81, 97)] == [1, 2, 3, 4, 6, 8, 12, 16, 96, 128]
    assert token_bucket(81, 90) == 90 and token_bucket(0, None, 8) == 8
    with pytest.raises(ValueError):
        bucket(9, 8)


@pytest.mark.parametrize("tree", ["none", "2.2.2", "auto"])
def test_the_compact_decoder_decodes_as_plain_decoding_greedy_and_sampled(loaded, tree):
    plain = _outputs(loaded, tree="none")
    got = _outputs(loaded, tree=tree, decoder="compact")
    assert got == plain


def test_the_compiled_step_is_one_graph_per_bucket_with_no_recompile_after_warm_up(tokenizer):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    loaded = tiny_loaded(tokenizer)
    plain = _outputs(loaded, n=12, tree="none")
    dynamo.reset()
    counters.clear()
    engine = Engine(loaded, EngineConfig(model=loaded.model_id, max_num_seqs=4, max_model_len=512, tree="2.2.2",
                                         decoder="compact", compile=True))
    runner = engine.runner
    assert isinstance(runner, DecoderRunner) and runner.compiled

    def serve() -> dict[str, list[int]]:
        for i, prompt in enumerate(_prompts(loaded)):
            engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True), f"g{i}")
            engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=7), f"s{i}")
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return done

    assert serve() == plain
    met = len(runner._graphs)
    assert counters["stats"]["unique_graphs"] == met > 0  # one graph per step shape met
    assert serve() == plain  # a warm matrix: other acceptances, perhaps a shape not met before
    assert counters["stats"]["unique_graphs"] == len(runner._graphs) >= met  # a graph only for a new shape
    assert sum(counters["graph_break"].values()) == 0


class _Transfers(torch.overrides.TorchFunctionMode):
    """Counts copies to the stand-in device (``.to(cpu:0)``) and back (``.cpu()``) inside it."""

    def __init__(self):
        super().__init__()
        self.to_device = self.to_host = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and any(a == AUDIT_DEVICE for a in (*args[1:], kwargs.get("device"))):
            self.to_device += 1
        if func is torch.Tensor.cpu:
            self.to_host += 1
        return func(*args, **kwargs)


def test_a_step_copies_its_inputs_in_once_and_its_ids_out_once(tokenizer):
    from tr_serve.model.decoder import from_hf
    from tr_serve.runner.step_io import StepSampling

    loaded = tiny_loaded(tokenizer)
    runner = DecoderRunner(from_hf(loaded.model, max_positions=64), num_rows=2, max_len=64, device=AUDIT_DEVICE)
    sampling = StepSampling((None, None), recycle_k=4)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    rows = torch.tensor([0, 1])
    counts = []
    for step in range(3):
        with _Transfers() as seen:
            if step == 0:
                out = runner.prefill_step(rows, [[5, 6, 7], [8, 9]], sampling).last
            else:
                out = runner.verify_step(rows, torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]]),
                                         torch.tensor([0, 1, 1, 2]), tree, None, sampling)
        counts.append((seen.to_device, seen.to_host))
        runner.compact(rows, [torch.tensor([0, 2]), torch.tensor([0, 1, 3])]) if step else None
        assert out.top_k.shape[1] == 4
    assert counts == [(1, 1)] * 3
    assert runner.steps == 3 and any(shape.moves for shape in runner._graphs)  # the last step carried moves


def test_auto_takes_the_compact_decoder_on_cuda_for_a_family_it_serves(tokenizer, monkeypatch):
    from tr_serve.runner import factory

    loaded = tiny_loaded(tokenizer)
    built = []
    monkeypatch.setattr(factory, "DecoderRunner", lambda *a, **kw: built.append("compact") or "compact")
    monkeypatch.setattr(factory, "ModelRunner", lambda *a, **kw: built.append("transformers") or "transformers")
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: cuda))  # a model "on CUDA"
    monkeypatch.setattr(factory, "from_hf", lambda model, max_positions, **parallel: None)
    monkeypatch.setattr(factory, "select_plan", lambda model: None)
    assert factory.local_runner(loaded.model, 64, 2, decoder="auto") == "compact"
    loaded.model.config.model_type = "gpt_neox"  # a family the compact decoder does not serve
    assert factory.local_runner(loaded.model, 64, 2, decoder="auto") == "transformers"
    assert factory.local_runner(loaded.model, 64, 2, decoder="transformers") == "transformers"


def test_a_prefill_seeding_every_position_picks_more_outputs_than_its_bucket_holds(tokenizer):
    """A full bucket of prompt tokens (1 row x 8) seeded at every position picks 9 outputs (the
    last position twice): each is the step's, equal to picking them alone."""
    from tr_serve.model.decoder import from_hf
    from tr_serve.runner.step_io import StepSampling

    loaded = tiny_loaded(tokenizer)
    runner = DecoderRunner(from_hf(loaded.model, max_positions=64), num_rows=1, max_len=64)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    out = runner.prefill_step(torch.tensor([0]), [prompt], StepSampling((None,), recycle_k=4),
                              seed_positions=[list(range(8))])
    assert out.seeds is not None and out.seeds[0].shape == (8, 4)
    runner.free(0)
    alone = runner.prefill_step(torch.tensor([0]), [prompt], StepSampling((None,), recycle_k=4))
    assert torch.equal(out.seeds[0][-1], alone.last.top_k[0]) and torch.equal(out.last.top_k, alone.last.top_k)


def test_a_tensor_parallel_shard_is_refused_compile(tokenizer):
    """The ranks' compact decoder runs eagerly: compile on a shard is an error, not a silent eager run."""
    from tr_serve.runner.factory import local_runner
    from tr_serve.tp.shard import shard_model

    loaded = tiny_loaded(tokenizer)
    shard = shard_model(loaded.model, 0, 2, reduce=False)
    with pytest.raises(ValueError, match="tensor parallelism"):
        local_runner(shard, 64, 2, decoder="compact", compile=True)
    assert isinstance(local_runner(shard, 64, 2, decoder="compact"), DecoderRunner)


def test_a_step_that_does_not_compile_is_an_error_naming_its_bucket(tokenizer, monkeypatch):
    """No silent eager fallback: the compile's failure surfaces at the bucket's first step, named."""
    from tr_serve.model.decoder import from_hf
    from tr_serve.runner.decoder_runner import StepCompileError
    from tr_serve.runner.step_io import StepSampling

    def broken_backend(fn, **options):
        def call(*args):
            raise RuntimeError("the backend failed")
        return call

    loaded = tiny_loaded(tokenizer)
    runner = DecoderRunner(from_hf(loaded.model, max_positions=64), num_rows=2, max_len=64, compile=True)
    monkeypatch.setattr(torch, "compile", broken_backend)
    with pytest.raises(StepCompileError, match=r"bucket StepShape\(rows=1, queries=3.*the backend failed"):
        runner.prefill_step(torch.tensor([0]), [[5, 6, 7]], StepSampling((None,), recycle_k=4))
    assert runner._graphs == {}  # the next step tries again rather than running anything else
