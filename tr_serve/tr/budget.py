"""Cost-aware tree budget: how many template nodes to verify this step so that expected generated
tokens per second is highest on this device, for this batch, decided per row.

Greedy or sampled, the tokens a step accepts form one chain of the tree, so the expected number of
accepted drafts of a template prefix is the sum of its nodes' path-acceptance rates ``p_i``. The
step emits that plus one bonus token per row and costs one forward over the rows' query tokens
(packed: a row pays for its own nodes only), whose latency comes from a table measured on the
device at start-up, corrected by what serving measures.
"""

from __future__ import annotations

import bisect
import time
from itertools import accumulate
from operator import itemgetter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from tr_serve.tr.matrix import EMPTY
from tr_serve.tr.tree import CompiledTree, order_by_rates, path_prior

if TYPE_CHECKING:
    from tr_serve.tr.draft import DraftBatch
    from tr_serve.tr.verifier import Acceptance


class AcceptanceStats:
    """Per-node acceptance estimates, kept as decayed counts of "this node's token was the model's
    choice, given that its parent's path was accepted" (a conditional rate ``q_i``); the path rate
    ``p_i`` of a node is the product of the ``q`` along its path.

    Why conditional: a node whose parent lies beyond this step's budget has no model token to be
    compared with. Counting it only when an ancestor already failed (the one case where its outcome
    is known) would record failures and never successes, so the estimates of nodes just past the
    budget would sink and the budget could never grow back. A conditional rate is observed exactly
    when its parent's path was verified and accepted, which is unbiased whatever the budget.
    """

    def __init__(self, tree: CompiledTree, decay: float = 0.995, prior_weight: float = 4.0):
        self.tree = tree
        self.decay = decay
        path = torch.tensor([1.0] + [path_prior(p) for p in tree.template], dtype=torch.float64)
        parents, order = tree.parents.cpu().numpy(), tree.level_order.cpu().numpy()
        prior = path[1:] / path[parents[1:]]  # conditional prior q_i = prior(path) / prior(parent path)
        self.hits = prior * prior_weight
        self.trials = torch.full_like(prior, prior_weight)
        # per node, its path from the root (node indices, 0 past its depth: a factor of 1.0)
        depths = tree.depths.numpy()
        self._path_nodes = np.zeros((tree.num_nodes, max(int(depths.max()), 1)), dtype=np.int64)
        for i in order.tolist():  # parents first: a node's path is its parent's, then itself
            if parents[i] > 0:
                self._path_nodes[i - 1] = self._path_nodes[parents[i] - 1]
            self._path_nodes[i - 1, depths[i] - 1] = i
        self._rates: list[float] | None = None

    @property
    def conditional_rates(self) -> torch.Tensor:
        """q_i for nodes 1..n (index 0 here = node 1); 0 where nothing has been observed."""
        return torch.from_numpy(self._conditional_rates())

    def _conditional_rates(self) -> np.ndarray:
        # numpy on views of the counts: read every step, and each torch call here cost several
        # microseconds more (most right after a forward, with the caches cold)
        trials = self.trials.numpy()
        return np.divide(self.hits.numpy(), trials, out=np.zeros_like(trials), where=trials > 0)

    @property
    def rates(self) -> torch.Tensor:
        """Estimated path rates p_i for nodes 1..n (index 0 here = node 1)."""
        return torch.tensor(self.rate_list(), dtype=torch.float64)

    def rate_list(self) -> list[float]:
        """:attr:`rates` as a list, computed once per update (the budget reads it every step)."""
        if self._rates is None:
            q = np.concatenate([[1.0], self._conditional_rates()])  # q[0] = 1: the root, and past a node's depth
            self._rates = q[self._path_nodes].prod(axis=1).tolist()  # root first along each path
        return self._rates

    def add_rows(self, rows: list[tuple[list[int], list[int]]]) -> None:
        """Decay the counts one step, then add that step's outcomes: per row, (nodes 1..N whose
        whole path was accepted, nodes compared with the model's choice), as :func:`node_outcomes`
        finds them."""
        hits, trials = self.hits.numpy(), self.trials.numpy()  # views: updated in place
        hits *= self.decay
        trials *= self.decay
        for accepted, observed in rows:
            for node in accepted:
                hits[node - 1] += 1.0
            for node in observed:
                trials[node - 1] += 1.0
        self._rates = None


def _host(a: torch.Tensor | np.ndarray) -> np.ndarray:
    return a.cpu().numpy() if isinstance(a, torch.Tensor) else a


class ContextStats:
    """Acceptance of context-branch tokens by match length, offset in the branch and whether the
    matrix agreed with the token (it is the first candidate of the token before it): decayed counts
    of "the j-th retrieved token was the model's choice, given the ones before it were"
    (conditional, observed only when its parent's path was accepted, as for the template).

    Why the agreement: two predictors that agree are right more often; priced together, a branch
    that agreed was cut as short as one that did not (docs/token-recycling.md, "Decisions")."""

    # match lengths 2, 3, 4-5, 6+; 1 is a chain from the recycled tables (TABLE_CHAIN_MATCH: the context index
    # matches 2 tokens or more, so a branch of match length 1 is always one of those)
    BUCKETS = (1, 2, 3, 4, 6)

    def __init__(self, max_tokens: int, decay: float = 0.995, prior: float = 0.5, prior_weight: float = 2.0):
        self.max_tokens = max_tokens
        self.decay = decay
        nb = len(self.BUCKETS)
        # [bucket, agreed (0: no, 1: yes), offset]
        self.hits = torch.full((nb, 2, max_tokens), prior * prior_weight, dtype=torch.float64)
        self.trials = torch.full((nb, 2, max_tokens), prior_weight, dtype=torch.float64)
        self._rates: list[list[list[float]]] | None = None  # conditional rates, [bucket][agreed][offset]

    def bucket(self, match_length: int) -> int:
        return max(0, bisect.bisect_right(self.BUCKETS, match_length) - 1)

    def path_rates(self, match_length: int, agreed: Sequence[bool]) -> list[float]:
        """p_j: probability that the first j+1 retrieved tokens are all accepted, for a branch whose
        j-th token the matrix agreed with where ``agreed[j]`` (one rate per entry, at most
        ``max_tokens``)."""
        if self._rates is None:
            self._rates = (self.hits.numpy() / np.maximum(self.trials.numpy(), 1e-12)).tolist()
        q = self._rates[self.bucket(match_length)]
        p, acc = [], 1.0
        for j, agree in enumerate(agreed[: self.max_tokens]):
            acc *= q[1 if agree else 0][j]
            p.append(acc)
        return p

    def update(self, outcomes: list[tuple[int, Sequence[bool], list[bool], list[bool]]]) -> None:
        """Per row (match length, agreed per offset, observed per offset, accepted per offset)."""
        hits, trials = self.hits.numpy(), self.trials.numpy()  # views: updated in place, a few entries a step
        hits *= self.decay
        trials *= self.decay
        for match_length, agreed, observed, accepted in outcomes:
            row = self.bucket(match_length)
            for j, (agree, seen, ok) in enumerate(zip(agreed, observed, accepted)):
                if not seen or j >= self.max_tokens:
                    break
                a = 1 if agree else 0
                trials[row, a, j] += 1.0
                hits[row, a, j] += float(ok)
        self._rates = None


class SuffixStats:
    """Acceptance of suffix-index branch tokens (tr/suffix_index.py), by the index's own evidence
    for each token: decayed counts of "this token was the model's choice, given the ones before it
    were" (conditional, observed as for :class:`ContextStats`), per *cell* of

    * the vote: of the ``support`` occurrences of the matched suffix that reached this depth,
      ``count`` went on with the token; ``count / (support + 1)`` (so one occurrence in one is
      0.5, nine in ten 0.82: a lone occurrence is weak evidence, however unanimous),
    * the match length (longer shared suffixes continue alike more often),
    * whether the matrix's first candidate agreed (as :class:`ContextStats`: two predictors that
      agree are right more often).

    Why not offsets, as the context branch's: the vote is measured at each depth, and the depth
    is what the offset stood for there (a continuation that many occurrences share stays shared).
    Each cell starts at its vote's midpoint."""

    VOTE_EDGES = (0.3, 0.5, 0.65, 0.8)  # vote buckets [0, .3), [.3, .5), [.5, .65), [.65, .8), [.8, 1]
    VOTE_PRIORS = (0.15, 0.4, 0.57, 0.72, 0.88)
    MATCH_EDGES = (5, 8, 12)  # match buckets 3-4, 5-7, 8-11, 12+ tokens

    def __init__(self, decay: float = 0.995, prior_weight: float = 2.0):
        self.decay = decay
        nv, nm = len(self.VOTE_EDGES) + 1, len(self.MATCH_EDGES) + 1
        prior = np.repeat(np.asarray(self.VOTE_PRIORS, dtype=np.float64), nm * 2)  # cell = (vote, match, agreed)
        self.hits = prior * prior_weight
        self.trials = np.full(nv * nm * 2, prior_weight, dtype=np.float64)
        self._rates: list[float] | None = None

    @classmethod
    def cell(cls, match: int, count: int, support: int, agreed: bool) -> int:
        """The cell of a token ``count`` of ``support`` occurrences went on with, after a suffix
        match of ``match`` tokens; ``agreed``: the matrix's first candidate is that token."""
        vote = bisect.bisect_right(cls.VOTE_EDGES, count / (support + 1))
        length = bisect.bisect_right(cls.MATCH_EDGES, match)
        return (vote * (len(cls.MATCH_EDGES) + 1) + length) * 2 + (1 if agreed else 0)

    def rates(self) -> list[float]:
        """Conditional acceptance per cell."""
        if self._rates is None:
            self._rates = (self.hits / np.maximum(self.trials, 1e-12)).tolist()
        return self._rates

    def path_rates(self, cells: Sequence[int]) -> list[float]:
        """p_j: probability that the first j+1 branch tokens (of these cells) are all accepted."""
        q = self.rates()
        p, acc = [], 1.0
        for c in cells:
            acc *= q[c]
            p.append(acc)
        return p

    def update(self, outcomes: list[tuple[Sequence[int], list[bool], list[bool]]]) -> None:
        """Per row with a suffix branch: (cells, observed per offset, accepted per offset)."""
        hits, trials = self.hits, self.trials
        hits *= self.decay
        trials *= self.decay
        for cells, observed, accepted in outcomes:
            for c, seen, ok in zip(cells, observed, accepted):
                if not seen:
                    break
                trials[c] += 1.0
                hits[c] += float(ok)
        self._rates = None


@dataclass(frozen=True)
class LatencyTable:
    """Forward latency (seconds) by total query tokens in the step, linearly interpolated, measured
    on one row; ``row_offsets``: (rows, tokens per row, seconds over the table) of steps measured
    on several rows at start-up (runner/calibration.py), which :class:`StepLatency` starts from."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]
    row_offsets: tuple[tuple[int, int, float], ...] = ()

    def __call__(self, q: int) -> float:
        i = bisect.bisect_left(self.tokens, q)
        if i < len(self.tokens) and self.tokens[i] == q:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.tokens):  # extrapolate with the last slope
            i = len(self.tokens) - 1
        t0, t1 = self.tokens[i - 1], self.tokens[i]
        s0, s1 = self.seconds[i - 1], self.seconds[i]
        return s0 + (s1 - s0) * (q - t0) / (t1 - t0)


class StepLatency:
    """Step latency by (rows, query tokens in the step, widest row).

    The start-up table is measured on one row. A batch of rows costs more than its token count
    says: the runner packs the rows' real tokens for the linear layers and the LM head (their cost
    follows the token count, as in the table), but every row attends over its own cache and runs
    its own small operations, a cost per row that does not grow with its drafted tokens; and a row
    wider than the native tree attention takes (16 tokens; 64 on several rows or in the layers' C
    loop) sends the whole step through a padded path. So while serving the engine observes each step and keeps, per (row count, power-of-two
    bucket of the widest row), the moving average of measured minus table: an additive offset.

    Why additive: measured at 13 rows over 300-token contexts (SmolLM2-135M, 2 threads), the steps
    cost the table plus 5-8 ms whether they verified 13 or 44 tokens. A ratio learned on plain steps
    (1.3-1.4 there) multiplied the table's cost of every extra token too, so the budget saw drafts
    at high row counts as 1.5-2x dearer than they were and verified almost none. An unseen width
    takes the nearest seen one of the same rows, an unseen row count the table alone. A step that
    took over ``spike`` times its prediction (a busy moment of the machine) counts as ``spike``
    times it, so one outlier cannot price a shape out of the plans for long.

    The offsets start from the table's ``row_offsets`` (row counts measured at start-up, e.g. 8 and
    32: on a GPU a step of 32 rows costs mostly its rows' attention, which a one-row table cannot
    show); a row count neither measured nor observed takes the offset interpolated between the
    measured ones (one row: none), proportional to rows past the last."""

    def __init__(self, table: LatencyTable, alpha: float = 0.2, spike: float = 1.5):
        self.table = table
        self.alpha = alpha
        self.spike = spike
        self.offsets: dict[tuple[int, int], float] = {}  # (rows, width bucket) -> seconds over the table
        for rows, width, offset in table.row_offsets:
            self.offsets[(rows, self.bucket(width))] = offset
        self.measured_rows = sorted({rows for rows, _, _ in table.row_offsets})

    @staticmethod
    def bucket(tokens: int) -> int:
        """1, 2, 3-4, 5-8, 9-16, 17-32, ...: a width of 16 and one of 17 fall apart, as the
        runner's paths do (``tree_attention.MAX_WIDTH``)."""
        return (max(1, tokens) - 1).bit_length()

    def observe(self, rows: int, tokens: int, seconds: float, width: int | None = None) -> None:
        key = (rows, self.bucket(width or 1))
        base = self.table(tokens)
        old = self.offsets.get(key)
        if old is not None:
            seconds = min(seconds, self.spike * (base + old))
        offset = seconds - base
        self.offsets[key] = offset if old is None else old + self.alpha * (offset - old)

    def __call__(self, rows: int, tokens: int, width: int | None = None) -> float:
        wb = self.bucket(width or 1)
        offset = self._offset(rows, wb)
        if offset is None:
            offset = self._interpolated(rows, wb)
        return max(self.table(tokens) + offset, 1e-6)

    def _offset(self, rows: int, wb: int) -> float | None:
        offset = self.offsets.get((rows, wb))
        if offset is None:
            widths = [w for r, w in self.offsets if r == rows]
            if widths:
                offset = self.offsets[(rows, _nearest(widths, wb))]
        return offset

    def _interpolated(self, rows: int, wb: int) -> float:
        """The offset of an unseen row count from the row counts measured at start-up."""
        if not self.measured_rows or rows <= 1:
            return 0.0
        lower = max([1] + [r for r in self.measured_rows if r < rows])
        higher = [r for r in self.measured_rows if r > rows]
        low = 0.0 if lower == 1 else self._offset(lower, wb)
        if not higher:
            return low * rows / lower
        high = self._offset(higher[0], wb)
        return low + (high - low) * (rows - lower) / (higher[0] - lower)


def _nearest(keys, k: int) -> int:
    """The key closest to ``k`` (the lower one on a tie)."""
    return min(keys, key=lambda j: (abs(j - k), j))


def _cumulative(values) -> list[float]:
    """[0, v0, v0 + v1, ...]: the prefix sums, summed in order (as a loop would)."""
    return list(accumulate(values, initial=0.0))


def _frontier(options: list[tuple[float, int, int, int]]) -> list[tuple[float, int, int, int]]:
    """The options (gain, cost, n, cap) that can win at some price per query token, by cost: the
    upper concave hull of the strictly rising gains (an option that costs more and gains no more
    never wins; nor does one below the chord of its neighbours, which one of them always beats)."""
    hull: list[tuple[float, int, int, int]] = []
    for option in sorted(options, key=itemgetter(1)):  # stable: the first of equal options stays
        gain, cost = option[0], option[1]
        if hull and gain <= hull[-1][0] + 1e-12:
            continue
        if hull and cost == hull[-1][1]:
            hull.pop()  # the same cost for more gain
        while len(hull) >= 2:
            (g0, c0, _, _), (g1, c1, _, _) = hull[-2], hull[-1]
            if (g1 - g0) * (cost - c0) <= (gain - g0) * (c1 - c0):  # hull[-1] on or below the chord
                hull.pop()
            else:
                break
        hull.append(option)
    return hull


def _price_picks(frontier: list[tuple[float, int, int, int]]) -> list[tuple[float, int, int, int]]:
    """For each of :data:`_PRICES`, the option of ``frontier`` (:func:`_frontier`) with the most
    ``gain - price * cost``, the cheaper one on a tie: along the hull the move to the next option
    is worth it while its gain per extra token exceeds the price, so the pick only moves to
    cheaper options as the price rises (one pass, instead of every option at every price)."""
    slopes = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(frontier, frontier[1:])]  # falling
    out, k = [], len(frontier) - 1
    for price in _PRICES:  # rising
        while k > 0 and not slopes[k - 1] > price:
            k -= 1
        out.append(frontier[k])
    return out


def plan_gains(template_rates: list[float], chains: list[tuple[list[int], list[float]]],
               plan: list[tuple[int, int]], branchless_rates: list[float] | None = None) -> tuple[float, float]:
    """Expected accepted drafts of ``plan`` (per row (template nodes n, branch cap L), as
    :func:`choose_plan` returns it) under the same rates, as (template nodes, branch tokens): the
    path rates of the first ``n`` template nodes that no branch token merges into
    (``branchless_rates`` for a row without a branch, as in :func:`choose_plan`), and the rates of
    the branch tokens verified: those that merge into the first ``n`` nodes, then at most L more.

    Why a merged node counts as a branch token: the context agrees with the matrix there, and such
    a node is right far more often than the template's rate for its position says. Measured at 8
    rows on the 26 dev questions (an engine warmed at 4 rows first): the template nodes a branch
    token merged into were right 98 of 156 times, the others 31 of 245. Counted as template nodes,
    they were priced at the template's rates, and their successes raised the template's
    calibration, which scales every template node's rate."""
    cum_t = _cumulative(template_rates)
    cum_b = cum_t if branchless_rates is None else _cumulative(branchless_rates)
    template, branch = 0.0, 0.0
    for (n, cap), (merge_pos, rates) in zip(plan, chains):
        if not rates:
            template += cum_b[n]
            continue
        merged = sum(1 for pos in merge_pos if pos < n)  # positions rise along the branch
        template += cum_t[n] - sum(template_rates[pos] for pos in merge_pos[:merged])
        branch += sum(rates[: merged + cap])
    return template, branch


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


# A drafting plan must beat plain decoding by this much in expected tokens/s: the acceptance
# estimates and the latency model are noisy, and the best of many noisy estimates is biased up
# (most at high concurrency, where drafting gains little and every query token costs compute).
DRAFT_MARGIN = 0.03
# Prices (expected accepted tokens one more query token must bring) tried by the plan search.
_PRICES = (0.0, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.45, 0.7, 1.0, float("inf"))


def choose_plan(template_rates: list[float], chains: list[tuple[list[int], list[float]]], latency: StepLatency,
                node_candidates: tuple[int, ...], chain_caps: tuple[int, ...],
                explore: bool = False, branchless_rates: list[float] | None = None) -> list[tuple[int, int]]:
    """Per row, (template nodes n, context-branch cap L), for the most expected tokens per second.

    template_rates: path rates of the template nodes in the order they are added (a row verifies
    the first n); branchless_rates: the same for rows without a branch, when they are estimated
    apart (default: template_rates). chains[r]: (for each retrieved token of row r, the position
    in that order of the template node it merges into, or a large number; the token's path rate);
    empty lists for a row without a branch. The first tokens that merge into the row's verified template nodes cost
    nothing and are priced at their branch rates (in place of those nodes' template rates:
    :func:`plan_gains`); the rest, at most L of them, are extra nodes of that row.

    The step costs one forward over the sum of the rows' tokens (the runner packs rows for the
    linear layers and attends per segment of one width); the latency model learns what the widest
    row adds per row count. Each row's options reduce to a frontier of
    (expected accepted tokens, nodes); a price per query token picks one option per row, and the
    price whose plan has the best expected tokens per second wins. With ``explore``, the runner-up
    plan instead, so the latency of other shapes keeps being measured."""
    rows = len(chains)
    if rows == 0:
        return []
    cum_t = _cumulative(template_rates)
    cum_b = cum_t if branchless_rates is None else _cumulative(branchless_rates)
    plain_frontier = _frontier([(cum_b[n], n, n, 0) for n in node_candidates])
    frontiers: list[list[tuple[float, int, int, int]]] = []
    candidates, caps = sorted(node_candidates), sorted(chain_caps)
    seen: dict[tuple, list[tuple[float, int, int, int]]] = {}  # rows with the same branch shape share a frontier
    for merge_pos, rates in chains:
        if not rates:
            frontiers.append(plain_frontier)
            continue
        key = (tuple(merge_pos), tuple(rates))
        if key in seen:
            frontiers.append(seen[key])
            continue
        cum = _cumulative(rates)
        # the template rates of the order positions the branch's first tokens merge into, summed
        merged_t = _cumulative(template_rates[pos] for pos in merge_pos if pos < len(template_rates))
        options = []
        m, merged = 0, len(merge_pos)
        for n in candidates:  # ascending: the merged prefix of the branch only grows
            while m < merged and merge_pos[m] < n:
                m += 1
            longest = len(rates) - m
            base = cum_t[n] - merged_t[m]  # the nodes the branch does not merge into; its own tokens below
            for cap in caps:
                extra = cap if cap < longest else longest
                options.append((base + cum[m + extra], n + extra, n, cap))
                if cap >= longest:
                    break  # larger caps are the same plan
        seen[key] = _frontier(options)
        frontiers.append(seen[key])
    plain = None  # every row a one-token step, when every row has that option
    if all(f[0][1] == 0 for f in frontiers):
        plain = tuple((f[0][2], f[0][3]) for f in frontiers)
    # rows that share a frontier (every row without a branch, rows with the same branch shape) pick
    # alike: one pick per frontier
    groups: dict[int, tuple[list[tuple[float, int, int, int]], list[int]]] = {}
    for r, frontier in enumerate(frontiers):
        groups.setdefault(id(frontier), (frontier, []))[1].append(r)
    members = [rs for _, rs in groups.values()]
    counts = [len(rs) for rs in members]
    # a plan is one option per group; a price picks one plan, often the same as its neighbour's
    plans = list(zip(*[_price_picks(frontier) for frontier, _ in groups.values()]))  # plans[p]: at _PRICES[p]
    scored: dict[tuple, tuple[float, int]] = {}  # plan -> (expected tokens/s, its nodes and caps)
    for key in plans:
        if key in scored:
            continue
        gain, cost, widest, size = 0.0, 0, 0, 0
        for (g, c, n, cap), count in zip(key, counts):
            gain += g * count
            cost += c * count
            size += (n + cap) * count
            if c > widest:
                widest = c
        scored[key] = ((rows + gain) / latency(rows, rows + cost, 1 + widest), size)
    def rank(kv):  # the most expected tokens/s, then the fewest nodes and caps
        return kv[1][0], -kv[1][1]

    if explore and len(scored) > 1:
        pick = sorted(scored.items(), key=rank, reverse=True)[1]  # the runner-up
    else:  # the best; the first of equals, as the stable sort would rank it
        pick = max(scored.items(), key=rank)
    if not explore and plain is not None:
        plain_score = scored[plans[-1]][0]  # the infinite price's plan
        if pick[1][0] < plain_score * (1 + DRAFT_MARGIN):
            return list(plain)  # within the estimates' error of plain decoding: not worth the risk
    plan: list[tuple[int, int]] = [(0, 0)] * rows
    for option, rs in zip(pick[0], members):
        for r in rs:
            plan[r] = (option[2], option[3])
    return plan


def choose_fixed_plan(template_rates: list[float], chains: list[tuple[list[int], list[float]]], nodes: int,
                      branchless_rates: list[float] | None = None) -> list[tuple[int, int]]:
    """Per row, (template nodes n, branch cap L) that verify ``nodes`` drafted nodes (fewer only when
    the template and the branch have fewer) with the most expected accepted drafts, arguments as in
    :func:`choose_plan`: the ranking of the cost-aware budget at a fixed node count, whatever the
    step costs. Why: what better first nodes are worth is their MAT at 1, 2, 4, 8 or 16 verified
    nodes, which a cost-aware plan (a count of its own each step) does not show."""
    cum_t = _cumulative(template_rates)
    cum_b = cum_t if branchless_rates is None else _cumulative(branchless_rates)
    most = min(nodes, len(template_rates))
    plans = []
    for merge_pos, rates in chains:
        if not rates:
            plans.append((most, 0))
            continue
        cum = _cumulative(rates)
        best, pick, m = -1.0, (0, 0), 0
        for n in range(most + 1):
            while m < len(merge_pos) and merge_pos[m] < n:
                m += 1
            extra = min(nodes - n, len(rates) - m)
            merged = sum(template_rates[pos] for pos in merge_pos[:m])
            gain = cum_t[n] - merged + cum[m + extra]
            if gain > best + 1e-12:
                best, pick = gain, (n, extra)
        plans.append(pick)
    return plans


_NOT_VERIFIED = 1 << 30  # merge position of a branch token that no template node holds
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
        chain_info = [([_NOT_VERIFIED] * len(chain), self.branch_rates(chain, matches[r], agreements[r], cells[r]))
                      for r, chain in enumerate(chains)]
        explore = self.steps % self.explore_every == 0
        plans = choose_plan([], _scaled(chain_info, self.branch_calibration.scale), self.latency, (0,),
                            self.chain_caps, explore)
        self._expected = plan_gains([], chain_info, plans)
        return plans

    def plan(self, roots: list[int], successors: Callable[[int, int], Sequence[int]], chains: list[list[int]],
             matches: list[int], before: list[int] | None = None,
             agreements: list[Sequence[bool]] | None = None,
             cells: list[Sequence[int] | None] | None = None) -> list[tuple[int, int]]:
        """Per row, (template nodes, branch cap) for the most expected tokens per second.
        roots[r]: row r's last accepted token; successors(before, token): the candidates drafted
        after a token whose previous token is ``before`` (the template node of rank k under a node
        drafting ``t``, whose parent drafts ``s``, drafts ``successors(s, t)[k]``); chains[r]: row
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
                after = successors(prev, drafted)
                nxt = next((c for c in children[node] if after[ranks[c]] == tok), None)
                if nxt is None:
                    break
                merge_pos.append(position[nxt])
                node, prev, drafted = nxt, drafted, tok
            merge_pos += [_NOT_VERIFIED] * (len(chain) - len(merge_pos))
            chain_info.append((merge_pos, self.branch_rates(chain, matches[r], agreements[r], cells[r])))
        scaled = _scaled(chain_info, self.branch_calibration.scale)
        if self.fixed_nodes is not None:
            plans = choose_fixed_plan(order_rates, chain_info, self.fixed_nodes, branchless_rates)
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
        rows, width = batch.tokens.shape
        if seconds is not None:
            self.latency.observe(rows, batch.num_inputs, seconds, width)
        step = seconds if seconds is not None else self.latency(rows, batch.num_inputs, width)
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


def branch_outcomes(batch: "DraftBatch", acceptance: "Acceptance"
                    ) -> list[tuple[int, tuple[bool, ...], list[bool], list[bool]]]:
    """Per row with a context branch, (match length, and per offset in the branch: whether the
    matrix agreed, observed, accepted):
    the tokens it verified, then the first one it did not (``batch.chain_next``), which is observed
    too when every verified one was accepted, against the model's token after the last of them.

    Why the one past the cap: the budget drafts a branch token only when its estimate pays, so an
    estimate learned from verified tokens alone cannot recover once it is low. Measured at 8
    concurrent rows on the dev questions: offsets 2-4 of 2-token matches were estimated at 0.03-0.12
    (path rates) while 0.15-0.30 of them were right, and the budget had stopped drafting them."""
    suffix = batch.branch_cells or ((),) * len(batch.match_lengths)
    # a match always retrieves a token; suffix-index branches are SuffixStats' (suffix_outcomes)
    rows = [r for r, m in enumerate(batch.match_lengths) if m > 0 and not suffix[r]]
    return [(batch.match_lengths[r], batch.chain_agreement[r], seen, right)
            for r, (seen, right) in zip(rows, _branch_observations(batch, acceptance, rows))]


def suffix_outcomes(batch: "DraftBatch", acceptance: "Acceptance") -> list[tuple[tuple[int, ...], list[bool], list[bool]]]:
    """Per row with a suffix-index branch, (its tokens' SuffixStats cells, observed per offset,
    accepted per offset), observed as :func:`branch_outcomes` observes the context branches."""
    rows = [r for r, cells in enumerate(batch.branch_cells) if cells]
    return [(batch.branch_cells[r], seen, right)
            for r, (seen, right) in zip(rows, _branch_observations(batch, acceptance, rows))]


def _branch_observations(batch: "DraftBatch", acceptance: "Acceptance", rows: list[int]
                         ) -> list[tuple[list[bool], list[bool]]]:
    """Per row of ``rows``, (observed, accepted) per offset of its branch: the tokens it verified,
    then ``batch.chain_next`` when every verified one was accepted."""
    if not rows:
        return []
    nexts = batch.chain_next
    ok = acceptance.accepted_mask.tolist()
    choices = acceptance.choices.tolist()
    parents = batch.parents.tolist()
    out = []
    for r in rows:
        cols = batch.chain_columns[r]
        seen = [ok[r][parents[r][c]] for c in cols]
        right = [ok[r][c] for c in cols]
        if nexts[r] != EMPTY:
            last = cols[-1] if cols else 0  # the root is always accepted
            seen.append(ok[r][last])
            right.append(ok[r][last] and choices[r][last] == nexts[r])
        out.append((seen, right))
    return out


def node_outcomes(tree: CompiledTree, batch: "DraftBatch", acceptance: "Acceptance"
                  ) -> list[tuple[list[int], list[int]]]:
    """Per row, (template nodes whose whole path was accepted, template nodes observed), for the
    full template ``tree`` drafted in ``batch.template_draft``, found by walking down from the root
    through the accepted nodes the row verified, whose children are the only nodes observed.

    Why a walk: a row observes the children of its accepted path only, a dozen nodes of the 80; the
    tables of the whole template cost ~0.25 ms a step at one row (measured in the engine), the walk
    a small part of that."""
    template_nodes = batch.template_nodes.tolist()
    verified_rank = {node: j for j, node in enumerate(template_nodes, start=1)}  # node -> batch column
    verified_rank[0] = 0
    draft = _host(batch.template_draft).tolist()
    choices = acceptance.choices.tolist()
    children = tree.children
    out = []
    for r, limit in enumerate(batch.row_nodes):
        row_draft, row_choice = draft[r], choices[r]
        accepted, observed, frontier = [], [], [0]
        while frontier:  # accepted nodes the row verified: the model's token after each is known
            deeper = []
            for node in frontier:
                choice = row_choice[verified_rank[node]]
                for child in children[node]:
                    observed.append(child)
                    if row_draft[child] == choice:
                        accepted.append(child)
                        column = verified_rank.get(child)
                        if column is not None and column <= limit:
                            deeper.append(child)
            frontier = deeper
        out.append((accepted, observed))
    return out


def observe_template(stats: AcceptanceStats, batch: "DraftBatch", acceptance: "Acceptance") -> None:
    """Update per-node acceptance estimates from one step (:func:`node_outcomes`)."""
    stats.add_rows(node_outcomes(stats.tree, batch, acceptance))
