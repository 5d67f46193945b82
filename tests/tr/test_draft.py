"""Per-row draft trees: the context branch merged into the template, masks, positions, acceptance."""

from __future__ import annotations

import random

import torch

from tr_serve.tr.draft import DraftPart, build_draft, merge_parts
from tr_serve.tr.matrix import EMPTY
from tr_serve.tr.tree import compile_tree
from tr_serve.tr.verifier import accept_draft

from test_tree import ancestors_or_self

# node 1 = (0), 2 = (1), 3 = (0,0), 4 = (0,1), 5 = (0,0,0)
SMALL = compile_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
NODES = torch.arange(1, 6)
# root 1, then a=2 (0), b=3 (1), c=4 (0,0), d=5 (0,1), e=6 (0,0,0)
DRAFT = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])


def test_without_branches_every_row_shares_the_template():
    batch = build_draft(DRAFT, SMALL, NODES)
    assert batch.depths.dim() == 1 and torch.equal(batch.mask, SMALL.mask)
    assert batch.num_nodes == 5 and batch.chain_columns == ((), ())


def test_branch_reuses_template_nodes_then_grows_one_chain():
    # row 0: a, c (template nodes 1, 3), then 40, 41 are new; row 1: b (node 2) then 50; row 2-like padding
    batch = build_draft(DRAFT, SMALL, NODES, chains=[[2, 4, 40, 41], [3, 50]], match_lengths=[3, 2])
    assert batch.num_nodes == 7  # 5 template nodes + the longest new part (2)
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 40, 41], [1, 2, 3, 4, 5, 6, 50, EMPTY]]
    assert batch.parents.tolist() == [[-1, 0, 0, 1, 1, 3, 3, 6], [-1, 0, 0, 1, 1, 3, 2, 0]]
    assert batch.depths.tolist() == [[0, 1, 1, 2, 2, 3, 3, 4], [0, 1, 1, 2, 2, 3, 2, 1]]
    assert batch.chain_columns == ((1, 3, 6, 7), (2, 6))
    assert batch.max_depth == 4
    for r in range(2):
        parents = batch.parents[r].tolist()
        for i in range(8):
            seen = set(batch.mask[r, i].nonzero().flatten().tolist())
            if batch.tokens[r, i] == EMPTY:
                assert seen == {0, i}  # padding sees the root and itself
            else:
                assert seen == ancestors_or_self(parents, i)


def test_rows_verify_their_own_template_prefix_and_report_real_lengths():
    # row 0 verifies nodes 1..3 and merges its branch (a, c) into them, then 40 hangs below c;
    # row 1 verifies nothing of the template: a plain one-token step unless its branch (b) exists
    batch = build_draft(DRAFT, SMALL, NODES, chains=[[2, 4, 40], [3]], match_lengths=[3, 2], row_nodes=[3, 0])
    assert batch.row_nodes == (3, 0)
    assert batch.tokens.tolist() == [[1, 2, 3, 4, 40], [1, 3, EMPTY, EMPTY, EMPTY]]
    assert batch.parents.tolist() == [[-1, 0, 0, 1, 3], [-1, 0, 0, 0, 0]]
    assert batch.depths.tolist() == [[0, 1, 1, 2, 3], [0, 1, 1, 1, 1]]
    assert batch.lengths.tolist() == [5, 2] and batch.num_inputs == 7 and batch.nodes_per_row() == [4, 1]
    assert batch.chain_columns == ((1, 3, 4), (1,))
    assert batch.children(1) == [[1], [], [], [], []]  # padding is nobody's child
    for r in range(2):
        parents = batch.parents[r].tolist()
        for i in range(5):
            seen = set(batch.mask[r, i].nonzero().flatten().tolist())
            assert seen == ({0, i} if batch.tokens[r, i] == EMPTY else ancestors_or_self(parents, i))
    plain = build_draft(DRAFT[:, :1], compile_tree([]), torch.zeros(0, dtype=torch.long))
    assert plain.lengths is None and plain.num_inputs == 2  # nothing padded: no packing needed


def test_a_branch_deeper_than_the_template_is_accepted_whole():
    batch = build_draft(DRAFT, SMALL, NODES, chains=[[2, 4, 40, 41], [3, 50]], match_lengths=[3, 2])
    # row 0: the model says a, c, 40, 41, then 99; row 1: b, then 7 (not 50)
    choice = torch.zeros(2, 8, dtype=torch.long)
    choice[0, [0, 1, 3, 6, 7]] = torch.tensor([2, 4, 40, 41, 99])
    choice[1, [0, 2, 6]] = torch.tensor([3, 7, 8])
    acc = accept_draft(batch, choice)
    assert acc.accepted_nodes[0].tolist() == [0, 1, 3, 6, 7]
    assert acc.emitted[0].tolist() == [2, 4, 40, 41, 99]
    assert acc.accepted_nodes[1].tolist() == [0, 2]
    assert acc.emitted[1].tolist() == [3, 7]


def greedy_walk(tokens: list[int], parents: list[int], choice: list[int]) -> list[int]:
    node, path = 0, [0]
    while True:
        nxt = [c for c in range(1, len(tokens)) if parents[c] == node and tokens[c] == choice[node]]
        if not nxt:
            return path
        node = nxt[0]
        path.append(node)


def test_acceptance_equals_a_greedy_walk_on_random_trees_and_branches():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    tree = compile_tree(paths)
    for _ in range(200):
        b, vocab = 3, 6
        # siblings hold distinct tokens, as a matrix row's top-k does
        draft = torch.full((b, tree.num_nodes + 1), EMPTY, dtype=torch.long)
        draft[:, 0] = torch.randint(vocab, (b,), generator=gen)
        for r in range(b):
            for parent, kids in enumerate(tree.children):
                toks = rng.sample(range(vocab), len(kids))
                for c, t in zip(kids, toks):
                    draft[r, c] = t if rng.random() > 0.1 else EMPTY
        chains = [[rng.randrange(vocab) for _ in range(rng.randint(0, 7))] for _ in range(b)]
        batch = build_draft(draft, tree, torch.arange(1, tree.num_nodes + 1), chains, [2] * b)
        choice = torch.randint(vocab, batch.tokens.shape, generator=gen)
        acc = accept_draft(batch, choice)
        for r in range(b):
            walk = greedy_walk(batch.tokens[r].tolist(), batch.parents[r].tolist(), choice[r].tolist())
            assert acc.accepted_nodes[r].tolist() == walk
            assert acc.emitted[r].tolist() == [int(batch.tokens[r, i]) for i in walk[1:]] + [int(choice[r, walk[-1]])]


def _reference_row(draft_row, tree, row_nodes, chain, cap, q):
    """One row built node by node: its template prefix, then the branch (merged while it agrees)."""
    w = row_nodes + 1
    tokens, parents, depths = list(draft_row[:w]), [-1] + tree.parents[1:w].tolist(), tree.depths[:w].tolist()
    node, rest = 0, []
    for j, tok in enumerate(chain):
        nxt = [c for c in tree.children[node] if c < w and draft_row[c] == tok]
        if not nxt:
            rest = chain[j : j + cap]
            break
        node = nxt[0]
    for i, tok in enumerate(rest):
        tokens.append(tok)
        parents.append(node if i == 0 else len(tokens) - 2)
        depths.append(depths[parents[-1]] + 1)
    real = len(tokens)
    mask = torch.zeros(q, q, dtype=torch.bool)
    for i in range(q):
        if i >= real:  # padding: a dead child of the root
            mask[i, 0] = mask[i, i] = True
            continue
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    pad = q - real
    return tokens + [EMPTY] * pad, [p if p >= 0 else -1 for p in parents] + [0] * pad, depths + [1] * pad, mask, real


def test_ragged_batches_equal_rows_built_one_by_one():
    rng = random.Random(1)
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    tree = compile_tree(paths)
    for _ in range(150):
        b, vocab = rng.randint(1, 5), 5
        draft = torch.randint(vocab, (b, tree.num_nodes + 1), generator=torch.Generator().manual_seed(rng.randrange(99)))
        chains = [[rng.randrange(vocab) for _ in range(rng.randint(0, 6))] for _ in range(b)]
        row_nodes = [rng.randint(0, tree.num_nodes) for _ in range(b)]
        caps = [rng.choice([0, 1, 2, 16]) for _ in range(b)]
        batch = build_draft(draft, tree, torch.arange(1, tree.num_nodes + 1), chains, [2] * b, row_nodes, caps)
        q = batch.tokens.shape[1]
        rows = [_reference_row(draft[r].tolist(), tree, row_nodes[r], chains[r], caps[r], q) for r in range(b)]
        assert q == max(row[4] for row in rows)
        for r, (tokens, parents, depths, mask, real) in enumerate(rows):
            assert batch.tokens[r].tolist() == tokens
            assert batch.parents[r].tolist() == parents
            assert batch.row_depths()[r].tolist() == depths
            assert torch.equal(batch.mask[r] if batch.mask.dim() == 3 else batch.mask, mask)
            assert batch.nodes_per_row()[r] == real - 1
        assert batch.max_depth == max(max(d for d, t in zip(row[2], row[0][: row[4]])) for row in rows)


def test_a_batch_merged_from_parts_holds_each_parts_rows_and_accepts_as_they_do():
    """Parts drafted apart (other subtrees and orders, as two tenants' budgets pick them) merge
    into one batch whose rows are the parts' rows padded with dead nodes; accepting the merged
    batch decides for each row what accepting its part decides, and of_rows gives it back."""
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
    for _ in range(100):
        b, vocab = rng.randint(2, 6), 5
        rows = list(range(b))
        rng.shuffle(rows)
        cut = rng.randint(1, b - 1)
        parts = []
        for scope, part_rows in (("t-a", sorted(rows[:cut])), (None, sorted(rows[cut:]))):
            n = rng.randint(1, len(paths))
            tree = compile_tree(paths[:n])
            m = len(part_rows)
            draft = torch.randint(vocab, (m, n + 1), generator=gen)
            chains = [[rng.randrange(vocab) for _ in range(rng.randint(0, 5))] for _ in range(m)]
            row_nodes = [rng.randint(0, n) for _ in range(m)]
            batch = build_draft(draft, tree, torch.arange(1, n + 1), chains, [2] * m, row_nodes, [4] * m)
            parts.append(DraftPart(scope, tuple(part_rows), batch))
        merged = merge_parts(parts, b)
        q = merged.tokens.shape[1]
        assert q == max(p.batch.tokens.shape[1] for p in parts) and merged.parts == tuple(parts)
        choice = torch.randint(vocab, (b, q), generator=gen)
        acc = accept_draft(merged, choice)
        for part in parts:
            pb, w = part.batch, part.batch.tokens.shape[1]
            own = accept_draft(pb, choice[list(part.rows), :w])
            cut_back = acc.of_rows(part.rows, w)
            assert torch.equal(cut_back.accepted_mask, own.accepted_mask)
            for j, r in enumerate(part.rows):
                assert merged.tokens[r, :w].tolist() == pb.tokens[j].tolist()
                assert set(merged.tokens[r, w:].tolist()) <= {EMPTY}
                assert merged.nodes_per_row()[r] == pb.nodes_per_row()[j]
                assert torch.equal(merged.mask[r, :w, :w], pb.mask[j] if pb.mask.dim() == 3 else pb.mask)
                assert merged.row_nodes[r] == pb.row_nodes[j] and merged.chain_columns[r] == pb.chain_columns[j]
                assert acc.accepted_nodes[r].tolist() == own.accepted_nodes[j].tolist()
                assert acc.emitted[r].tolist() == own.emitted[j].tolist()
                assert cut_back.emitted[j].tolist() == own.emitted[j].tolist()
        real = merged.real_nodes()
        for r in range(b):  # padding: a dead child of the root, never accepted
            for c in range(q):
                if real is not None and not real[r, c]:
                    assert merged.mask[r, c].nonzero().flatten().tolist() == sorted({0, c})
