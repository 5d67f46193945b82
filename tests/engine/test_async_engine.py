"""The async engine under churn: requests arrive over time, a third are cancelled mid-stream,
none is lost or stuck, and every KV row is free at the end."""

from __future__ import annotations

import asyncio
import random

import pytest

from tiny_model import tiny_loaded
from tr_serve.engine.async_engine import AsyncEngine
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.engine.errors import PromptTooLongError
from tr_serve.sampling_params import SamplingParams


@pytest.fixture
def async_engine(tokenizer):
    engine = AsyncEngine(Engine(tiny_loaded(tokenizer), EngineConfig(model="tiny", tree="top8", max_num_seqs=6,
                                                                     max_model_len=128, max_num_batched_tokens=32)))
    yield engine
    engine.shutdown()


def test_32_requests_with_a_third_cancelled(async_engine):
    rng = random.Random(0)

    async def client(i: int):
        await asyncio.sleep(rng.uniform(0, 2.0))
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(5, 80))]
        cancel_after = 3 if i % 3 == 0 else None
        chunks, last = 0, None
        async for out in async_engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True), f"r{i}"):
            chunks += 1
            last = out
            if cancel_after is not None and chunks >= cancel_after:
                return "cancelled", last
        return "finished", last

    async def main():
        return await asyncio.wait_for(asyncio.gather(*[client(i) for i in range(32)]), timeout=300)

    results = asyncio.run(main())
    finished = [r for kind, r in results if kind == "finished"]
    assert len(finished) == 32 - len(range(0, 32, 3))
    assert all(r.finished and len(r.token_ids) == 24 for r in finished)
    # cancelled requests are retired at the next step: wait for the loop to go idle
    for _ in range(100):
        if async_engine.num_running == 0 and async_engine.num_waiting == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    stats = async_engine.stats()
    assert stats["kv_rows_used"] == 0 and stats["running"] == 0 and stats["waiting"] == 0
    assert async_engine.alive


def test_streamed_deltas_add_up_and_prompt_too_long_fails_at_once(async_engine):
    async def main():
        text, final = "", None
        async for out in async_engine.generate(list(range(10, 30)), SamplingParams(max_tokens=12), "a"):
            text += out.new_text
            final = out
        with pytest.raises(PromptTooLongError):
            async for _ in async_engine.generate(list(range(3, 200)), SamplingParams(max_tokens=4), "b"):
                pass
        return text, final

    text, final = asyncio.run(main())
    assert text == final.text


def test_call_between_steps_runs_on_the_step_thread(async_engine):
    import threading

    async def main():
        name = await async_engine.call_between_steps(lambda engine: threading.current_thread().name)
        with pytest.raises(ZeroDivisionError):
            await async_engine.call_between_steps(lambda engine: 1 / 0)
        return name

    assert asyncio.run(main()) == "tr-serve-engine"
    assert async_engine.alive
