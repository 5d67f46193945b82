"""The replica's one ``Engine`` over a ``TPModelRunner`` (tensor-parallel Ray actor workers) on a
local Ray instance gives the single-process engine's greedy tokens: a tiny random Llama at world
size 2 and 3 (fixed and cost-aware tree budgets, online latency on), and the embedded SmolLM2-135M
(9 heads, 3 kv heads) at world size 3 on Spec-Bench dev questions. The ranks' KV-cache lengths
follow the driver's mirror. A dead worker fails the next step and the health check."""

from __future__ import annotations

import copy
import sys
import time

import pytest

from tp_testutil import PROMPTS, assert_same_or_near_tie, dev_questions, run, tiny
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.engine.prompt import encode_prompt
from tr_serve.sampling_params import SamplingParams


@pytest.mark.parametrize("world, budget", [(2, "fixed"), (3, "auto")])
def test_tiny_model_matches_unsharded(ray_tp, tokenizer, world, budget):
    from tr_serve.tp.runner import TPModelRunner, TPWorkerError, tp_engine

    loaded = tiny(tokenizer, f"tiny-tp-test-{world}")
    config = EngineConfig(tree="top4", max_num_seqs=4, max_model_len=512, budget=budget)
    want, _, _ = run(Engine(copy.deepcopy(loaded), config), PROMPTS, 24)
    engine = tp_engine(loaded, config, world, cpu_threads=1)
    runner = engine.runner
    try:
        assert type(engine) is Engine and isinstance(runner, TPModelRunner)  # the ordinary engine
        assert runner.info["kv_heads_per_rank"] == 6 // world and runner.info["heads_per_rank"] == 12 // world
        assert engine.matrix is not None and engine.config.online_latency  # nothing is switched off under TP
        if budget == "auto":  # the budget's latency table was measured through the TP runner
            assert engine.speculator.drafter.budget.latency is not None
        # a sampled request without a seed: drawn once, on the replica
        got, done, _ = run(engine, PROMPTS, 24, extra={"sampled": SamplingParams(max_tokens=24, temperature=1.0)})
        assert got == want
        assert len(done["sampled"]) == 24
        assert runner.transfer.messages == 2 * world * runner.transfer.forwards  # one call + reply per rank
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request([1, 2], SamplingParams(), request_id="x")
            engine.add_request([1, 2], SamplingParams(), request_id="x")
        engine.abort("x")
        engine.step()
        assert not engine.has_unfinished()
        runner.check_health()
        import ray

        if world == 2:  # a dead worker: the health check and the next step fail, naming it
            ray.kill(runner.workers[1])
            _wait_until_dead(runner.workers[1])  # ray.kill is asynchronous: a ping can still be answered
            with pytest.raises(TPWorkerError, match=r"tr_tp_worker:.*:1 is dead"):
                runner.check_health()
            engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), request_id="after-kill")
            t0 = time.monotonic()
            with pytest.raises(TPWorkerError, match=r"tr_tp_worker:.*:1 failed in step"):
                engine.step()
            assert time.monotonic() - t0 < 30
        else:  # a hung worker (both of its call slots busy): a ping and then the step time out
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            runner.step_timeout_s, runner.ping_timeout_s = 3.0, 1.0
            for _ in range(2):
                runner.workers[1].call.remote(lambda _worker: time.sleep(60))
            time.sleep(0.5)
            with pytest.raises(TPWorkerError, match=r"tr_tp_worker:.*:1.*did not answer a ping"):
                runner.check_health()
            engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), request_id="after-hang")
            with pytest.raises(TPWorkerError, match=r"step timed out after 3 s; no answer from .*tr_tp_worker:.*:1"):
                engine.step()
        assert not runner.alive
        with pytest.raises(TPWorkerError, match="runner is dead"):
            runner.check_health()
        with pytest.raises(TPWorkerError, match="runner is dead"):
            engine.step()
    finally:
        runner.shutdown()


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError("the killed worker still answers pings")


def test_smollm2_tp3_matches_single_process(ray_tp, loaded):
    """4 dev questions, 32 new tokens, tree top4: same greedy tokens as ``Engine`` (a difference
    only at a near-tie of the unsharded model)."""
    from tr_serve.tp.runner import tp_engine

    prompts = [encode_prompt(loaded.tokenizer, [{"role": "user", "content": q["turns"][0]}])
               for q in dev_questions(4)]
    config = EngineConfig(model="smollm2-135m-instruct", tree="top4", max_num_seqs=4, max_model_len=1024)
    want, _, _ = run(Engine(loaded, config), prompts, 32)
    engine = tp_engine("smollm2-135m-instruct", config, 3, cpu_threads=1)
    try:
        assert (engine.runner.info["heads_per_rank"], engine.runner.info["kv_heads_per_rank"]) == (3, 1)
        got, _, _ = run(engine, prompts, 32)
    finally:
        engine.runner.shutdown()
    for i, (p, g, w) in enumerate(zip(prompts, got, want)):
        assert len(g) == len(w) == 32
        assert_same_or_near_tie(loaded.model, p, g, w, f"dev question {i}")


@pytest.mark.parametrize("tree", ["none", "2.2.2"])
def test_the_compact_decoder_over_two_ranks_decodes_as_one_process(ray_tp, tokenizer, tree):
    """decoder: compact on every rank of a 2-way split (its heads, kv heads and MLP slice fused,
    2 all-reduces a layer over gloo, each rank half of the LM head): the single-process compact
    engine's tokens, greedy and seeded sampled, and plain decoding's under TR."""
    from tr_serve.runner.decoder_runner import DecoderRunner
    from tr_serve.tp.runner import tp_engine

    loaded = tiny(tokenizer, f"tiny-tp-compact-{tree}")
    config = EngineConfig(tree=tree, max_num_seqs=4, max_model_len=512, budget="fixed", decoder="compact")
    sampled = {"s": SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)}
    alone = Engine(copy.deepcopy(loaded), config)
    assert isinstance(alone.runner, DecoderRunner)
    want, want_done, _ = run(alone, PROMPTS, 24, extra=sampled)
    plain, _, _ = run(Engine(copy.deepcopy(loaded), EngineConfig(tree="none", max_num_seqs=4, max_model_len=512,
                                                                 decoder="compact")), PROMPTS, 24)
    engine = tp_engine(loaded, config, 2, cpu_threads=1)
    try:
        import ray

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        assert ray.get([w.call.remote(_runner_type) for w in engine.runner.workers]) == ["DecoderRunner"] * 2
        # each rank computes its half of the LM head (model/vocab_parallel.py)
        assert ray.get([w.call.remote(_vocab_slice) for w in engine.runner.workers]) == [(0, 256), (256, 512)]
        got, done, _ = run(engine, PROMPTS, 24, extra=sampled)
        for i, prompt in enumerate(PROMPTS):
            assert_same_or_near_tie(loaded.model, prompt, got[i], want[i], f"prompt {i}")
        assert_same_or_near_tie(loaded.model, PROMPTS[0], done["s"], want_done["s"], "sampled")
        assert want == plain
        # prefix caching on the ranks: a next turn finds its row in place, a prompt beside it copies
        # from that running row; the ranks' lengths follow the driver's (run checks them)
        first, _, _ = run(engine, [PROMPTS[2]], 16)
        turns = [PROMPTS[2] + first[0] + [7, 8], PROMPTS[2][:40] + [1, 2, 3]]
        hits = engine.load().prefix_cache_hits
        again, _, _ = run(engine, turns, 16)
        assert engine.load().prefix_cache_hits - hits == 64 + 32  # 75 tokens of KV in place; 2 blocks copied
        uncached, _, _ = run(Engine(copy.deepcopy(loaded), EngineConfig(tree="none", max_num_seqs=4, max_model_len=512,
                                                                        decoder="compact", enable_prefix_caching=False)),
                             turns, 16)
        assert again == uncached
    finally:
        engine.runner.shutdown()


def _runner_type(worker) -> str:
    return type(worker.runner).__name__


def _vocab_slice(worker) -> tuple[int, int]:
    shard = worker.runner.decoder.vocab_shard
    return shard.start, shard.stop
