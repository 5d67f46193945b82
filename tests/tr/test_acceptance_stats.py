"""Acceptance statistics: per-node, context-branch and suffix-branch estimates, and the outcomes
one verification reveals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tr_serve.tr.acceptance_stats import AcceptanceStats
from tr_serve.tr.tree import compile_tree


def _tree():
    # 1=(0,) 2=(1,) 3=(0,0) 4=(0,0,0)
    return compile_tree([(0,), (1,), (0, 0), (0, 0, 0)])


def _table_outcomes(tree, draft, choice, verified=None) -> list[tuple[list[int], list[int]]]:
    """The reference for :func:`node_outcomes`, from tables of the whole template: per row, (nodes
    1..N whose whole path was accepted, nodes compared with the model's choice). draft [b, N+1];
    choice [b, v] the model's token after each of the first ``v`` inputs (the root and a verified
    prefix of the template), or, with ``verified`` [b, N+1] bool, choice [b, N+1] holding the
    model's token after every verified node (the root always is). Level by level: a node is
    observed when its parent's path was accepted and verified, accepted when also right."""
    draft, choice = np.asarray(draft), np.asarray(choice)
    n, b = tree.num_nodes, draft.shape[0]
    if verified is None:
        v = choice.shape[1]
        verified = np.broadcast_to(np.arange(n + 1) < v, (b, n + 1))
        choice = np.concatenate([choice, np.zeros((b, n + 1 - v), dtype=choice.dtype)], axis=1)
    parents, order = tree.parents.numpy(), tree.level_order.numpy()
    ok = np.zeros((b, n + 1), dtype=bool)
    observed = np.zeros((b, n + 1), dtype=bool)
    ok[:, 0] = True
    for lo, hi in tree.level_slices:
        idx = order[lo:hi]
        par = parents[idx]
        seen = ok[:, par] & verified[:, par]
        observed[:, idx] = seen
        ok[:, idx] = seen & (draft[:, idx] == choice[:, par])
    return [(np.flatnonzero(ok[r, 1:]) + 1, np.flatnonzero(observed[r, 1:]) + 1) for r in range(b)]


def _update(stats: AcceptanceStats, draft, choice) -> None:
    stats.add_rows(_table_outcomes(stats.tree, draft, choice))


def test_stats_count_only_known_outcomes():
    tree = _tree()
    stats = AcceptanceStats(tree, decay=1.0, prior_weight=0.0)
    draft = torch.tensor([[10, 11, 12, 13, 14]])
    # verified root + node 1 + node 2 (prefix of 2 nodes): choice after root=11, after node1=13
    choice = torch.tensor([[11, 13, 0]])
    _update(stats, draft, choice)
    # node1 correct (11), node2 wrong (12 != 11), node3 correct (13 after node1), node4 unknown
    assert stats.trials.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert stats.hits.tolist() == [1.0, 0.0, 1.0, 0.0]


def test_stats_observe_a_node_only_when_its_parent_path_was_accepted():
    tree = _tree()
    stats = AcceptanceStats(tree, decay=1.0, prior_weight=0.0)
    draft = torch.tensor([[10, 11, 12, 13, 14]])
    choice = torch.tensor([[99]])  # only the root verified (plain decoding): both children wrong
    _update(stats, draft, choice)
    # nodes 3 and 4 descend from the wrong node 1: their conditional rate is not observed (counting
    # them as failures would only ever record failures for nodes beyond the budget)
    assert stats.trials.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert stats.hits.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_path_rates_stay_unbiased_when_the_budget_hides_the_deeper_nodes():
    # node 1 right half the time, node 3 right after node 1 half the time: p3 = 0.25. Verify the
    # full tree 1 step in 10, the root only (plain decoding) otherwise.
    tree = _tree()
    stats = AcceptanceStats(tree, decay=1.0, prior_weight=0.0)
    gen = torch.Generator().manual_seed(0)
    for step in range(8000):
        first_ok = bool(torch.rand((), generator=gen) < 0.5)
        second_ok = bool(torch.rand((), generator=gen) < 0.5)
        draft = torch.tensor([[10, 11, 12, 13, 14]])
        after_root = 11 if first_ok else 50
        after_node1 = 13 if second_ok else 51
        full = [after_root, after_node1, 52, 14, 53]
        v = 5 if step % 10 == 0 else 1
        _update(stats, draft, torch.tensor([full[:v]]))
    rates = stats.rates
    assert abs(float(rates[0]) - 0.5) < 0.03
    assert abs(float(rates[2]) - 0.25) < 0.05  # counting "known only when failed" gives ~0.05
    assert float(rates[1]) == 0.0


def test_context_stats_are_conditional_and_bucketed_by_match_length():
    from tr_serve.tr.acceptance_stats import ContextStats

    stats = ContextStats(max_tokens=4, decay=1.0, prior_weight=0.0)
    never = [False] * 4
    # a 2-token match: first token right, second wrong; the third is not observed (parent failed)
    stats.update([(2, never, [True, True, False, False], [True, False, False, False])])
    # a 6-token match: all three right
    stats.update([(6, never, [True, True, True, False], [True, True, True, False])])
    assert stats.trials[stats.bucket(2), 0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert stats.hits[stats.bucket(2), 0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert stats.trials[:, 1].sum() == 0  # the matrix agreed with none of them
    assert stats.bucket(7) == stats.bucket(6) != stats.bucket(4) != stats.bucket(2)
    assert stats.path_rates(6, never[:3]) == [1.0, 1.0, 1.0]


def test_context_stats_price_tokens_the_matrix_agreed_with_apart():
    """The same match length and offset, learned apart by agreement: a token the matrix also
    predicted is priced by the outcomes of such tokens, along the branch token by token."""
    from tr_serve.tr.acceptance_stats import ContextStats

    stats = ContextStats(max_tokens=3, decay=1.0, prior_weight=0.0)
    for _ in range(3):  # agreed, agreed: both right
        stats.update([(2, [True, True], [True, True], [True, True])])
    for _ in range(3):  # not agreed: the first right once in three, the second never
        stats.update([(2, [False, False], [True, False], [False, False])])
    stats.update([(2, [False, False], [True, True], [True, False])])
    assert stats.path_rates(2, [True, True]) == [1.0, 1.0]
    assert stats.path_rates(2, [False, False]) == [0.25, 0.0]
    assert stats.path_rates(2, [True, False]) == [1.0, 0.0]
    assert stats.path_rates(3, [True]) == [0.0]  # another bucket: nothing observed there


def test_branch_outcomes_observe_the_first_token_past_the_cap():
    """A branch cut by its cap still reveals whether its next token was right (the model's token
    after the last verified one), so estimates of tokens the budget stopped drafting keep learning."""
    from tr_serve.tr.acceptance_stats import branch_outcomes
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.matrix import EMPTY
    from tr_serve.tr.verifier import accept_draft

    tree = compile_tree([])  # no template nodes: the branches alone
    roots = torch.tensor([[1], [1], [1], [1]])
    chains = [[10, 11, 12], [20, 21], [30, 31], [40]]
    batch = build_draft(roots, tree, torch.zeros(0, dtype=torch.long), chains=chains, match_lengths=[2, 3, 2, 4],
                        row_nodes=[0, 0, 0, 0], caps=[1, 0, 1, 1])
    assert batch.chain_next == (11, 20, 31, EMPTY)
    # the model's token after each column: row 0 accepts 10 and would take 11 next; row 1 (a plain
    # step) would have taken 20; row 2 rejects 30, so 31 is not observed; row 3 has nothing past its cap
    choice = torch.tensor([[10, 11], [20, 0], [99, 0], [40, 5]])
    acceptance = accept_draft(batch, choice)
    no, one = (False, False), (False,)
    assert branch_outcomes(batch, acceptance) == [
        (2, no, [True, True], [True, True]),
        (3, one, [True], [True]),
        (2, no, [True, False], [False, False]),
        (4, one, [True], [True]),
    ]
    # when the next token is wrong it counts as a miss
    wrong = accept_draft(batch, torch.tensor([[10, 77], [21, 0], [99, 0], [40, 5]]))
    assert branch_outcomes(batch, wrong)[:2] == [(2, no, [True, True], [True, False]), (3, one, [True], [False])]
    # the matrix's agreement travels with the drafted tokens and the one past the cap, not further
    agreed = build_draft(roots, tree, torch.zeros(0, dtype=torch.long), chains=chains, match_lengths=[2, 3, 2, 4],
                         row_nodes=[0, 0, 0, 0], caps=[1, 0, 1, 1],
                         agreements=[[True, False, True], [False, True], [True, True], [True]])
    assert agreed.chain_agreement == ((True, False), (False,), (True, True), (True,))
    assert [o[1] for o in branch_outcomes(agreed, acceptance)] == [(True, False), (False,), (True, True), (True,)]


def _template_tables(batch, acceptance):
    """The whole template's tables :func:`_table_outcomes` reads: the template drafted
    [b, N+1], the model's choice after every template node [b, N+1] and which nodes each row
    verified (a prefix of the batch's template columns) [b, N+1]."""
    rows = batch.tokens.shape[0]
    n_full = batch.template_draft.shape[1] - 1
    cols = np.concatenate([[0], batch.template_nodes.numpy()])
    choice = np.zeros((rows, n_full + 1), dtype=np.int64)
    choice[:, cols] = acceptance.choices[:, : len(cols)].numpy()
    verified = np.zeros((rows, n_full + 1), dtype=bool)
    verified[:, cols] = np.arange(len(cols))[None, :] <= np.asarray(batch.row_nodes)[:, None]
    return batch.template_draft.numpy(), choice, verified


def test_the_outcome_walk_finds_what_the_template_tables_find():
    """TreeBudget.observe and observe_template walk each row's accepted path (node_outcomes)
    instead of scanning the whole template's tables (_table_outcomes): on random drafts of the 80-node template,
    rows verifying different prefixes, with and without branches and duplicate tokens, both count
    the same hits and trials."""
    from dataclasses import replace

    from tr_serve.tr.acceptance_stats import node_outcomes, observe_template
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.tree import load_template, order_by_rates
    from tr_serve.tr.verifier import accept_draft

    paths = load_template("2.2.2", 8)[1]
    tree = compile_tree(paths)
    n = tree.num_nodes
    index = {p: i + 1 for i, p in enumerate(paths)}
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        b = 1 + trial % 5
        # the budget's order: re-ranked nodes, parents first; a step verifies a prefix of it
        q = dict(zip(paths, torch.rand(n, generator=gen).tolist()))
        rates = [float(torch.tensor([q[p[:d]] for d in range(1, len(p) + 1)]).prod()) for p in paths]
        order = [index[p] for p in order_by_rates(paths, rates)]
        row_nodes = [int(torch.randint(0, n + 1, (), generator=gen)) // (1 + trial % 7) for _ in range(b)]
        width = max(row_nodes)  # the step's tree: the widest row's nodes
        sub = compile_tree([paths[i - 1] for i in order[:width]])
        full = torch.randint(0, 4, (b, n + 1), generator=gen)  # few distinct tokens: many accepted paths
        full[:, 1:][torch.rand(b, n, generator=gen) < 0.1] = -1  # EMPTY nodes
        chains = [[int(t) for t in torch.randint(0, 4, (int(torch.randint(0, 3, (), generator=gen)),), generator=gen)]
                  for _ in range(b)]
        columns = torch.tensor([0] + order[:width])
        batch = build_draft(full[:, columns], sub, columns[1:], chains=chains, match_lengths=[2] * b,
                            row_nodes=row_nodes)
        batch = replace(batch, template_draft=full)
        q = batch.tokens.shape[1]
        acceptance = accept_draft(batch, torch.randint(0, 4, (b, q), generator=gen))
        dense = AcceptanceStats(tree, decay=0.9, prior_weight=1.0)
        walked = AcceptanceStats(tree, decay=0.9, prior_weight=1.0)
        dense.add_rows(_table_outcomes(tree, *_template_tables(batch, acceptance)))
        rows = node_outcomes(tree, batch, acceptance)
        walked.add_rows(rows)
        assert torch.equal(dense.trials, walked.trials) and torch.equal(dense.hits, walked.hits), trial
        fixed = AcceptanceStats(tree, decay=0.9, prior_weight=1.0)  # what a fixed tree's estimates see
        observe_template(fixed, batch, acceptance)
        assert torch.equal(dense.trials, fixed.trials) and torch.equal(dense.hits, fixed.hits), trial
        assert any(o for _, o in rows)


def test_suffix_stats_price_a_token_by_its_vote_match_length_and_agreement():
    from tr_serve.tr.acceptance_stats import SuffixStats

    cell = SuffixStats.cell
    # one occurrence in one is a vote of 0.5; nine of ten 0.82: cells apart
    assert cell(3, 1, 1, False) != cell(3, 9, 10, False)
    assert cell(3, 9, 10, False) != cell(12, 9, 10, False) != cell(12, 9, 10, True)
    assert cell(3, 1, 1, False) == cell(4, 2, 3, False)  # the same vote (0.5) and match bucket (3-4)
    stats = SuffixStats(decay=1.0, prior_weight=2.0)
    prior = stats.rates()
    assert prior[cell(3, 9, 10, False)] > prior[cell(3, 1, 1, False)] > prior[cell(3, 1, 4, False)]
    strong, weak = cell(12, 9, 10, True), cell(3, 1, 1, False)
    for _ in range(8):  # strong tokens right, then the weak one after them wrong
        stats.update([((strong, strong, weak), [True, True, True], [True, True, False])])
    stats.update([((weak, strong), [True, False], [False, False])])  # the second is not observed: its parent failed
    assert stats.trials[strong] == 2.0 + 16 and stats.hits[strong] == pytest.approx(2.0 * SuffixStats.VOTE_PRIORS[4] + 16)
    assert stats.trials[weak] == 2.0 + 9 and stats.hits[weak] == pytest.approx(2.0 * SuffixStats.VOTE_PRIORS[2])
    rates = stats.path_rates([strong, weak])
    assert rates[0] == pytest.approx(stats.rates()[strong]) and rates[1] == pytest.approx(rates[0] * stats.rates()[weak])


def test_suffix_branches_are_learned_by_suffix_stats_and_other_branches_by_context_stats():
    from tr_serve.tr.acceptance_stats import SuffixStats, branch_outcomes, suffix_outcomes
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.verifier import accept_draft

    tree = compile_tree([])
    roots = torch.tensor([[1], [1]])
    cells = [SuffixStats.cell(5, 3, 3, False), SuffixStats.cell(5, 2, 3, True)]
    batch = build_draft(roots, tree, torch.zeros(0, dtype=torch.long), chains=[[10, 11], [20, 21]],
                        match_lengths=[2, 5], row_nodes=[0, 0], caps=[2, 1], cells=[None, cells])
    assert batch.branch_cells == ((), tuple(cells))  # the drafted token and the one past the cap
    acceptance = accept_draft(batch, torch.tensor([[10, 11, 0], [20, 21, 0]]))
    assert branch_outcomes(batch, acceptance) == [(2, (False, False), [True, True], [True, True])]
    assert suffix_outcomes(batch, acceptance) == [(tuple(cells), [True, True], [True, True])]
