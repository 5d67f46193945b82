"""The fleet shares each named tenant's matrix rows within that tenant: tenant T's rows learned on
one replica reach another through the actor and draft there for T's requests, while tenant U's
drafts on that replica stay exactly those of a fresh engine. The real ``MatrixActor`` runs
in-process (tests/fleet/local_actor.py); the replicas are engines of a tiny random-weight model
with a matrix-only template (no suffix index), so only matrix rows can carry anything."""

from __future__ import annotations

import numpy as np

from test_suffix_share import P, fleet, run, serve  # noqa: F401  (fleet: the fixture)

TREE = "2.2.2"


def test_a_tenants_rows_reach_another_replica_for_that_tenant_only(fleet):  # noqa: F811
    ea, sa = fleet.replica("A", tree=TREE)
    eb, sb = fleet.replica("B", tree=TREE)
    actor = fleet.made["actor"]
    want = fleet.plain(P)

    first = serve(ea, P, namespace="tenant-t")
    assert first.token_ids == want
    r = run(sa.sync_once())
    assert r["error"] is None and sa.tenant_rows_pushed > 0
    assert set(actor.impl.tenant_rows) == {"tenant-t"} and actor.impl.tenant_version == 1
    assert not ea.matrix.take_dirty_rows().numel()  # nothing of T's in the shared rows

    r = run(sb.sync_once())
    assert r["error"] is None and r["adopted"] is None  # no shared row changed
    assert sb.tenant_rows_adopted == len(actor.impl.tenant_rows["tenant-t"])
    held = eb.tenant_matrices.overlays["tenant-t"]
    ids, rows = actor.impl.tenant_table()["tenant-t"]
    assert np.array_equal(held.rows[held.slot_of[ids]], rows)

    u_fresh = serve(fleet.replica("C", tree=TREE)[0], P, namespace="tenant-u")  # a replica that never synced
    warm = serve(eb, P, namespace="tenant-t")
    other = serve(eb, P, namespace="tenant-u")
    assert warm.token_ids == other.token_ids == want
    assert warm.stats.mat > first.stats.mat  # B starts warm for T from A's rows
    assert other.stats.accepted_per_step == u_fresh.stats.accepted_per_step  # U drafts as on a fresh engine
    assert other.stats.tree_nodes_per_step == u_fresh.stats.tree_nodes_per_step


def test_a_bad_tenant_push_is_refused_whole_and_a_failed_one_is_sent_again(fleet):  # noqa: F811
    ea, sa = fleet.replica("A", tree=TREE)
    actor = fleet.made["actor"]
    k = ea.matrix.k
    for bad in ({"t": (np.array([10**6]), np.zeros((1, k), np.int32))},  # outside the vocabulary
                {"t": (np.array([1, 2]), np.zeros((1, k), np.int32))},  # shapes disagree
                [("t", None)]):
        try:
            run(actor.impl.push("X", 1, np.zeros(0, np.int64), np.zeros((0, k), np.int32), None, bad))
        except ValueError:
            pass
        else:
            raise AssertionError(f"accepted {bad!r}")
    assert actor.impl.tenant_rows == {} and actor.impl.tenant_version == 0
    serve(ea, P, namespace="tenant-t")
    actor.fail = ConnectionError("actor gone")
    assert run(sa.sync_once())["error"].startswith("actor_unreachable")
    actor.fail = None
    sa._actor = actor
    assert run(sa.sync_once())["error"] is None
    assert len(actor.impl.tenant_rows["tenant-t"]) == ea.tenant_matrices.overlays["tenant-t"].num_rows


def test_on_the_embedded_model_a_tenants_answer_reaches_the_next_replica_for_it_alone(loaded, tmp_path, monkeypatch):
    """The same promise on the real model: after one sync, replica B drafts for tenant T exactly as
    replica A (where T's rows were learned) does; tenant U on B drafts exactly as on a replica that
    never synced; every output is plain decoding's."""
    from types import SimpleNamespace

    from local_actor import LocalActor
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine
    from tr_serve.engine.prompt import encode_prompt
    from tr_serve.fleet import FleetSyncConfig
    from tr_serve.fleet import actor as fleet_actor
    from tr_serve.fleet.sync import MatrixSync

    monkeypatch.setattr(fleet_actor, "atexit", SimpleNamespace(register=lambda *a, **kw: None))
    cfg = FleetSyncConfig(enabled=True, namespace="unit", snapshot_dir=str(tmp_path), snapshot_interval_s=3600)
    # no prefix caching: A's second request prefills its whole prompt (and seeds from it) as B's first does
    config = EngineConfig(model=loaded.model_id, tree=TREE, max_num_seqs=2, max_model_len=1024,
                          enable_prefix_caching=False)
    engines, syncs = [], []
    for name in ("A", "B", "C"):
        engines.append(Engine(loaded, config))
        syncs.append(MatrixSync(engines[-1], cfg, model_id=loaded.model_id, fingerprint="fp", replica_id=name))
    actor = LocalActor(syncs[0].spec)
    for s in syncs:
        s._actor = actor
    (ea, eb, ec), (sa, sb, _) = engines, syncs
    prompt = encode_prompt(loaded.tokenizer, [{"role": "user", "content": "Explain what a hash table is."}])
    want = serve(Engine(loaded, EngineConfig(model=loaded.model_id, tree="none", max_model_len=1024)), prompt, 48)

    first = serve(ea, prompt, 48, namespace="tenant-t")
    assert run(sa.sync_once())["error"] is None and run(sb.sync_once())["error"] is None
    assert sb.tenant_rows_adopted > 0
    u_fresh = serve(ec, prompt, 48, namespace="tenant-u")  # C never synced
    warm = serve(eb, prompt, 48, namespace="tenant-t")
    other = serve(eb, prompt, 48, namespace="tenant-u")
    again = serve(ea, prompt, 48, namespace="tenant-t")  # T's second request where its rows were learned
    assert first.token_ids == warm.token_ids == again.token_ids == want.token_ids
    assert other.token_ids == u_fresh.token_ids == want.token_ids
    # B drafts for T exactly as the replica that learned T's rows does, and unlike a cold replica
    assert warm.stats.accepted_per_step == again.stats.accepted_per_step
    assert warm.stats.accepted_per_step != u_fresh.stats.accepted_per_step
    assert other.stats.accepted_per_step == u_fresh.stats.accepted_per_step  # U: as if T never existed
