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
