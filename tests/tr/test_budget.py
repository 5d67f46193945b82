"""The cost-aware budget: its order, calibration, lean steps and kept plans."""

from __future__ import annotations

import pytest
import torch

from tr_serve.tr.step_latency import LatencyTable, StepLatency
from tr_serve.tr.tree import compile_tree


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
    assert isinstance(budget, TreeBudget) and drafter.acceptance is budget.acceptance and budget.latency is latency
    assert drafter._subtree(2)[1].tolist() == [1, 2]  # level order first
    budget.reorder([0.1, 0.9, 0.05, 0.8])  # node 2 (path (1,)) and its child are the likely ones
    assert budget.order == [2, 4, 1, 3] and budget.order_version == 1
    assert drafter.order is budget.order
    assert drafter._subtree(2)[1].tolist() == [2, 4]  # the drafter's subtrees follow the new order
    budget.reorder([0.1, 0.9, 0.05, 0.8])
    assert budget.order_version == 1  # unchanged order: the subtrees stay valid


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
    successors = lambda row, before, token: [1]  # noqa: E731
    assert budget.plan([0], successors, [[]], [0]) == [(2, 0)]
    for _ in range(300):
        budget.plan([0], successors, [[]], [0])
        budget.calibration.observe(budget._expected[0], 0)  # what observe() records when no template node is accepted
    assert budget.calibration.scale < 0.5
    assert budget.plan([0], successors, [[]], [0]) == [(0, 0)]


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
    successors = lambda row, before, token: [1, 2]  # noqa: E731
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
    successors = lambda row, before, token: [1]  # noqa: E731
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
    successors = lambda row, before, token: [1]  # noqa: E731
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
    successors = lambda row, before, token: [1]  # noqa: E731 (the template drafts 1 under every node)
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
    successors = lambda row, before, token: [1]  # noqa: E731 (the template drafts 1 under every node)
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
    successors = lambda row, before, token: [1]  # noqa: E731

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


def test_the_engine_verifies_the_fixed_node_count_on_every_row_and_step(tokenizer):
    from tiny_model import tiny_loaded
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine
    from tr_serve.sampling_params import SamplingParams

    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.5)
    prompt = [5, 17, 230, 402, 9, 33, 71, 12, 5, 17, 230]
    plain = Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128))
    engine = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=128))
    engine.speculator.drafter.budget.fixed_nodes = 4
    outs = {}
    for name, e in (("plain", plain), ("fixed", engine)):
        e.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
        while e.has_unfinished():
            outs.update({name: o for o in e.step() if o.finished})
    assert outs["fixed"].token_ids == outs["plain"].token_ids
    nodes = outs["fixed"].stats.tree_nodes_per_step
    assert nodes and set(nodes[:-1]) == {4}  # the last step may be cut by the room left
