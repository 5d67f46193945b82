"""Cost-aware tree budget: how many template nodes to verify this step so that expected generated
tokens per second is highest on this device, for this batch, decided per row.

Greedy or sampled, the tokens a step accepts form one chain of the tree, so the expected number of
accepted drafts of a template prefix is the sum of its nodes' path-acceptance rates ``p_i``. The
step emits that plus one bonus token per row and costs one forward over the rows' query tokens
(packed: a row pays for its own nodes only), whose latency comes from a table measured on the
device at start-up, corrected by what serving measures.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Sequence

from tr_serve.tr.acceptance_stats import (AcceptanceStats, ContextStats, SuffixStats, branch_outcomes, node_outcomes,
                                          suffix_outcomes)
from tr_serve.tr.plan_search import NOT_VERIFIED, choose_fixed_plan, choose_plan, plan_gains
from tr_serve.tr.step_latency import LatencyTable, StepLatency
from tr_serve.tr.tree import CompiledTree, order_by_rates

if TYPE_CHECKING:
    from tr_serve.tr.draft import DraftBatch
    from tr_serve.tr.verifier import Acceptance


class GainCalibration:
    """How far the acceptance estimates over- or under-promise: decayed sums of the drafts a plan
    was expected to get accepted and of the drafts verification accepted, in the steps as chosen.

    Why: each per-node and per-branch rate is a fair estimate on its own, but a plan is the pick of
    the options whose estimates came out high, so its expected gain is biased up (measured on the
    dev questions with ``auto``: 0.87-0.89 of the expected drafts accepted at 4 and at 12+ rows).
    :attr:`scale` (accepted / expected, starting at 1) multiplies the rates the plan search sees.
    :class:`TreeBudget` keeps one for the template's nodes and one for the context branches'."""

    def __init__(self, decay: float = 0.99, prior: float = 20.0, bounds: tuple[float, float] = (0.25, 1.5)):
        self.decay = decay
        self.expected = prior  # a prior of ``prior`` drafts at face value
        self.accepted = prior
        self.bounds = bounds

    @property
    def scale(self) -> float:
        lo, hi = self.bounds
        return min(hi, max(lo, self.accepted / self.expected))

    def observe(self, expected: float, accepted: int) -> None:
        self.expected = self.decay * self.expected + expected
        self.accepted = self.decay * self.accepted + accepted


# Lean steps (TreeBudget.lean_next): when fewer than LEAN_BELOW of the recent plans (a moving
# average with weight 1 - LEAN_DECAY per plan) bought a template node, steps plan the context
# branches alone. Why: at 8 concurrent rows on a CPU plans bought almost no template node while
# drafting, walking and learning the template still cost host time every step.
LEAN_BELOW = 0.05
LEAN_DECAY = 0.9
# Lean steps also when the template is worth less than it costs: the moving average of the share of a
# full plan's expected tokens that its template nodes bring, times the step's latency, against the
# moving average of the host time drafting, planning and learning the template adds to a step
# (TreeBudget.observe_host). Why: at 4-8 concurrent rows plans kept buying a node for a row or two
# (so the rule above never fired) while the template brought less than its host time cost
# (measured: docs/token-recycling.md, "Decisions").
# Steps a plan of rows that all have no context branch is reused for the same row count (while
# the template's order is the same): such a plan follows the slowly moving estimates and latency
# alone, and planning it again costs about 0.4 ms a step after a forward (rate lists, plan search).
REPLAN_EVERY = 8


class TreeBudget:
    """The cost-aware budget (``tree: auto``): its state and its per-step decision in one object.

    It owns the per-node acceptance estimates, the context branch's acceptance by match length,
    the step latency model, the order in which template nodes are added (re-ranked every
    ``reorder_every`` steps by estimated acceptance, so a row verifies the most likely nodes),
    and the calibration of its expected gains against what verification accepts. The drafter asks
    it for a plan each step and hands it what the verification found."""

    def __init__(self, template: CompiledTree, latency: StepLatency, context_tokens: int,
                 node_candidates: tuple[int, ...], chain_caps: tuple[int, ...], explore_every: int = 16,
                 reorder_every: int = 64):
        n = template.num_nodes
        self.template = template
        self.latency = latency
        self.acceptance = AcceptanceStats(template)  # every row's: the order, and the rows with a branch
        # rows with no context branch apart: their text is harder to predict (measured at 4 rows on the
        # dev questions: the first node right 0.12-0.13 of the time there, estimated at 0.16 over all rows),
        # so pricing them with every row's rates bought nodes that did not pay
        self.branchless = AcceptanceStats(template)
        self.context_stats = ContextStats(context_tokens) if context_tokens else None
        self.suffix_stats = SuffixStats()  # branches from the cross-request suffix index, where the drafter has one
        self.node_candidates = tuple(sorted({c for c in node_candidates if c < n} | {n}))
        self.chain_caps = chain_caps if self.context_stats is not None else (0,)
        self.explore_every = explore_every
        self.reorder_every = reorder_every
        self._ranks = template.ranks.tolist()
        self._depths = template.depths.tolist()
        self.order_version = 0  # bumped when the order changes (subtrees built from it are stale)
        self._set_order(list(range(1, n + 1)))  # template nodes in the order a row adds them
        self.steps = 0
        # None: each step's node count is the plan's; a count: every row verifies that many drafted nodes,
        # the best estimated (choose_fixed_plan), to measure what the ranking is worth at that count
        self.fixed_nodes: int | None = None
        # the template's and the branches' rates are calibrated apart: their estimates are biased by
        # different amounts (measured at 4 rows on 16 dev questions, one calibration for both: 0.70
        # of the template nodes' expected drafts accepted, 0.92 of the branch tokens')
        self.calibration = GainCalibration()  # template nodes
        self.branch_calibration = GainCalibration()  # context-branch tokens
        self._expected: tuple[float, float] | None = None  # the last plan's (template, branch) expected drafts
        self.template_use = 1.0  # moving average of "the plan bought a template node" (full plans)
        self.template_share = 1.0  # moving average: the share of a full plan's expected tokens from template nodes
        self.step_seconds = 0.0  # moving average of a step's latency (measured, else the latency model's)
        self._host: dict[bool, float] = {}  # full plan or lean step -> moving average of its planning seconds
        self._template_learning: float | None = None  # moving average: seconds observe() spends on the template's outcomes
        # rows -> (order version, step planned, plans, expected drafts) of plans with no branch
        self._branchless_plans: dict[int, tuple[int, int, list[tuple[int, int]], tuple[float, float]]] = {}

    @property
    def lean_next(self) -> bool:
        """Whether the next step is lean (:meth:`plan_branches`): recent plans bought no template
        node, or the template is worth less than the host time it costs (:attr:`template_host`
        against :attr:`template_share` of a step). One step in ``explore_every`` (half-way between
        explorations) stays a full plan, so the template's acceptance keeps being observed and
        plans that buy nodes that pay end the lean steps."""
        step = self.steps + 1
        if step % self.explore_every == self.explore_every // 2 or self.fixed_nodes is not None:
            return False
        return self.template_use < LEAN_BELOW or self.template_host > self.template_share * self.step_seconds

    @property
    def template_host(self) -> float:
        """Host seconds the template adds to a step: planning a full step over planning a lean
        one (0 until a lean step was timed), plus learning the template's outcomes; 0 until the
        drafter times its plans (:meth:`observe_host`)."""
        full = self._host.get(True)
        if full is None:
            return 0.0
        return max(0.0, full - self._host.get(False, 0.0)) + (self._template_learning or 0.0)

    def observe_host(self, full: bool, seconds: float) -> None:
        """The drafter's time for one step's plan (the template drafted and walked, on a full plan)."""
        self._host[full] = _host_average(self._host.get(full), seconds)

    def branch_rates(self, chain: list[int], match: int, agreed: Sequence[bool] | None,
                     cells: Sequence[int] | None = None) -> list[float]:
        """Path rates of a row's branch: a suffix-index branch's by its tokens' ``cells``
        (:class:`SuffixStats`), any other by its match length and the matrix's agreement
        (:class:`ContextStats`)."""
        if not (self.context_stats and chain):
            return []
        if cells:
            return self.suffix_stats.path_rates(cells[: len(chain)])
        return self.context_stats.path_rates(match, agreed if agreed is not None else [False] * len(chain))

    def plan_branches(self, chains: list[list[int]], matches: list[int],
                      agreements: list[Sequence[bool]] | None = None,
                      cells: list[Sequence[int] | None] | None = None) -> list[tuple[int, int]]:
        """A lean step's plan: per row (0, branch cap), the context branches priced as in
        :meth:`plan`, with no template drafted (so none walked, and none observed afterwards)."""
        self.steps += 1
        agreements = agreements or [None] * len(chains)
        cells = cells or [None] * len(chains)
        chain_info = [([NOT_VERIFIED] * len(chain), self.branch_rates(chain, matches[r], agreements[r], cells[r]))
                      for r, chain in enumerate(chains)]
        explore = self.steps % self.explore_every == 0
        plans = choose_plan([], _scaled(chain_info, self.branch_calibration.scale), self.latency, (0,),
                            self.chain_caps, explore)
        self._expected = plan_gains([], chain_info, plans)
        return plans

    def plan(self, roots: list[int], successors: Callable[[int, int, int], Sequence[int]], chains: list[list[int]],
             matches: list[int], before: list[int] | None = None,
             agreements: list[Sequence[bool]] | None = None,
             cells: list[Sequence[int] | None] | None = None) -> list[tuple[int, int]]:
        """Per row, (template nodes, branch cap) for the most expected tokens per second.
        roots[r]: row r's last accepted token; successors(r, before, token): the candidates row r
        drafts after a token whose previous token is ``before`` (the template node of rank k under a node
        drafting ``t``, whose parent drafts ``s``, drafts ``successors(r, s, t)[k]``); chains[r]: row
        r's retrieved branch; matches[r]: the n-gram match length that found it; before[r]: the
        token before row r's root (-1, the default, when none is known); agreements[r]: per token of
        row r's branch, whether the matrix's first candidate of the token before it is that token
        (:class:`ContextStats`; None: it agreed with none); cells[r]: for a branch from the suffix
        index, its tokens' :class:`SuffixStats` cells (None: another kind of branch)."""
        agreements = agreements or [None] * len(chains)
        cells = cells or [None] * len(chains)
        self.steps += 1
        explore = self.steps % self.explore_every == 0
        branchless = not any(chains) and not explore and self.steps % self.reorder_every != 0
        if branchless:
            kept = self._branchless_plans.get(len(chains))
            if kept is not None and kept[0] == self.order_version and self.steps - kept[1] < REPLAN_EVERY:
                self._expected = kept[3]
                self._count_use(kept[2])
                return list(kept[2])
        rates = self.acceptance.rate_list()  # path rate of template node i at [i-1]
        if self.steps % self.reorder_every == 0:
            self.reorder(rates)
        position = self._position
        order_rates = [rates[node - 1] for node in self.order]
        alone = self.branchless.rate_list()
        branchless_rates = [alone[node - 1] for node in self.order]
        scale = self.calibration.scale
        chain_info = []
        children, ranks = self.template.children, self._ranks
        for r, chain in enumerate(chains):
            merge_pos, node, prev, drafted = [], 0, before[r] if before is not None else -1, roots[r]
            for tok in chain:  # walk the template while the branch's tokens are the ones it drafts
                after = successors(r, prev, drafted)
                nxt = next((c for c in children[node] if after[ranks[c]] == tok), None)
                if nxt is None:
                    break
                merge_pos.append(position[nxt])
                node, prev, drafted = nxt, drafted, tok
            merge_pos += [NOT_VERIFIED] * (len(chain) - len(merge_pos))
            chain_info.append((merge_pos, self.branch_rates(chain, matches[r], agreements[r], cells[r])))
        scaled = _scaled(chain_info, self.branch_calibration.scale)
        if self.fixed_nodes is not None:
            plans = choose_fixed_plan(order_rates, chain_info, self.fixed_nodes)
        else:
            plans = choose_plan([p * scale for p in order_rates], scaled, self.latency, self.node_candidates,
                                self.chain_caps, explore, [p * scale for p in branchless_rates])
        self._expected = plan_gains(order_rates, chain_info, plans, branchless_rates)
        if branchless:
            self._branchless_plans[len(chains)] = (self.order_version, self.steps, list(plans), self._expected)
        if not explore:  # the runner-up plan of an exploring step is not the budget's choice
            self._count_use(plans)
        return plans

    def _count_use(self, plans: list[tuple[int, int]]) -> None:
        bought = any(n > 0 for n, _ in plans)
        self.template_use = _lean_average(self.template_use, bought)
        if self._expected is not None:  # the plan's expected drafts, calibrated as the plan search saw them
            template = self._expected[0] * self.calibration.scale
            total = len(plans) + template + self._expected[1] * self.branch_calibration.scale
            self.template_share = _lean_average(self.template_share, template / total)

    def adopt_latency_table(self, table: LatencyTable) -> None:
        """Price steps by ``table`` from now on (:meth:`StepLatency.adopt`); plans kept for
        branchless steps were priced by the old one."""
        self.latency.adopt(table)
        self.forget_plans()

    def forget_plans(self) -> None:
        """Drop the plans kept for branchless steps: the latency they were priced by changed."""
        self._branchless_plans.clear()

    def reorder(self, rates: list[float]) -> None:
        """Re-rank the template nodes by estimated path rate (parents always before children)."""
        paths = self.template.template
        index = {p: i + 1 for i, p in enumerate(paths)}
        order = [index[p] for p in order_by_rates(paths, rates)]
        if order != self.order:
            self._set_order(order)
            self.order_version += 1

    def _set_order(self, order: list[int]) -> None:
        self.order = order
        self._position = {node: i for i, node in enumerate(order)}
        deepest, self._deepest = 0, [0]  # _deepest[n]: the deepest of the first n nodes
        for node in order:
            deepest = max(deepest, self._depths[node])
            self._deepest.append(deepest)

    def draft_depth(self, n: int) -> int:
        """Template levels to draft when rows verify at most the first ``n`` nodes: theirs, and one
        more, whose nodes' acceptance the verification also observes (their parents were verified)."""
        return min(self._deepest[n] + 1, self._deepest[-1])

    def observe(self, batch: "DraftBatch", acceptance: "Acceptance", seconds: float | None) -> None:
        """Learn from one verification: the step's measured latency, which template nodes and
        branch tokens were right (the model's argmax choices: for sampled rows too, as a proxy)."""
        self.learn(batch, acceptance, self.observe_latency(batch, seconds))

    def observe_latency(self, batch: "DraftBatch", seconds: float | None) -> float:
        """The step's measured latency into the latency model (every tenant's budget shares it);
        returns the step's seconds: measured, else the model's."""
        rows, width = batch.tokens.shape
        if seconds is not None:
            self.latency.observe(rows, batch.num_inputs, seconds, width)
            return seconds
        return self.latency(rows, batch.num_inputs, width)

    def learn(self, batch: "DraftBatch", acceptance: "Acceptance", step: float) -> None:
        """Learn from the rows this budget planned (``batch``: their draft, ``acceptance``: what
        verification decided for them) in a step of ``step`` seconds: which template nodes and
        branch tokens were right (the model's argmax choices: for sampled rows too, as a proxy)."""
        self.step_seconds = _lean_average(self.step_seconds, step) if self.step_seconds else step
        if self._expected is not None:
            # an accepted path runs through the row's template columns (1..row_nodes) first, then its branch's;
            # the template columns a branch token merged into count as the branch's (plan_gains)
            template = sum(sum(1 for node in nodes.tolist()[1:] if node <= k and node not in branch)
                           for nodes, k, branch in zip(acceptance.accepted_nodes, batch.row_nodes, batch.chain_columns))
            self.calibration.observe(self._expected[0], template)
            self.branch_calibration.observe(self._expected[1], sum(acceptance.num_accepted_drafts) - template)
            self._expected = None
        if batch.template_draft.shape[1] == self.template.num_nodes + 1:  # full plans: a lean step drafted no template
            # the same template: one walk finds every row's outcomes, each estimate counts its rows
            t0 = time.perf_counter()
            outcomes = node_outcomes(self.template, batch, acceptance)
            self.acceptance.add_rows(outcomes)
            alone = [outcomes[r] for r, m in enumerate(batch.match_lengths) if m == 0]
            if alone:
                self.branchless.add_rows(alone)
            self._template_learning = _host_average(self._template_learning, time.perf_counter() - t0)
        if self.context_stats is not None:
            self.context_stats.update(branch_outcomes(batch, acceptance))
            if batch.branch_cells and any(batch.branch_cells):
                self.suffix_stats.update(suffix_outcomes(batch, acceptance))


def _host_average(old: float | None, seconds: float) -> float:
    """A moving average of host times that one outlier cannot hold up: a sample counts as at most
    twice the average, and the average is at most twice the latest sample. Why: a step's host time
    jumps on first calls (a subtree compiled for a new node count or order, caches filled), and
    while steps are lean a full plan comes once in ``explore_every`` steps, so a plain average
    would keep such a jump, and the lean steps it caused, for hundreds of steps."""
    if old is None:
        return seconds
    return min(_lean_average(old, min(seconds, 2 * old)), 2 * seconds)


def _lean_average(old: float, sample: float) -> float:
    """One step of the moving averages the lean rule reads (weight 1 - LEAN_DECAY on the sample)."""
    return LEAN_DECAY * old + (1 - LEAN_DECAY) * sample


def _scaled(chain_info: list[tuple[list[int], list[float]]], scale: float) -> list[tuple[list[int], list[float]]]:
    """Each branch's (merge positions, path rates) with its rates multiplied by ``scale``."""
    return [(merge_pos, [p * scale for p in rates]) for merge_pos, rates in chain_info]


