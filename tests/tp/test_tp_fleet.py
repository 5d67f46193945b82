"""Fleet sync under tensor parallelism: the TP replica's engine is the ordinary ``Engine`` (its matrix
on the replica), so ``MatrixSync`` pushes and adopts exactly as without TP. A TP replica pushes its
rows to a real matrix actor; a fresh TP replica adopts the fleet's matrix and still gives the
single-process engine's greedy tokens."""

from __future__ import annotations

import asyncio
import copy
import uuid

from tp_testutil import PROMPTS, run, tiny
from tr_serve.engine.async_engine import AsyncEngine
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.fleet import FleetSyncConfig
from tr_serve.sampling_params import SamplingParams


async def answer(engine: AsyncEngine, prompts, max_tokens: int, tag: str) -> list[list[int]]:
    async def one(i, p):
        last = None
        async for out in engine.generate(list(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"{tag}{i}"):
            last = out
        return list(last.token_ids)

    return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])


def test_tp_replicas_push_and_adopt_the_fleet_matrix(ray_tp, tokenizer, tmp_path):
    from tr_serve.fleet.actor import get_actor
    from tr_serve.fleet.sync import MatrixSync
    from tr_serve.tp.runner import tp_engine

    loaded = tiny(tokenizer, "tiny-tp-fleet")
    config = EngineConfig(tree="top4", max_num_seqs=4, max_model_len=512)
    want, _, _ = run(Engine(copy.deepcopy(loaded), config), PROMPTS, 24)
    fleet = FleetSyncConfig(enabled=True, namespace=f"tp-{uuid.uuid4().hex[:8]}", snapshot_dir=str(tmp_path),
                            sync_interval_s=0.5, snapshot_interval_s=3600)

    async def main():
        # replica A: answers, pushes its recycled rows
        a = AsyncEngine(tp_engine(loaded, config, 2, cpu_threads=1))
        try:
            sync_a = MatrixSync(a, fleet, model_id=loaded.model_id, replica_id="A")
            sync_a.start()
            assert await answer(a, PROMPTS[:2], 24, "a") == want[:2]
            flushed = await sync_a.flush()
            assert flushed["error"] is None, flushed
            await sync_a.stop(final_push=False)
            a_rows = int(a.engine.matrix.num_filled_rows())
            assert sync_a.rows_pushed >= a_rows > 0
        finally:
            a.shutdown()
            a.engine.runner.shutdown()
        info = await get_actor(loaded.model_id, fleet.namespace).info.remote()
        assert info["filled_rows"] == a_rows

        # a fresh replica B: adopts the fleet's matrix before its first request, keeps syncing,
        # and its tokens are still the single-process engine's
        b = AsyncEngine(tp_engine(loaded, config, 2, cpu_threads=1))
        try:
            assert b.engine.matrix.num_filled_rows() == 0
            sync_b = MatrixSync(b, fleet, model_id=loaded.model_id, replica_id="B")
            first = await sync_b.sync_once()
            assert first["error"] is None and sync_b.adoptions == 1, first
            assert int(b.engine.matrix.num_filled_rows()) == a_rows
            sync_b.start()
            assert await answer(b, PROMPTS, 24, "b") == want
            await sync_b.stop(final_push=True)
            assert sync_b.errors == 0
        finally:
            b.shutdown()
            b.engine.runner.shutdown()

    asyncio.run(main())
