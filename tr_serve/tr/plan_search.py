"""The budget's plan search: per row, how many template nodes and context-branch tokens to verify
for the most expected tokens per second, given their path rates and the step-latency model."""

from __future__ import annotations

from itertools import accumulate
from operator import itemgetter

from tr_serve.tr.step_latency import StepLatency

NOT_VERIFIED = 1 << 30  # merge position of a branch token that no template node holds
# A drafting plan must beat plain decoding by this much in expected tokens/s: the acceptance
# estimates and the latency model are noisy, and the best of many noisy estimates is biased up
# (most at high concurrency, where drafting gains little and every query token costs compute).
DRAFT_MARGIN = 0.03
# Prices (expected accepted tokens one more query token must bring) tried by the plan search.
_PRICES = (0.0, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.45, 0.7, 1.0, float("inf"))


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


def choose_fixed_plan(template_rates: list[float], chains: list[tuple[list[int], list[float]]],
                      nodes: int) -> list[tuple[int, int]]:
    """Per row, (template nodes n, branch cap L) that verify ``nodes`` drafted nodes (fewer only when
    the template and the branch have fewer) with the most expected accepted drafts, arguments as in
    :func:`choose_plan`: the ranking of the cost-aware budget at a fixed node count, whatever the
    step costs. Why: what better first nodes are worth is their MAT at 1, 2, 4, 8 or 16 verified
    nodes, which a cost-aware plan (a count of its own each step) does not show. A row without a
    branch takes the template's first ``nodes``, whatever their rates."""
    cum_t = _cumulative(template_rates)
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


