"""Per-tenant matrix overlays: a tenant drafts from its own rows over the shared ones, writes only
its own, and its cap evicts only its own rows."""

from __future__ import annotations

import numpy as np
import torch

from tr_serve.tr.matrix import EMPTY, AdjacencyMatrix
from tr_serve.tr.proposer import propose
from tr_serve.tr.tenant_rows import TenantMatrices
from tr_serve.tr.tree import compile_tree

V, K = 12, 3
TREE = compile_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]])


def _shared(seed: int = 0) -> AdjacencyMatrix:
    m = AdjacencyMatrix(V, K)
    g = torch.Generator().manual_seed(seed)
    m.table.copy_(torch.randint(0, V, (V, K), generator=g, dtype=torch.int32))
    m.table[7] = EMPTY  # a row the shared matrix holds nothing for
    return m


def _rows(*firsts: int) -> torch.Tensor:
    """Top-k rows whose first candidates are ``firsts`` (the rest: fixed fillers)."""
    return torch.tensor([[f, (f + 1) % V, (f + 2) % V] for f in firsts], dtype=torch.int32)


def _effective(shared: AdjacencyMatrix, overlays: TenantMatrices, tenant: str) -> AdjacencyMatrix:
    """The matrix the tenant drafts from, materialised: its overlay's rows over the shared ones."""
    m = AdjacencyMatrix(V, K)
    m.table.copy_(shared.table)
    m.streak.copy_(shared.streak)
    o = overlays.overlays[tenant]
    for slot, tok in enumerate(o.token_of.tolist()):
        if tok != EMPTY:
            m.table[tok] = torch.from_numpy(o.rows[slot])
            m.streak[tok] = int(o.streak[slot])
    return m


def test_a_tenants_rows_land_in_its_overlay_and_never_in_the_shared_matrix():
    shared = _shared()
    before = shared.table.clone()
    overlays = TenantMatrices(shared, capacity=4)
    overlays.recycle("t-a", torch.tensor([3, 5, 3]), _rows(1, 2, 9), preferred=torch.tensor([True, False, False]))
    assert torch.equal(shared.table, before) and shared.take_dirty_rows().numel() == 0
    a = overlays.overlays["t-a"]
    assert a.num_rows == 2 and "t-b" not in overlays.overlays
    # token 3 occurs twice: the node on the accepted path wins, as in the shared matrix
    assert a.rows[a.slot_of[3]].tolist() == [1, 2, 3] and a.rows[a.slot_of[5]].tolist() == [2, 3, 4]
    assert overlays.totals() == {"tenants": 1, "rows": 2, "bytes": a.nbytes, "evictions": 0, "rows_per_tenant": 4}


def test_a_full_overlay_evicts_its_own_least_recently_written_rows_only():
    shared = _shared()
    overlays = TenantMatrices(shared, capacity=3)
    overlays.recycle("t-b", torch.tensor([1, 2]), _rows(4, 4))
    overlays.recycle("t-a", torch.tensor([1, 2, 3]), _rows(5, 6, 7))
    overlays.recycle("t-a", torch.tensor([2]), _rows(8))  # 2 written again: 1 is now the oldest
    overlays.recycle("t-a", torch.tensor([4, 5]), _rows(9, 10))  # two new rows: 1 and 3 make room
    a, b = overlays.overlays["t-a"], overlays.overlays["t-b"]
    assert sorted(t for t in a.token_of.tolist() if t != EMPTY) == [2, 4, 5]
    assert a.slot_of[1] == -1 and a.slot_of[3] == -1 and a.evictions == 2
    assert a.rows[a.slot_of[2], 0] == 8
    assert b.num_rows == 2 and b.evictions == 0  # the other tenant's rows stay
    # more distinct tokens in one write than the cap: the last ones are kept
    overlays.recycle("t-b", torch.tensor([6, 7, 8, 9, 10]), _rows(1, 2, 3, 4, 5))
    assert sorted(t for t in b.token_of.tolist() if t != EMPTY) == [8, 9, 10]


def test_an_overlay_rows_streak_goes_on_from_the_row_it_drafted_from():
    shared = _shared()
    shared.streak[3] = 4
    overlays = TenantMatrices(shared, capacity=4)
    first = int(shared.table[3, 0])
    overlays.recycle("t-a", torch.tensor([3, 5]), _rows(first, (int(shared.table[5, 0]) + 1) % V))
    a = overlays.overlays["t-a"]
    assert a.streak[a.slot_of[3]] == 5 and a.streak[a.slot_of[5]] == 0
    overlays.recycle("t-a", torch.tensor([3]), _rows(first))
    assert a.streak[a.slot_of[3]] == 6


def test_each_row_drafts_from_its_own_tenants_rows_over_the_shared_ones():
    shared = _shared()
    overlays = TenantMatrices(shared, capacity=6)
    overlays.recycle("t-a", torch.tensor([3, 1, 7]), _rows(1, 7, 2))
    overlays.recycle("t-b", torch.tensor([3]), _rows(11))
    roots = torch.tensor([3, 3, 3, 1])
    tenants = ["t-a", None, "t-b", "t-c"]  # t-c has written nothing: it drafts as the shared tenant
    scopes = overlays.scopes(tenants)
    assert scopes is not None and overlays.scopes([None, "t-c"]) is None
    drafted = propose(shared, roots, TREE, scopes=scopes)
    want = [propose(_effective(shared, overlays, "t-a"), roots[:1], TREE)[0], propose(shared, roots[1:2], TREE)[0],
            propose(_effective(shared, overlays, "t-b"), roots[2:3], TREE)[0], propose(shared, roots[3:], TREE)[0]]
    assert torch.equal(drafted, torch.stack(want))
    assert not torch.equal(drafted[0], drafted[1])  # the overlay changed the draft
    a = _effective(shared, overlays, "t-a")
    of_row = scopes.overlay_of_row
    assert shared.first_candidates([3, 7, 3], [of_row[0], of_row[0], None]) == [1, 2, int(shared.table[3, 0])]
    assert shared.confident_chains([3, 3], [4, 4], 0, [of_row[0], None]) == [
        a.confident_chains([3], [4], 0)[0], shared.confident_chains([3], [4], 0)[0]]


def test_the_drafters_walk_reads_each_rows_tenant_rows():
    from tr_serve.tr.drafter import Drafter
    from tr_serve.tr.tree_spec import parse_tree_spec

    shared = _shared()
    overlays = TenantMatrices(shared, capacity=6)
    overlays.recycle("t-a", torch.tensor([3, 1]), _rows(1, 7))
    drafter = Drafter(parse_tree_spec("2.2.2", "fixed"), TREE, shared)
    scopes = overlays.scopes(["t-a", None])
    successors = drafter._successors([(0, [EMPTY, 3, 1]), (1, [EMPTY, 3, 1])], scopes)
    assert list(successors(0, EMPTY, 3)) == [1, 2, 3] and list(successors(0, 3, 1)) == [7, 8, 9]
    assert list(successors(1, EMPTY, 3)) == shared.table[3].tolist()
    assert np.array_equal(overlays.overlays["t-a"].gather(np.array([3, 4]), np.array([0, 0]), np.array([-5, -5])),
                          np.array([1, -5]))


def test_the_scopes_of_some_rows_renumber_their_groups():
    matrix = AdjacencyMatrix(8, 2)
    tenants = TenantMatrices(matrix, 4)
    for t in ("t-a", "t-b"):
        tenants.recycle(t, torch.tensor([1]), torch.tensor([[2, 3]]))
    scopes = tenants.scopes(["t-a", None, "t-b", "t-a"])
    sub = scopes.subset([2, 1, 3])  # rows of t-b, the shared tenant, t-a
    assert sub.overlay_of_row == (tenants.overlays["t-b"], None, tenants.overlays["t-a"])
    assert [rows.tolist() for _, rows in sub.groups] == [[2], [0]]
    assert scopes.subset([1]) is None
