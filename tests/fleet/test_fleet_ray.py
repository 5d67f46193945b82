"""The fleet matrix on a local Ray instance: a real matrix actor and replica-side ``MatrixSync``s,
each wrapping a real engine (``AsyncEngine`` over ``Engine``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import re
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

os.environ.update({"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"})  # before ray starts

from tiny_model import tiny_loaded  # noqa: E402
from tr_serve.engine.async_engine import AsyncEngine  # noqa: E402
from tr_serve.engine.config import EngineConfig  # noqa: E402
from tr_serve.engine.engine import Engine  # noqa: E402
from tr_serve.engine.prompt import encode_prompt  # noqa: E402
from tr_serve.fleet import FleetSyncConfig  # noqa: E402
from tr_serve.fleet.actor import get_actor, stop_matrix_actor  # noqa: E402
from tr_serve.fleet.corpus_file import PREFIX as CORPUS_PREFIX  # noqa: E402
from tr_serve.fleet.snapshot import snapshot_files  # noqa: E402
from tr_serve.fleet.sync import MatrixSync  # noqa: E402
from tr_serve.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def fleet_config(tmp_path, **kw) -> FleetSyncConfig:
    base = dict(enabled=True, namespace=f"t{uuid.uuid4().hex[:8]}", snapshot_dir=str(tmp_path / "snaps"))
    base.update(kw)
    return FleetSyncConfig(**base)


async def generate(engine: AsyncEngine, prompt_ids, max_tokens: int, request_id: str, ignore_eos: bool = False):
    last = None
    async for out in engine.generate(list(prompt_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                                     request_id):
        last = out
    assert last is not None and last.finished
    return last


async def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(every_s)


# ---- hot start: a replica that adopted the fleet's matrix accepts more, losslessly ------------------

WARM = ["Explain what a hash table is and when to use it.", "Describe how photosynthesis works in plants.",
        "Explain what a linked list is.", "Describe the water cycle."]
UNSEEN = ["What is a hash table? Explain it simply.", "How does photosynthesis work?"]


def test_fleet_warm_replica_beats_cold_and_outputs_are_identical(ray_local, loaded, tmp_path):
    cfg = fleet_config(tmp_path, sync_interval_s=0.5)
    tok = loaded.tokenizer

    def engine(tree: str) -> AsyncEngine:  # without the matrix prior: the fleet's warm start against an empty matrix
        return AsyncEngine(Engine(loaded, EngineConfig(tree=tree, max_num_seqs=2, max_model_len=512,
                                                       matrix_prior=False)))

    a, b, cold, plain = engine("top16"), engine("top16"), engine("top16"), engine("none")
    ids = lambda text: encode_prompt(tok, [{"role": "user", "content": text}])  # noqa: E731

    async def main():
        sync_a = MatrixSync(a, cfg, model_id=loaded.model_id, tokenizer=tok, replica_id="A")
        sync_a.start()
        # traffic through replica A only, two at a time; its background task pushes meanwhile
        for i in range(0, len(WARM), 2):
            await asyncio.gather(*[generate(a, ids(t), 32, f"warm{i + j}") for j, t in enumerate(WARM[i:i + 2])])
        flushed = await sync_a.flush()  # the last rows (under heavy load the first connect may have timed out)
        await sync_a.stop(final_push=False)
        assert flushed["error"] is None and sync_a.pushes >= 1
        actor = get_actor(loaded.model_id, cfg.namespace)
        info = await actor.info.remote()
        assert info["version"] >= 1 and info["filled_rows"] == a.engine.matrix.num_filled_rows()

        # replica B joins cold and adopts the fleet snapshot, between steps
        sync_b = MatrixSync(b, cfg, model_id=loaded.model_id, tokenizer=tok, replica_id="B")
        assert b.engine.matrix.num_filled_rows() == 0
        result = await sync_b.sync_once()
        assert result["error"] is None and result["adopted"] == info["version"] == sync_b.adopted_version
        box = await actor.snapshot.remote()
        fleet = torch.from_numpy((await box["ref"][0]).copy())
        assert torch.equal(b.engine.matrix.table, fleet)
        assert sync_b.adopt_s and sync_b.adopt_s[-1] < 0.5

        # unseen prompts: B (fleet-warm), a cold replica and plain decoding, each prompt in turn
        async def serve(engine_, tag):
            return [await generate(engine_, ids(t), 32, f"{tag}{i}") for i, t in enumerate(UNSEEN)]

        sync_b.start()
        outs_b, outs_cold, outs_plain = await asyncio.gather(serve(b, "b"), serve(cold, "c"), serve(plain, "p"))
        await sync_b.stop()
        return outs_b, outs_cold, outs_plain

    try:
        outs_b, outs_cold, outs_plain = asyncio.run(main())
    finally:
        for e in (a, b, cold, plain):
            e.shutdown()

    def mat(outs):
        return sum(sum(o.stats.accepted_per_step) for o in outs) / sum(len(o.stats.accepted_per_step) for o in outs)

    for ob, oc, op in zip(outs_b, outs_cold, outs_plain):
        assert ob.token_ids == op.token_ids  # lossless: greedy TR == plain greedy, token for token
        assert oc.token_ids == op.token_ids
    print(f"MAT fleet-warm {mat(outs_b):.3f} vs cold {mat(outs_cold):.3f}")
    assert mat(outs_b) > mat(outs_cold) * 1.05, (mat(outs_b), mat(outs_cold))


# ---- failures: actor killed mid-traffic, lost snapshot objects, foreign matrices ----------------------

def tiny_engine(tokenizer, k: int = 8, tree: str = "top8") -> AsyncEngine:
    return AsyncEngine(Engine(tiny_loaded(tokenizer), EngineConfig(model="tiny", tree=tree, k=k, max_num_seqs=4,
                                                                     max_model_len=128)))


class _Done:
    """Stands in for an ObjectRef whose value is already there."""

    def __init__(self, value):
        self.value = value

    def future(self):
        f = concurrent.futures.Future()
        f.set_result(self.value)
        return f


def test_actor_killed_mid_traffic_restarts_from_disk_and_sync_resumes(ray_local, tokenizer, tmp_path, caplog):
    cfg = fleet_config(tmp_path, sync_interval_s=0.25, snapshot_interval_s=0.5)
    a, b = tiny_engine(tokenizer), tiny_engine(tokenizer)
    model_id = "tiny-random-llama"
    rng = random.Random(0)

    async def main():
        sync_a = MatrixSync(a, cfg, model_id=model_id, tokenizer=tokenizer, replica_id="A")
        sync_b = MatrixSync(b, cfg, model_id=model_id, tokenizer=tokenizer, replica_id="B")
        sync_a.start()
        sync_b.start()
        stop = asyncio.Event()
        done: list = []

        async def traffic(engine, tag):
            i = 0
            while not stop.is_set():
                prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 24))]
                done.append(await generate(engine, prompt, 12, f"{tag}{i}", ignore_eos=True))
                i += 1

        clients = [asyncio.create_task(traffic(e, t)) for e, t in ((a, "a"), (b, "b"))]
        actor = await wait_for(lambda: asyncio.to_thread(get_actor, model_id, cfg.namespace), 30, "the actor")

        async def saved_twice():
            info = await actor.info.remote()
            return info if info["saved_version"] >= 2 and snapshot_files(info["snapshot_folder"]) else None

        # generous waits (each ends as soon as it is met): under `make test` another pytest worker
        # shares the 2 cores, and the actor's process starts (imports torch) while both engines decode
        before = await wait_for(saved_twice, 180, "two versions saved on disk")
        stale_box = await actor.snapshot.remote()
        served_before_kill = len(done)
        filled_b = b.engine.matrix.num_filled_rows()

        ray_local.kill(actor, no_restart=False)  # Ray restarts it (max_restarts=-1)

        async def restarted():
            try:
                info = await asyncio.wait_for(actor.info.remote(), 5)
            except Exception:
                return None
            return info if info["epoch"] != before["epoch"] else None

        after = await wait_for(restarted, 180, "the actor to restart")
        # it came back with the newest snapshot on disk (which is at least what it had saved before);
        # the replicas' pushes may have raised the version again before this first answer
        assert after["loaded_from"] is not None
        loaded_version = int(re.search(r"-v(\d+)\.arrow$", after["loaded_from"]).group(1))
        assert before["saved_version"] <= loaded_version <= after["version"]
        assert after["filled_rows"] > 0

        async def resumed():
            info = await actor.info.remote()
            ok = (info["version"] > after["version"] and sync_a.restarts_seen >= 1 and sync_b.restarts_seen >= 1
                  and sync_a.epoch == sync_b.epoch == after["epoch"])
            return info if ok else None

        await wait_for(resumed, 180, "sync to resume (version growing again)")
        assert len(done) > served_before_kill  # requests kept succeeding
        assert b.engine.matrix.num_filled_rows() >= filled_b  # the last good matrix was kept all along

        # a snapshot object whose owner (the killed actor) died: logged, skipped, matrix kept
        c = tiny_engine(tokenizer)
        try:
            sync_c = MatrixSync(c, cfg, model_id=model_id, tokenizer=tokenizer, replica_id="C")
            c.engine.matrix.table[5, 0] = 7
            before_c = c.engine.matrix.table.clone()
            reply = {"epoch": "old", "version": 10**6, "merged_version": 10**6, "merged": 1}
            sync_c._actor = SimpleNamespace(
                state_version=SimpleNamespace(remote=lambda: _Done(reply)),
                push=SimpleNamespace(remote=lambda *args: _Done(reply)),
                snapshot=SimpleNamespace(remote=lambda: _Done({**stale_box, "epoch": "old", "version": 10**6})))
            sync_c._epoch = "old"
            with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
                result = await sync_c.sync_once()
            assert result["error"].startswith("snapshot_lost") and "OwnerDied" in result["error"]
            assert torch.equal(c.engine.matrix.table, before_c)
            assert any("snapshot_lost" in r.getMessage() and "serving on" in r.getMessage() for r in caplog.records)
            # the next round re-resolves the real actor by name and adopts its snapshot
            result = await sync_c.sync_once()
            assert result["error"] is None and result["adopted"] is not None and sync_c.restarts_seen == 1
            assert c.engine.matrix.num_filled_rows() > 1
        finally:
            c.shutdown()

        stop.set()
        await asyncio.gather(*clients)
        await sync_a.stop()
        await sync_b.stop()
        return done

    try:
        done = asyncio.run(main())
    finally:
        a.shutdown()
        b.shutdown()
    assert all(o.finished and len(o.token_ids) == 12 for o in done)


def test_foreign_matrix_is_refused_and_stop_writes_a_final_snapshot(ray_local, tokenizer, tmp_path, caplog):
    cfg = fleet_config(tmp_path, sync_interval_s=0.25, snapshot_interval_s=3600)
    model_id = "tiny-random-llama"
    a = tiny_engine(tokenizer)
    other_k = tiny_engine(tokenizer, k=4, tree="chain4")

    async def main():
        sync_a = MatrixSync(a, cfg, model_id=model_id, tokenizer=tokenizer)
        await generate(a, [5, 6, 7, 8], 8, "x", ignore_eos=True)
        result = await sync_a.sync_once()
        assert result["pushed"] > 0 and result["error"] is None
        # same model id and namespace, another K: refused with a reason, nothing adopted
        sync_k = MatrixSync(other_k, cfg, model_id=model_id, tokenizer=tokenizer)
        before = other_k.engine.matrix.table.clone()  # its matrix prior
        with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
            result = await sync_k.sync_once()
        assert result["error"].startswith("identity_mismatch") and "k: actor 8 vs replica 4" in result["error"]
        assert torch.equal(other_k.engine.matrix.table, before)  # nothing adopted
        assert any("own fleet namespace" in r.getMessage() for r in caplog.records)
        return (await get_actor(model_id, cfg.namespace).info.remote())

    try:
        info = asyncio.run(main())
    finally:
        a.shutdown()
        other_k.shutdown()
    assert info["saved_version"] == 0 and not snapshot_files(info["snapshot_folder"])  # interval not reached
    assert stop_matrix_actor(model_id, cfg.namespace)  # final snapshot, then exit
    files = snapshot_files(info["snapshot_folder"])
    assert len(files) == 1 and files[0].name.endswith(f"-v{info['version']:010d}.arrow")
    assert get_actor(model_id, cfg.namespace) is None or _wait_gone(model_id, cfg.namespace)


def _wait_gone(model_id, namespace) -> bool:
    for _ in range(50):
        if get_actor(model_id, namespace) is None:
            return True
        time.sleep(0.1)
    return False


def test_suffix_documents_travel_through_the_object_store_and_outlive_the_actor_on_disk(ray_local, tokenizer, tmp_path):
    cfg = fleet_config(tmp_path, sync_interval_s=0.25, snapshot_interval_s=3600)
    model_id = "tiny-random-llama"
    prompt = [5, 17, 230, 402, 9, 33, 71, 12]
    engines = [tiny_engine(tokenizer, tree="auto") for _ in range(3)]
    a, b, c = engines

    async def lookup(engine, text, namespace):
        draft = await engine.call_between_steps(lambda e: e.suffix.lookup_text(text, namespace, 4))
        return draft.tokens if draft is not None else None

    async def main():
        sync_a = MatrixSync(a, cfg, model_id=model_id, tokenizer=tokenizer, replica_id="A")
        out = await generate(a, prompt, 24, "a0", ignore_eos=True)
        result = await sync_a.sync_once()
        assert result["error"] is None and sync_a.suffix.documents_shared == 1
        sync_b = MatrixSync(b, cfg, model_id=model_id, tokenizer=tokenizer, replica_id="B")
        result = await sync_b.sync_once()  # the corpus comes through the object store
        assert result["error"] is None and result["imported"] == 1
        assert await lookup(b, prompt + out.token_ids[:6], "default") == out.token_ids[6:10]
        assert await lookup(b, prompt + out.token_ids[:6], "tenant-b") is None
        return out, await get_actor(model_id, cfg.namespace).info.remote()

    try:
        out, info = asyncio.run(main())
        assert info["corpus_documents"] == 1 and info["saved_corpus_seq"] == 0  # interval not reached
        assert stop_matrix_actor(model_id, cfg.namespace)  # final snapshots: the matrix and the corpus
        assert len(snapshot_files(info["snapshot_folder"], CORPUS_PREFIX)) == 1
        assert _wait_gone(model_id, cfg.namespace)

        async def fresh():  # a new actor starts from the files: a fresh replica drafts from A's text
            sync_c = MatrixSync(c, cfg, model_id=model_id, tokenizer=tokenizer, replica_id="C")
            result = await sync_c.sync_once()
            assert result["error"] is None and result["imported"] == 1
            return await lookup(c, prompt + out.token_ids[:6], "default")

        assert asyncio.run(fresh()) == out.token_ids[6:10]
    finally:
        for e in engines:
            e.shutdown()
        stop_matrix_actor(model_id, cfg.namespace)
