"""The compact decoder's runner (runner/decoder_runner.py): lossless through the engine on the
embedded model, its buckets, and one compiled graph per bucket."""

from __future__ import annotations

import pytest
import torch

from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.engine.prompt import encode_prompt
from tr_serve.runner.decoder_runner import DecoderRunner, bucket
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
