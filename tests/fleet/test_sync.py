"""``MatrixSync`` bookkeeping without Ray: the real ``MatrixActor`` runs in-process behind a stand-in
for its handle, the replicas are plain engines of a tiny random-weight model."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from local_actor import LocalActor
from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.fleet import FleetSyncConfig
from tr_serve.fleet import actor as fleet_actor
from tr_serve.fleet.sync import CLEAN, PENDING, MatrixSync
from tr_serve.tr.matrix import EMPTY

V = 512


@pytest.fixture
def setup(tokenizer, tmp_path, monkeypatch):
    # no final snapshot at exit from in-process actors
    monkeypatch.setattr(fleet_actor, "atexit", SimpleNamespace(register=lambda *a, **kw: None))
    loaded = tiny_loaded(tokenizer, vocab_size=V)
    cfg = FleetSyncConfig(enabled=True, namespace="unit", snapshot_dir=str(tmp_path), snapshot_interval_s=3600)

    def replica(name):
        engine = Engine(loaded, EngineConfig(model="tiny", tree="top8", max_num_seqs=1, max_model_len=64))
        return engine, MatrixSync(engine, cfg, model_id="tiny", fingerprint="fp", replica_id=name)

    (ea, sa), (eb, sb) = replica("A"), replica("B")
    actor = LocalActor(sa.spec)
    sa._actor = sb._actor = actor
    return actor, ea, sa, eb, sb


def set_row(engine, token: int, cands: list[int]) -> None:
    """What ``recycle`` does after a verification step: the row of ``token`` becomes ``cands``."""
    logits = torch.full((1, V), -100.0)
    for rank, c in enumerate(cands):
        logits[0, c] = 50.0 - rank
    engine.matrix.recycle(torch.tensor([token]), torch.topk(logits, engine.matrix.k).indices)


def row(engine, token: int) -> list[int]:
    return engine.matrix.table[token].tolist()


def test_push_adopt_reapply_and_own_only_rounds(setup):
    actor, ea, sa, eb, sb = setup
    row1, row2 = list(range(10, 18)), list(range(20, 28))

    async def main():
        set_row(ea, 1, row1)
        set_row(ea, 2, row2)
        r = await sa.sync_once()
        assert r == {"pushed": 2, "adopted": 1, "imported": None, "version": 1, "error": None}
        # B is cold: it adopts the fleet rows, and its own new row stays
        set_row(eb, 3, list(range(30, 38)))
        r = await sb.sync_once()
        assert r["pushed"] == 1 and r["version"] == 2 and r["adopted"] == 2
        assert row(eb, 1) == row1 and row(eb, 2) == row2 and row(eb, 3) == list(range(30, 38))
        # rows nobody learned keep each replica's matrix prior (the same model's): never pushed, never erased
        assert row(eb, 5) == row(ea, 5) and EMPTY not in row(eb, 5)
        assert eb.matrix.take_dirty_rows().tolist() == []  # adoption does not make fleet rows "ours"
        # only B changed since: B's next push needs no fetch
        calls = actor.snapshot_calls
        set_row(eb, 4, list(range(40, 48)))
        r = await sb.sync_once()
        assert r["adopted"] == "own" and actor.snapshot_calls == calls and sb.adopted_version == 3
        # A adopts version 3 (B's rows 3 and 4); nothing pending of its own
        r = await sa.sync_once()
        assert r["adopted"] == 3 and row(ea, 4) == list(range(40, 48))

    asyncio.run(main())


def test_adoption_reapplies_rows_the_snapshot_does_not_have(setup):
    _, ea, sa, eb, sb = setup

    async def main():
        set_row(eb, 5, list(range(50, 58)))
        await sb.sync_once()  # merged at version 1
        set_row(eb, 6, list(range(60, 68)))  # changed after the push: pending
        snap = torch.full((V, 8), EMPTY, dtype=torch.int32)
        snap[5] = torch.arange(100, 108)
        snap[6] = torch.arange(110, 118)
        snap[7] = torch.arange(120, 128)
        # a snapshot at version 1 has row 5 (merged), not the newer row 6
        sb._adopt_between_steps(eb, snap, version=1)
        assert row(eb, 5) == list(range(100, 108))  # the fleet's merged row
        assert row(eb, 6) == list(range(60, 68))  # ours, reapplied
        assert row(eb, 7) == list(range(120, 128))
        assert int(sb._shadow_ver[5]) == CLEAN and int(sb._shadow_ver[6]) == PENDING
        # a snapshot older than our push (version 0) keeps row 5 too
        set_row(eb, 5, list(range(50, 58)))
        await sb.sync_once()
        merged_at = int(sb._shadow_ver[5])
        sb._adopt_between_steps(eb, snap, version=merged_at - 1)
        assert row(eb, 5) == list(range(50, 58))
        assert sb.adopt_s and sb.token_path_calls >= 3

    asyncio.run(main())


def test_failed_push_keeps_rows_pending_and_epoch_change_resends(setup, caplog):
    actor, ea, sa, eb, sb = setup

    async def main():
        set_row(ea, 8, list(range(80, 88)))
        actor.fail = ConnectionError("actor gone")
        before = ea.matrix.table.clone()
        r = await sa.sync_once()
        assert r["error"].startswith("actor_unreachable") and r["pushed"] == 0
        assert torch.equal(ea.matrix.table, before)  # the last good matrix is kept
        assert int(sa._shadow_ver[8]) == PENDING and sa._actor is None
        assert any("serving on with the last good matrix" in m for m in caplog.messages)
        actor.fail = None
        sa._actor = actor  # (the real sync re-resolves the actor by name)
        r = await sa.sync_once(adopt=False)
        assert r["pushed"] == 1 and r["error"] is None
        assert 0 < int(sa._shadow_ver[8]) < PENDING  # merged, not yet seen in an adopted snapshot
        # the actor restarts with an older state (new epoch): merged rows are sent again
        actor.impl.epoch = "restarted"
        actor.impl.version = 0
        actor.impl.state.cands[:] = EMPTY
        r = await sa.sync_once()  # sees the new epoch; re-sends next round
        assert sa.restarts_seen == 1 and int(sa._shadow_ver[8]) == PENDING
        r = await sa.sync_once()
        assert r["pushed"] == 1 and actor.impl.state.cands[8].tolist() == list(range(80, 88))

    asyncio.run(main())


def test_identity_and_shape_guard(setup):
    _, ea, sa, _, _ = setup
    assert sa.spec["vocab_size"] == V and sa.spec["k"] == 8 and sa.spec["namespace"] == "unit"
    assert sa.name == "tr_matrix:tiny:unit"
    stats = sa.stats()
    assert set(stats) >= {"adopted_version", "pushes", "token_path_s", "adopt_ms_max", "snapshot_age_s"}
    assert not any(isinstance(v, (torch.Tensor, np.ndarray)) for v in stats.values())  # no matrix contents


def test_start_fleet_sync_is_off_unless_enabled(setup):
    from pydantic import ValidationError

    from tr_serve.fleet.sync import start_fleet_sync

    _, ea, _, _, _ = setup

    async def main():
        kw = dict(model_id="tiny", tokenizer=None)
        assert await start_fleet_sync(ea, None, **kw) is None
        assert await start_fleet_sync(ea, {"enabled": False}, **kw) is None
        with pytest.raises(ValidationError):
            await start_fleet_sync(ea, {"enabled": True, "sync_interval": 1}, **kw)

    asyncio.run(main())
