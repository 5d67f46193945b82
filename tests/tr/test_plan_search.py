"""The plan search: per row, template nodes and branch tokens for the most expected tokens per second."""

from __future__ import annotations

import pytest

from tr_serve.tr.plan_search import choose_plan
from tr_serve.tr.step_latency import LatencyTable, StepLatency


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
    from tr_serve.tr.plan_search import DRAFT_MARGIN

    free = StepLatency(LatencyTable((1, 64), (1.0, 1.0)))  # extra query tokens cost nothing
    slight = 0.5 * DRAFT_MARGIN  # expected gain: half the margin
    assert choose_plan([slight], [NO_BRANCH], free, (0, 1), (0,)) == [(0, 0)]
    assert choose_plan([2 * DRAFT_MARGIN], [NO_BRANCH], free, (0, 1), (0,)) == [(1, 0)]


def test_price_picks_equal_the_best_option_at_every_price():
    """The hull walk picks what scoring every option at every price picks (the cheaper on a tie)."""
    import random

    from tr_serve.tr.plan_search import _PRICES, _frontier, _price_picks

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

    from tr_serve.tr.plan_search import _PRICES, DRAFT_MARGIN, _frontier

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
    from tr_serve.tr.plan_search import plan_gains

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


def test_a_fixed_node_count_verifies_the_best_estimated_nodes_whatever_they_cost():
    from tr_serve.tr.plan_search import NOT_VERIFIED, choose_fixed_plan

    template = [0.5, 0.3, 0.2, 0.1]
    apart = ([NOT_VERIFIED] * 3, [0.6, 0.5, 0.1])  # a branch that merges into no template node
    # 3 nodes: the branch's first two (0.6 + 0.5) and the template's first (0.5) beat every other split
    assert choose_fixed_plan(template, [apart, ([], [])], 3) == [(1, 2), (3, 0)]
    assert choose_fixed_plan(template, [apart], 1) == [(0, 1)]  # the single best node: the branch's first
    assert choose_fixed_plan(template, [([], [])], 16) == [(4, 0)]  # no more nodes than the template has
    # a branch token merged into a template node is the branch's, and costs no node of its own
    merged = ([0, NOT_VERIFIED, NOT_VERIFIED], [0.7, 0.4, 0.3])
    assert choose_fixed_plan(template, [merged], 2) == [(0, 2)]  # 0.7 + 0.4 (n=1 is the same node and 1 more)
    # node 1 holds the branch's first token (priced 0.7 as the branch's), node 2 (0.8) beats its second (0.4)
    assert choose_fixed_plan([0.9, 0.8, 0.1, 0.1], [merged], 2) == [(2, 0)]
    assert choose_fixed_plan([0.9, 0.8, 0.1, 0.1], [merged], 3) == [(2, 1)]
    # the branchless rows' own estimates, where given
    assert choose_fixed_plan(template, [([], [])], 2) == [(2, 0)]
