"""Greedy acceptance on synthetic logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tr_serve.tr.matrix import EMPTY
from tr_serve.tr.tree import DEFAULT_TREE, compile_tree
from tr_serve.tr.draft import build_draft
from tr_serve.tr.verifier import Acceptance, accept_draft

V = 16
# node 1 = (0), 2 = (1), 3 = (0,0), 4 = (0,1), 5 = (0,0,0)
SMALL = compile_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
# drafted tokens: root 1, then a=2 (0), b=3 (1), c=4 (0,0), d=5 (0,1), e=6 (0,0,0)
DRAFT = [1, 2, 3, 4, 5, 6]


def logits_for(choices: list[list[int]]) -> torch.Tensor:
    """[b, n+1, V] logits whose argmax at input i of row r is choices[r][i] (noise elsewhere)."""
    c = torch.tensor(choices)
    g = torch.Generator().manual_seed(0)
    return torch.rand(*c.shape, V, generator=g) + 5.0 * F.one_hot(c, V).float()


def accept_choices(draft: torch.Tensor, choice: torch.Tensor, tree) -> Acceptance:
    """Every row verifies the whole of ``tree``: draft [b, n+1], choice [b, n+1]."""
    return accept_draft(build_draft(draft, tree, torch.arange(1, tree.num_nodes + 1)), choice)


def accept_greedy(draft: torch.Tensor, logits: torch.Tensor, tree) -> Acceptance:
    return accept_choices(draft, logits.argmax(dim=-1), tree)


def accept_one(draft: list[int], choice: list[int], tree=SMALL):
    acc = accept_greedy(torch.tensor([draft]), logits_for([choice]), tree)
    return acc.accepted_nodes[0].tolist(), acc.emitted[0].tolist()


def test_full_accept_of_deepest_path():
    # model: after root -> 2 (=a), after a -> 4 (=c), after c -> 6 (=e), after e -> 11 (bonus)
    choice = [2, 4, 15, 6, 15, 11]
    nodes, emitted = accept_one(DRAFT, choice)
    assert nodes == [0, 1, 3, 5]
    assert emitted == [2, 4, 6, 11]


def test_first_token_rejected_emits_only_bonus():
    choice = [9, 4, 5, 6, 7, 8]  # 9 is neither a (2) nor b (3)
    nodes, emitted = accept_one(DRAFT, choice)
    assert nodes == [0]
    assert emitted == [9]


def test_second_rank_child_accepted():
    choice = [3, 4, 0, 6, 0, 0]  # b (node 2) is right; it is a leaf
    nodes, emitted = accept_one(DRAFT, choice)
    assert nodes == [0, 2]
    assert emitted == [3, 0]


def test_deeper_branch_wins():
    # a right, then the model says d (5): path (0,1) has 2 correct nodes, path (0,0,0) only 1
    choice = [2, 5, 0, 0, 12, 0]
    nodes, emitted = accept_one(DRAFT, choice)
    assert nodes == [0, 1, 4]
    assert emitted == [2, 5, 12]
    # a and c right, e wrong: path (0,0,0) has 2 correct nodes, path (0,1) only 1
    choice = [2, 4, 0, 7, 0, 0]
    nodes, emitted = accept_one(DRAFT, choice)
    assert nodes == [0, 1, 3]
    assert emitted == [2, 4, 7]


def test_deepest_of_two_partly_correct_branches_wins():
    # two branches whose first node is right (same token drafted twice); the second goes deeper
    # 1 = (0), 2 = (1), 3 = (0,0), 4 = (1,0), 5 = (1,0,0)
    tree = compile_tree([[0], [1], [0, 0], [1, 0], [1, 0, 0]])
    draft = [1, 7, 7, 8, 9, 10]
    choice = [7, 0, 9, 0, 10, 13]  # after node 1 -> 0 (node 3 wrong); after node 2 -> 9 (node 4 right) ...
    nodes, emitted = accept_one(draft, choice, tree)
    assert nodes == [0, 2, 4, 5]
    assert emitted == [7, 9, 10, 13]


def test_empty_nodes_are_never_accepted():
    # EMPTY nodes run as token 0 in the forward; the model choosing token 0 must not accept them
    draft = [1, EMPTY, EMPTY, EMPTY, EMPTY, EMPTY]
    nodes, emitted = accept_one(draft, [0, 0, 0, 0, 0, 0])
    assert nodes == [0]
    assert emitted == [0]
    # a correct node below an EMPTY one cannot be reached either
    draft = [1, 2, 3, EMPTY, 5, 6]
    nodes, emitted = accept_one(draft, [2, 0, 0, 6, 0, 0])
    assert nodes == [0, 1]
    assert emitted == [2, 0]


def test_batch_rows_have_independent_outcomes():
    draft = torch.tensor([DRAFT, DRAFT])
    logits = logits_for([[2, 4, 0, 6, 0, 11], [14, 4, 0, 6, 0, 11]])
    acc = accept_greedy(draft, logits, SMALL)
    assert [n.tolist() for n in acc.accepted_nodes] == [[0, 1, 3, 5], [0]]
    assert [e.tolist() for e in acc.emitted] == [[2, 4, 6, 11], [14]]
    assert acc.num_accepted_drafts == [3, 0]


def test_plain_tree_emits_argmax():
    plain = compile_tree([])
    acc = accept_greedy(torch.tensor([[5], [6]]), logits_for([[3], [8]]), plain)
    assert [n.tolist() for n in acc.accepted_nodes] == [[0], [0]]
    assert [e.tolist() for e in acc.emitted] == [[3], [8]]


def brute_force_longest(draft: list[int], choice: list[int], tree) -> int:
    """Depth of the deepest node whose whole root path matches the model's choices."""
    parents = tree.parents.tolist()
    ok = [True] + [False] * tree.num_nodes
    best = 0
    for i in range(1, tree.num_nodes + 1):  # parents precede children
        p = parents[i]
        ok[i] = ok[p] and draft[i] != EMPTY and draft[i] == choice[p]
        if ok[i]:
            best = max(best, int(tree.depths[i]))
    return best


def test_random_trees_against_brute_force():
    tree = compile_tree(DEFAULT_TREE)
    g = torch.Generator().manual_seed(0)
    b, vocab = 64, 3  # tiny vocab: many partial matches
    draft = torch.randint(-1, vocab, (b, 81), generator=g)
    choice = torch.randint(0, vocab, (b, 81), generator=g)
    acc = accept_choices(draft, choice, tree)
    parents = tree.parents.tolist()
    depths_seen = set()
    for r in range(b):
        d, c = draft[r].tolist(), choice[r].tolist()
        want = brute_force_longest(d, c, tree)
        depths_seen.add(want)
        nodes = acc.accepted_nodes[r].tolist()
        assert len(nodes) == want + 1 and nodes[0] == 0
        for parent, child in zip(nodes, nodes[1:]):
            assert parents[child] == parent and d[child] == c[parent]
        assert acc.emitted[r].tolist() == [d[x] for x in nodes[1:]] + [c[nodes[-1]]]
    assert len(depths_seen) >= 3, "the random cases should cover several acceptance depths"


def test_packed_choices_give_the_same_acceptance_as_padded():
    """Rows of different widths: the runner's choices come packed (real nodes only, row order);
    laid out by ``choices_grid`` they keep and emit exactly what the padded [b, q] choices do."""
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.verifier import accept_draft, choices_grid

    tree = compile_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    g = torch.Generator().manual_seed(3)
    drafted = torch.randint(0, 6, (3, tree.num_nodes + 1), generator=g)
    batch = build_draft(drafted, tree, torch.arange(1, tree.num_nodes + 1), row_nodes=[5, 1, 3])
    assert batch.lengths.tolist() == [6, 2, 4]
    real = batch.real_nodes()
    choice = torch.randint(0, 6, tuple(batch.tokens.shape), generator=g)
    for r in range(3):  # make the drafts partly right: each node's first child is the choice
        for i in range(int(batch.lengths[r])):
            kids = [c for c in range(1, int(batch.lengths[r])) if int(batch.parents[r, c]) == i]
            if kids:
                choice[r, i] = batch.tokens[r, kids[0]]
    padded, packed = accept_draft(batch, choice), accept_draft(batch, choices_grid(batch, choice[real]))
    for a, b in zip(padded.accepted_nodes + padded.emitted, packed.accepted_nodes + packed.emitted):
        assert torch.equal(a, b)
    assert max(len(n) for n in padded.accepted_nodes) > 1  # some drafts were accepted
    assert choices_grid(batch, choice[real])[1].tolist() == choice[1, :2].tolist() + [0] * 4


def test_the_choices_decide_what_is_accepted():
    """A different choice after the root changes the outcome: acceptance reads the runner's choices."""
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.verifier import accept_draft, choices_grid

    batch = build_draft(torch.tensor([DRAFT, DRAFT]), SMALL, torch.arange(1, SMALL.num_nodes + 1), row_nodes=[5, 2])
    choices = torch.tensor([[2, 4, 0, 6, 0, 9], [3, 0, 0, 0, 0, 0]])
    packed = choices[batch.real_nodes()]
    assert [e.tolist() for e in accept_draft(batch, choices_grid(batch, packed)).emitted] == [[2, 4, 6, 9], [3, 0]]
    packed[0] = 3  # the model's token after the root is now b's
    assert [e.tolist() for e in accept_draft(batch, choices_grid(batch, packed)).emitted] == [[3, 0], [3, 0]]
