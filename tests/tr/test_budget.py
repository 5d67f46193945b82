"""Cost-aware budget: acceptance statistics, latency interpolation, the budget choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tr_serve.tr.budget import AcceptanceStats, LatencyTable, StepLatency, choose_plan
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


def test_latency_table_interpolates_and_extrapolates():
    t = LatencyTable((1, 3, 5), (1.0, 2.0, 4.0))
    assert t(1) == 1.0 and t(2) == 1.5 and t(4) == 3.0
    assert t(7) == 6.0  # last slope
    assert t(0) == 1.0


NO_BRANCH = ([], [])


def test_budget_grows_when_forwards_are_flat_and_shrinks_when_linear():
    rates = [0.6, 0.3, 0.2, 0.1]
    flat = StepLatency(LatencyTable((1, 64), (1.0, 1.1)))  # GPU-like: more tokens nearly free
    linear = StepLatency(LatencyTable((1, 64), (1.0, 64.0)))  # every token costs a full forward
    assert choose_plan(rates, [NO_BRANCH], flat, (0, 1, 2, 4), (0,)) == [(4, 0)]
    assert choose_plan(rates, [NO_BRANCH], linear, (0, 1, 2, 4), (0,)) == [(0, 0)]
    assert choose_plan(rates, [NO_BRANCH], linear, (0, 1, 2, 4), (0,), explore=True) == [(1, 0)]  # runner-up


def test_measured_step_latency_corrects_the_calibrated_table():
    rates = [0.6, 0.3, 0.2, 0.1]
    latency = StepLatency(LatencyTable((1, 64), (1.0, 1.1)), alpha=1.0)
    # the one-row table says 40 tokens cost about one forward: every row verifies 4 nodes
    assert choose_plan(rates, [NO_BRANCH] * 8, latency, (0, 4), (0,)) == [(4, 0)] * 8
    latency.observe(8, 8, 1.0, width=1)
    latency.observe(8, 40, 3.0, width=5)  # measured: a batch of 8 trees costs 3 plain steps, more than it brings
    assert latency(8, 40, 5) == pytest.approx(3.0)
    # the offset over the table is added: the table still prices each extra token
    assert latency(8, 48, 5) == pytest.approx(3.0 + latency.table(48) - latency.table(40))
    assert latency(4, 8, 1) == latency.table(8)  # another row count: the table until it is measured
    assert choose_plan(rates, [NO_BRANCH] * 8, latency, (0, 4), (0,)) == [(0, 0)] * 8


def test_step_latency_adds_a_per_shape_offset_and_caps_spikes():
    # measured on CPU: 13 rows cost the one-row table plus a few ms whatever their tokens; a
    # ratio would also scale the price of every drafted token
    table = LatencyTable((1, 16, 32), (0.030, 0.040, 0.060))
    latency = StepLatency(table, alpha=0.5)
    latency.observe(13, 13, 0.045, width=1)
    offset = 0.045 - table(13)
    assert latency(13, 13, 1) == pytest.approx(0.045)
    assert latency(13, 29, 2) == pytest.approx(table(29) + offset)  # nearest seen width, the table's slope
    assert latency(13, 29, 2) - latency(13, 13, 1) == pytest.approx(table(29) - table(13))
    latency.observe(13, 13, 1.0, width=1)  # a 1 s hiccup of the machine counts as 1.5x the prediction
    assert latency(13, 13, 1) == pytest.approx(0.045 + 0.5 * (1.5 * 0.045 - 0.045))
    assert latency(4, 13, 1) == table(13)  # another row count: the table until it is measured


def test_padded_width_is_priced_per_row_count():
    # 8 rows, 12 query tokens in all: 1 wide row padded to 5 costs more than the same tokens
    # spread 1-2 per row, because attention runs every row at the padded width
    latency = StepLatency(LatencyTable((1, 64), (1.0, 1.1)), alpha=1.0)
    latency.observe(8, 12, 1.1, width=2)
    latency.observe(8, 12, 2.0, width=5)
    assert latency(8, 12, 2) < latency(8, 12, 5)
    assert latency(8, 12, 8) == latency(8, 12, 5)  # same power-of-two width bucket (5-8)
    assert latency(8, 12, 16) == latency(8, 12, 5)  # unseen width: the nearest seen one
    assert StepLatency.bucket(16) != StepLatency.bucket(17)  # the runner's attention paths part at 16


def test_only_rows_with_a_promising_branch_draft_beside_plain_rows():
    # a weak template and two rows with a confident 6-token branch among six plain rows: on a CPU-like
    # table where each query token costs 2% of a forward, the branch rows verify their branches and
    # the others run one-token steps in the same forward (packed, so they pay nothing for it)
    template = [0.05, 0.02, 0.01, 0.01]
    confident = ([1 << 30] * 6, [0.9 ** (j + 1) for j in range(6)])
    cpu = StepLatency(LatencyTable((1, 64), (0.03, 0.03 + 63 * 0.0006)))
    plan = choose_plan(template, [confident, NO_BRANCH, NO_BRANCH, confident, NO_BRANCH, NO_BRANCH, NO_BRANCH,
                                  NO_BRANCH], cpu, (0, 1, 2, 4), (0, 2, 4, 6))
    assert plan[0] == plan[3] == (0, 6)
    assert all(p == (0, 0) for i, p in enumerate(plan) if i not in (0, 3))


def test_context_stats_are_conditional_and_bucketed_by_match_length():
    from tr_serve.tr.budget import ContextStats

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
    from tr_serve.tr.budget import ContextStats

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


def test_plan_buys_a_confident_branch_only_when_the_forward_is_cheap_enough():
    template = [0.5, 0.2, 0.1, 0.05]
    confident = ([1 << 30] * 6, [0.9 ** (j + 1) for j in range(6)])  # nothing merges; p_j = 0.9^(j+1)
    flat = StepLatency(LatencyTable((1, 64), (0.03, 0.031)))
    steep = StepLatency(LatencyTable((1, 2, 64), (0.03, 0.06, 2.0)))
    assert choose_plan(template, [confident], flat, (0, 1, 2, 4), (0, 2, 4, 6)) == [(4, 6)]
    assert choose_plan(template, [confident], steep, (0, 1, 2, 4), (0, 2, 4, 6)) == [(0, 0)]


def test_plan_counts_merged_branch_tokens_as_free():
    # the branch's first two tokens are template nodes at order positions 0 and 1: with n >= 2 they
    # cost nothing and are priced at the branch's rates, and the third token hangs below them as one
    # extra node
    template = [0.6, 0.5, 0.01, 0.01]
    branch = ([0, 1, 1 << 30], [0.9, 0.85, 0.8])
    latency = StepLatency(LatencyTable((1, 2, 3, 4, 5), (0.030, 0.036, 0.042, 0.048, 0.054)))
    [(n, cap)] = choose_plan(template, [branch], latency, (0, 1, 2, 4), (0, 1))
    assert (n, cap) == (2, 1)  # 3 nodes verified: 1 + 0.9 + 0.85 + 0.8 expected tokens for 0.042 s


def test_a_plan_within_the_margin_of_plain_decoding_stays_plain():
    from tr_serve.tr.budget import DRAFT_MARGIN

    free = StepLatency(LatencyTable((1, 64), (1.0, 1.0)))  # extra query tokens cost nothing
    slight = 0.5 * DRAFT_MARGIN  # expected gain: half the margin
    assert choose_plan([slight], [NO_BRANCH], free, (0, 1), (0,)) == [(0, 0)]
    assert choose_plan([2 * DRAFT_MARGIN], [NO_BRANCH], free, (0, 1), (0,)) == [(1, 0)]


def test_tree_budget_owns_its_order_and_the_drafter_follows_it():
    from tr_serve.tr.budget import TreeBudget
    from tr_serve.tr.drafter import Drafter
    from tr_serve.tr.matrix import AdjacencyMatrix
    from tr_serve.tr.tree import compile_tree
    from tr_serve.tr.tree_spec import parse_tree_spec

    tree = compile_tree([[0], [1], [0, 0], [1, 0]])
    latency = StepLatency(LatencyTable((1, 64), (1.0, 1.0)))
    drafter = Drafter(parse_tree_spec("top4", "auto"), tree, AdjacencyMatrix(16, 2), latency)
    budget = drafter.budget
    assert isinstance(budget, TreeBudget) and drafter.acceptance is budget.acceptance and drafter.latency is latency
    assert drafter._subtree(2)[1].tolist() == [1, 2]  # level order first
    budget.reorder([0.1, 0.9, 0.05, 0.8])  # node 2 (path (1,)) and its child are the likely ones
    assert budget.order == [2, 4, 1, 3] and budget.order_version == 1
    assert drafter.order is budget.order
    assert drafter._subtree(2)[1].tolist() == [2, 4]  # the drafter's subtrees follow the new order
    budget.reorder([0.1, 0.9, 0.05, 0.8])
    assert budget.order_version == 1  # unchanged order: the subtrees stay valid


def test_price_picks_equal_the_best_option_at_every_price():
    """The hull walk picks what scoring every option at every price picks (the cheaper on a tie)."""
    import random

    from tr_serve.tr.budget import _PRICES, _frontier, _price_picks

    rng = random.Random(0)
    for _ in range(300):
        options = [(rng.choice([0.0, rng.random() * 4, round(rng.random() * 4, 1)]), rng.randrange(0, 40),
                    rng.randrange(0, 80), 0) for _ in range(rng.randrange(1, 14))]
        options.append((0.0, 0, 0, 0))  # plain decoding is always an option
        for price, pick in zip(_PRICES, _price_picks(_frontier(options))):
            if price == float("inf"):
                assert pick == min(options, key=lambda o: (o[1], -o[0]))  # the cheapest, its best gain
                continue
            best = max(options, key=lambda o: (o[0] - price * o[1], -o[1]))
            ties = [o for o in options if abs((o[0] - price * o[1]) - (best[0] - price * best[1])) < 1e-9]
            assert pick in ties  # the best option itself, unless another scores the same to rounding
            assert len(ties) > 1 or pick == best


def test_plan_is_the_best_scored_price_pick_or_plain_within_the_margin():
    """choose_plan against a plain re-statement of its rule, on random rates and branches: every
    price picks each row's best option (tie: the cheaper), each distinct plan is scored by expected
    tokens per second, the best wins (tie: fewer nodes and caps), and plain decoding wins when the
    best is within DRAFT_MARGIN of it."""
    import random

    from tr_serve.tr.budget import _PRICES, DRAFT_MARGIN, _frontier

    rng = random.Random(1)
    nodes, caps = (0, 1, 2, 4, 8), (0, 1, 2, 4)
    for _ in range(400):
        slope = rng.choice([0.01, 0.05, 0.1, 0.2, 0.3])  # seconds per query token past the first
        latency = StepLatency(LatencyTable((1, 128), (1.0, 1.0 + 127 * slope)))
        rates = sorted((rng.random() * rng.choice([0.1, 0.3, 0.8]) for _ in range(8)), reverse=True)
        chains = []
        for _ in range(rng.randrange(1, 7)):
            m = rng.choice([0, 0, 2, 4])
            merged = sorted(rng.sample(range(8), rng.randrange(0, m + 1)))  # a rising prefix of the branch
            chains.append((merged + [1 << 30] * (m - len(merged)), [0.9 ** (j + 1) for j in range(m)])
                          if m else NO_BRANCH)
        options_per_row = []
        for merge_pos, branch in chains:
            options = []
            for n in nodes:
                merged = sum(1 for pos in merge_pos if pos < n)
                for cap in caps:  # merged nodes at the branch's rates, in place of the template's
                    extra = min(cap, len(branch) - merged) if branch else 0
                    gain = (sum(rates[:n]) - sum(rates[pos] for pos in merge_pos[:merged]) + sum(branch[: merged + extra])
                            if branch else sum(rates[:n]))
                    options.append((gain, n + extra, n, cap if branch else 0))
            options_per_row.append(_frontier(options))
        rows = len(chains)
        scored = {}
        for price in _PRICES:
            plan = []
            for frontier in options_per_row:
                if price == float("inf"):
                    plan.append(frontier[0])
                else:
                    plan.append(max(frontier, key=lambda o: (o[0] - price * o[1], -o[1])))
            key = tuple((o[2], o[3]) for o in plan)
            if key not in scored:
                gain, cost = sum(o[0] for o in plan), sum(o[1] for o in plan)
                scored[key] = ((rows + gain) / latency(rows, rows + cost, 1 + max(o[1] for o in plan)),
                               sum(o[2] + o[3] for o in plan))
        best = max(scored.items(), key=lambda kv: (kv[1][0], -kv[1][1]))
        plain = tuple((f[0][2], f[0][3]) for f in options_per_row)
        within = best[0] != plain and best[1][0] < scored[plain][0] * (1 + DRAFT_MARGIN)
        want = list(plain) if within else list(best[0])
        got = choose_plan(rates, chains, latency, nodes, caps)
        assert [(n, cap if chains[r][1] else 0) for r, (n, cap) in enumerate(got)] == want


def test_plan_gains_count_merged_template_nodes_as_branch_tokens():
    from tr_serve.tr.budget import plan_gains

    def plan_gain(*args):
        return sum(plan_gains(*args))

    template = [0.6, 0.5, 0.2, 0.1]
    branch = ([0, 1, 1 << 30, 1 << 30], [0.9, 0.8, 0.7, 0.6])  # first two merge into order positions 0, 1
    assert plan_gain(template, [NO_BRANCH], [(3, 0)]) == pytest.approx(1.3)
    # n = 2: both merged tokens are template nodes already (counted once, at the branch's rates),
    # then at most 1 more
    assert plan_gain(template, [branch], [(2, 1)]) == pytest.approx(0.9 + 0.8 + 0.7)
    # n = 1: the second branch token is not among the verified nodes: it and the next come from the cap
    assert plan_gain(template, [branch], [(1, 2)]) == pytest.approx(0.9 + 0.8 + 0.7)
    assert plan_gain(template, [branch, NO_BRANCH], [(0, 0), (4, 0)]) == pytest.approx(1.4)
    # apart: the template nodes the branch merges into count as branch tokens
    assert plan_gains(template, [branch], [(1, 2)]) == pytest.approx((0.0, 0.9 + 0.8 + 0.7))
    assert plan_gains(template, [branch], [(4, 0)]) == pytest.approx((0.2 + 0.1, 0.9 + 0.8))


def test_calibration_scales_the_rates_by_what_verification_accepted():
    from tr_serve.tr.budget import GainCalibration

    cal = GainCalibration(decay=1.0, prior=10.0)
    assert cal.scale == 1.0
    cal.observe(expected=30.0, accepted=10)  # promised 30 drafts, 10 accepted: (10 + 10) / (10 + 30)
    assert cal.scale == pytest.approx(0.5)
    for _ in range(50):
        cal.observe(expected=10.0, accepted=0)
    assert cal.scale == cal.bounds[0]  # never below its floor: the plan search keeps some trust


def _budget(latency: StepLatency):
    from tr_serve.tr.budget import TreeBudget
    from tr_serve.tr.tree import compile_tree

    tree = compile_tree([[0], [0, 0]])
    return TreeBudget(tree, latency, context_tokens=0, node_candidates=(0, 1, 2), chain_caps=(0,), explore_every=1000)


def test_an_overpromising_budget_learns_to_draft_less():
    # the template's prior promises about 0.6 + 0.36 accepted drafts; a forward of 3 tokens costs
    # 1.5 plain ones: worth it at face value, not once verification keeps accepting nothing
    latency = StepLatency(LatencyTable((1, 3), (1.0, 1.5)))
    budget = _budget(latency)
    budget.branchless.hits[:] = torch.tensor([0.9, 0.9]) * budget.branchless.trials  # the row has no branch
    successors = lambda before, token: [1]  # noqa: E731
    assert budget.plan([0], successors, [[]], [0]) == [(2, 0)]
    for _ in range(300):
        budget.plan([0], successors, [[]], [0])
        budget.calibration.observe(budget._expected[0], 0)  # what observe() records when no template node is accepted
    assert budget.calibration.scale < 0.5
    assert budget.plan([0], successors, [[]], [0]) == [(0, 0)]



def test_branch_outcomes_observe_the_first_token_past_the_cap():
    """A branch cut by its cap still reveals whether its next token was right (the model's token
    after the last verified one), so estimates of tokens the budget stopped drafting keep learning."""
    from tr_serve.tr.budget import branch_outcomes
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


def test_rows_without_a_branch_are_priced_by_their_own_estimates():
    """Text with no context match is harder to predict: the budget keeps the template's acceptance
    of those rows apart, learns it from them alone, and prices their nodes by it."""
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.verifier import accept_draft

    from tr_serve.tr.budget import TreeBudget

    latency = StepLatency(LatencyTable((1, 3), (1.0, 1.5)))
    budget = TreeBudget(compile_tree([[0], [0, 0]]), latency, context_tokens=4, node_candidates=(0, 1, 2),
                        chain_caps=(0, 1), explore_every=1000)
    budget.acceptance.hits[:] = torch.tensor([0.9, 0.9]) * budget.acceptance.trials
    budget.branchless.hits[:] = torch.tensor([0.05, 0.05]) * budget.branchless.trials
    successors = lambda before, token: [1, 2]  # noqa: E731
    # a row with a branch (whose one token the template does not hold) buys the template's nodes;
    # a row without one does not
    with_branch, alone = budget.plan([0, 0], successors, [[7], []], [2, 0])
    assert with_branch[0] == 2 and alone == (0, 0)
    budget.branchless.hits[:] = torch.tensor([0.9, 0.9]) * budget.branchless.trials
    budget.branchless._rates = None
    assert budget.plan([0, 0], successors, [[7], []], [2, 0])[1] == (2, 0)
    # one step in which both rows verified the first node and its child, and the model chose them:
    # only the row without a branch updates the branchless estimates
    tree = budget.template
    draft = torch.tensor([[0, 1, 1], [0, 1, 1]])
    batch = build_draft(draft, tree, torch.arange(1, 3), chains=[[7], []], match_lengths=[2, 0], row_nodes=[2, 2])
    from dataclasses import replace
    batch = replace(batch, template_draft=draft)
    before_all, before_alone = budget.acceptance.trials.clone(), budget.branchless.trials.clone()
    budget.observe(batch, accept_draft(batch, torch.tensor([[1, 1, 5, 0], [1, 1, 5, 0]])), None)
    assert torch.allclose(budget.acceptance.trials, before_all * budget.acceptance.decay + 2)
    assert torch.allclose(budget.branchless.trials, before_alone * budget.branchless.decay + 1)


def test_steps_turn_lean_when_plans_stop_buying_template_nodes_and_a_plan_that_buys_ends_it():
    """Lean steps plan the context branches alone; one step in explore_every stays a full plan,
    and a full plan that buys a template node ends the lean steps."""
    from tr_serve.tr.budget import TreeBudget

    expensive = StepLatency(LatencyTable((1, 3), (1.0, 3.0)))  # every query token costs a forward
    budget = TreeBudget(compile_tree([[0], [0, 0]]), expensive, context_tokens=4, node_candidates=(0, 1, 2),
                        chain_caps=(0, 1, 2), explore_every=8)
    successors = lambda before, token: [1]  # noqa: E731
    assert not budget.lean_next  # a new budget plans in full
    kinds = []
    for step in range(1, 65):
        if budget.lean_next:
            kinds.append("lean")
            plans = budget.plan_branches([[5, 6], []], [3, 0])
        else:
            kinds.append("full")
            plans = budget.plan([0, 0], successors, [[5, 6], []], [3, 0])
        if step % 8:  # not an exploring step (which runs the runner-up plan)
            assert plans == [(0, 0), (0, 0)]
    assert kinds[:20] == ["full"] * 20  # the moving average needs a run of plans without template nodes
    assert "lean" in kinds and kinds[-8:].count("full") == 1  # then one full plan in explore_every
    assert all(k == "full" for i, k in enumerate(kinds, start=1) if i % 8 == 4 and i > 20)
    # forwards get cheap: the next full plan buys the template, and the steps are full again
    budget.latency = StepLatency(LatencyTable((1, 3), (1.0, 1.01)))
    budget.acceptance.hits[:] = torch.tensor([0.9, 0.9]) * budget.acceptance.trials
    budget.branchless.hits[:] = torch.tensor([0.9, 0.9]) * budget.branchless.trials
    budget.acceptance._rates = budget.branchless._rates = None
    while budget.lean_next:
        budget.plan_branches([[5, 6], []], [3, 0])
    assert budget.plan([0, 0], successors, [[5, 6], []], [3, 0])[1][0] == 2
    assert not budget.lean_next


def test_steps_turn_lean_when_the_template_costs_more_host_time_than_its_share_of_a_step_brings():
    """Plans that keep buying template nodes still go lean when the host time the template adds
    (full planning over lean planning, plus learning its outcomes) exceeds its expected share of
    a step's tokens times the step's latency."""
    from tr_serve.tr.budget import TreeBudget

    cheap = StepLatency(LatencyTable((1, 8), (1.0, 1.01)))
    budget = TreeBudget(compile_tree([[0], [0, 0]]), cheap, context_tokens=4, node_candidates=(0, 1, 2),
                        chain_caps=(0, 1, 2), explore_every=1000)
    budget.acceptance.hits[:] = 0.9 * budget.acceptance.trials
    budget.branchless.hits[:] = 0.9 * budget.branchless.trials
    budget.acceptance._rates = budget.branchless._rates = None
    successors = lambda before, token: [1]  # noqa: E731
    for _ in range(40):
        assert budget.plan([0, 0], successors, [[], []], [0, 0]) == [(2, 0), (2, 0)]  # the template pays
    assert budget.template_use > 0.9 and 0.4 < budget.template_share < 0.8  # 2 x (0.9 + 0.81) of 2 + 3.42 tokens
    budget.step_seconds = 1.0
    assert budget.template_host == 0.0 and not budget.lean_next  # nothing timed yet
    budget.observe_host(True, 0.3)
    budget.observe_host(False, 0.1)
    assert budget.template_host == pytest.approx(0.2) and not budget.lean_next  # 0.2 s < 0.63 of a 1 s step
    budget.step_seconds = 0.25
    assert budget.lean_next  # the same host time against a step 4x shorter: the template does not pay
    budget.steps = 1000 + 1000 // 2 - 1
    assert not budget.lean_next  # the half-way step between explorations stays a full plan
    # one slow plan (a first call) counts as twice the average, and the next usual one forgets it
    budget.observe_host(True, 5.0)
    assert budget.template_host == pytest.approx(0.9 * 0.3 + 0.1 * 0.6 - 0.1)
    budget.observe_host(True, 0.05)
    assert budget.template_host == pytest.approx(0.0)  # the average is at most twice the latest (0.1), less 0.1 lean


def test_a_lean_plan_prices_branches_and_its_step_leaves_the_template_estimates_alone():
    from dataclasses import replace

    from tr_serve.tr.budget import TreeBudget
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.verifier import accept_draft

    cheap = StepLatency(LatencyTable((1, 8), (1.0, 1.01)))
    budget = TreeBudget(compile_tree([[0], [0, 0]]), cheap, context_tokens=4, node_candidates=(0, 1, 2),
                        chain_caps=(0, 1, 2, 4), explore_every=1000)
    budget.template_use = 0.0
    assert budget.lean_next
    plans = budget.plan_branches([[5, 6, 7], []], [4, 0])
    assert plans == [(0, 4), (0, 0)]  # the whole branch where tokens are nearly free; no template
    roots = torch.tensor([[1], [2]])
    batch = build_draft(roots, compile_tree([]), torch.zeros(0, dtype=torch.long), [[5, 6, 7], []], [4, 0],
                        [0, 0], [4, 0])
    batch = replace(batch, template_draft=roots)
    hits, trials = budget.acceptance.hits.clone(), budget.acceptance.trials.clone()
    branch_trials = budget.context_stats.trials.clone()
    choices = torch.tensor([[5, 6, 9, 0], [3, 0, 0, 0]])  # row 0: two branch tokens right, the third wrong
    budget.observe(batch, accept_draft(batch, choices), None)
    assert torch.equal(budget.acceptance.hits, hits) and torch.equal(budget.acceptance.trials, trials)
    assert float((budget.context_stats.trials - branch_trials * budget.context_stats.decay).sum()) == pytest.approx(3.0)


def test_template_nodes_and_branch_tokens_are_calibrated_apart():
    """A step's accepted drafts are split at the row's template columns: those count against the
    plan's expected template gain, the rest against its expected branch gain."""
    from dataclasses import replace

    from tr_serve.tr.budget import TreeBudget
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.verifier import accept_draft

    tree = compile_tree([[0], [0, 0]])
    budget = TreeBudget(tree, StepLatency(LatencyTable((1, 8), (1.0, 1.01))), context_tokens=4,
                        node_candidates=(0, 1, 2), chain_caps=(0, 1, 2), explore_every=1000)
    successors = lambda before, token: [1]  # noqa: E731 (the template drafts 1 under every node)
    assert budget.plan([0], successors, [[7, 8]], [4]) == [(2, 2)]  # the template, and the branch beside it
    template_expected, branch_expected = budget._expected
    assert template_expected > 0 and branch_expected > 0
    draft = torch.tensor([[0, 1, 1]])
    batch = build_draft(draft, tree, torch.arange(1, 3), chains=[[7, 8]], match_lengths=[4], row_nodes=[2], caps=[2])
    batch = replace(batch, template_draft=draft)
    cal_t, cal_b = budget.calibration, budget.branch_calibration
    before = (cal_t.expected, cal_t.accepted, cal_b.expected, cal_b.accepted)
    # columns: root, template 1, template 2, branch 7, branch 8; the model chose 7, then 8 after it
    budget.observe(batch, accept_draft(batch, torch.tensor([[7, 5, 5, 8, 2]])), None)
    assert (cal_t.expected, cal_t.accepted) == pytest.approx((before[0] * cal_t.decay + template_expected,
                                                              before[1] * cal_t.decay + 0))
    assert (cal_b.expected, cal_b.accepted) == pytest.approx((before[2] * cal_b.decay + branch_expected,
                                                              before[3] * cal_b.decay + 2))


def test_template_nodes_a_branch_merges_into_are_calibrated_as_the_branchs():
    """A template column that a branch token merged into counts against the branch's expected gain
    (plan_gains prices it at the branch's rate): the template's calibration only sees the nodes the
    context did not back."""
    from dataclasses import replace

    from tr_serve.tr.budget import TreeBudget
    from tr_serve.tr.draft import build_draft
    from tr_serve.tr.verifier import accept_draft

    tree = compile_tree([[0], [0, 0]])
    budget = TreeBudget(tree, StepLatency(LatencyTable((1, 8), (1.0, 1.01))), context_tokens=4,
                        node_candidates=(0, 1, 2), chain_caps=(0, 1, 2), explore_every=1000)
    successors = lambda before, token: [1]  # noqa: E731 (the template drafts 1 under every node)
    plan = budget.plan([0], successors, [[1, 8]], [4])
    template_expected, branch_expected = budget._expected
    assert plan == [(2, 1)] and template_expected == pytest.approx(budget.acceptance.rate_list()[1])
    draft = torch.tensor([[0, 1, 1]])
    batch = build_draft(draft, tree, torch.arange(1, 3), chains=[[1, 8]], match_lengths=[4], row_nodes=[2], caps=[1])
    batch = replace(batch, template_draft=draft)
    assert batch.chain_columns == ((1, 3),)  # the branch's 1 is template column 1, its 8 a column of its own
    cal_t, cal_b = budget.calibration, budget.branch_calibration
    before = (cal_t.accepted, cal_b.accepted)
    # columns: root, template 1 (= branch 1), template 1 under it, branch 8 under it; the model chose 1, then 8
    budget.observe(batch, accept_draft(batch, torch.tensor([[1, 8, 5, 2]])), None)
    assert cal_t.accepted == pytest.approx(before[0] * cal_t.decay + 0)
    assert cal_b.accepted == pytest.approx(before[1] * cal_b.decay + 2)


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

    from tr_serve.tr.budget import node_outcomes, observe_template
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


def test_a_plan_of_rows_without_branches_is_reused_for_a_few_steps_only(monkeypatch):
    """Rows with no context branch are planned from the slowly moving estimates alone, so their plan
    is kept for REPLAN_EVERY steps of the same row count; a row with a branch, an exploring step and
    a new order of the template each plan again."""
    from tr_serve.tr import budget as budget_module
    from tr_serve.tr.budget import REPLAN_EVERY, TreeBudget

    searches = []
    search = budget_module.choose_plan
    monkeypatch.setattr(budget_module, "choose_plan", lambda *a, **k: searches.append(1) or search(*a, **k))
    latency = StepLatency(LatencyTable((1, 3), (1.0, 1.01)))  # query tokens nearly free
    budget = TreeBudget(compile_tree([[0], [0, 0]]), latency, context_tokens=4, node_candidates=(0, 1, 2),
                        chain_caps=(0, 1), explore_every=1000, reorder_every=1000)
    successors = lambda before, token: [1]  # noqa: E731

    def set_rates(p: float) -> None:
        for stats in (budget.acceptance, budget.branchless):
            stats.hits[:] = torch.tensor([p, p]) * stats.trials
            stats._rates = None

    def plan(chains: list[list[int]]) -> tuple[list[tuple[int, int]], bool]:
        """The plan, and whether it was searched for."""
        before = len(searches)
        plans = budget.plan([0] * len(chains), successors, chains, [2 if c else 0 for c in chains])
        return plans, len(searches) > before

    set_rates(0.9)
    assert plan([[]]) == ([(2, 0)], True)
    set_rates(0.0)  # nothing pays any more, but the kept plan stands until it is REPLAN_EVERY steps old
    assert [plan([[]]) for _ in range(REPLAN_EVERY - 1)] == [([(2, 0)], False)] * (REPLAN_EVERY - 1)
    assert plan([[]]) == ([(0, 0)], True)  # planned again
    set_rates(0.9)
    assert plan([[], []]) == ([(2, 0), (2, 0)], True)  # another row count: a plan of its own
    assert plan([[]]) == ([(0, 0)], False)  # the one-row plan is still kept
    assert plan([[7]])[1]  # a row with a branch: planned at once
    budget.explore_every = budget.steps + 1  # the next step explores (it verifies the runner-up plan)
    assert plan([[]])[1]
    budget.explore_every = 1000
    budget.order_version += 1  # a new order: the kept plans' nodes are other nodes
    assert plan([[]]) == ([(2, 0)], True)


def test_row_counts_measured_at_start_up_price_unseen_row_counts():
    # calibration measured 8 and 32 rows (runner/calibration.py): between them the offset is
    # interpolated, below 8 from one row's none, past 32 in proportion to the rows
    table = LatencyTable((1, 512), (0.010, 0.020), row_offsets=((8, 1, 0.004), (32, 1, 0.012), (32, 16, 0.030)))
    latency = StepLatency(table)
    assert latency(8, 8, 1) == pytest.approx(table(8) + 0.004)  # measured
    assert latency(32, 512, 16) == pytest.approx(table(512) + 0.030)
    assert latency(1, 4, 4) == table(4)  # one row: the table itself
    assert latency(4, 4, 1) == pytest.approx(table(4) + 0.004 * 3 / 7)
    assert latency(20, 20, 1) == pytest.approx(table(20) + 0.004 + 0.008 * 12 / 24)
    assert latency(64, 64, 1) == pytest.approx(table(64) + 0.012 * 2)
    latency.observe(20, 20, 0.050, width=1)  # what the engine measures then takes over
    assert latency(20, 20, 1) == pytest.approx(0.050)
    assert StepLatency(LatencyTable((1, 64), (1.0, 1.1)))(4, 8, 1) == LatencyTable((1, 64), (1.0, 1.1))(8)


def test_a_fixed_node_count_verifies_the_best_estimated_nodes_whatever_they_cost():
    from tr_serve.tr.budget import _NOT_VERIFIED, choose_fixed_plan

    template = [0.5, 0.3, 0.2, 0.1]
    apart = ([_NOT_VERIFIED] * 3, [0.6, 0.5, 0.1])  # a branch that merges into no template node
    # 3 nodes: the branch's first two (0.6 + 0.5) and the template's first (0.5) beat every other split
    assert choose_fixed_plan(template, [apart, ([], [])], 3) == [(1, 2), (3, 0)]
    assert choose_fixed_plan(template, [apart], 1) == [(0, 1)]  # the single best node: the branch's first
    assert choose_fixed_plan(template, [([], [])], 16) == [(4, 0)]  # no more nodes than the template has
    # a branch token merged into a template node is the branch's, and costs no node of its own
    merged = ([0, _NOT_VERIFIED, _NOT_VERIFIED], [0.7, 0.4, 0.3])
    assert choose_fixed_plan(template, [merged], 2) == [(0, 2)]  # 0.7 + 0.4 (n=1 is the same node and 1 more)
    # node 1 holds the branch's first token (priced 0.7 as the branch's), node 2 (0.8) beats its second (0.4)
    assert choose_fixed_plan([0.9, 0.8, 0.1, 0.1], [merged], 2) == [(2, 0)]
    assert choose_fixed_plan([0.9, 0.8, 0.1, 0.1], [merged], 3) == [(2, 1)]
    # the branchless rows' own estimates, where given
    assert choose_fixed_plan(template, [([], [])], 2, branchless_rates=[0.1, 0.1, 0.1, 0.1]) == [(2, 0)]


def test_the_engine_verifies_the_fixed_node_count_on_every_row_and_step(tokenizer):
    from tiny_model import tiny_loaded
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine
    from tr_serve.sampling_params import SamplingParams

    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.5)
    prompt = [5, 17, 230, 402, 9, 33, 71, 12, 5, 17, 230]
    plain = Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128))
    engine = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=128))
    engine.drafter.budget.fixed_nodes = 4
    outs = {}
    for name, e in (("plain", plain), ("fixed", engine)):
        e.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        while e.has_unfinished():
            outs.update({name: o for o in e.step() if o.finished})
    assert outs["fixed"].token_ids == outs["plain"].token_ids
    nodes = outs["fixed"].stats.tree_nodes_per_step
    assert nodes and set(nodes[:-1]) == {4}  # the last step may be cut by the room left


def test_suffix_stats_price_a_token_by_its_vote_match_length_and_agreement():
    from tr_serve.tr.budget import SuffixStats

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
    from tr_serve.tr.budget import SuffixStats, branch_outcomes, suffix_outcomes
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
