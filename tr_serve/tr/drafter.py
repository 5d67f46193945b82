"""Each step's draft: matrix nodes from a template, a context branch per row, under a budget.

* fixed budget: every row verifies the whole template, plus its context branch (``+ctx``)
* ``auto``: per row, how many of the nodes with the best estimated path-acceptance rates to verify
  (an acceptance-driven shape, re-ranked as the estimates move) and a cap on its context branch,
  chosen together to maximise expected tokens per second under the measured step latency
  (tr/budget.py); a row with nothing promising runs a plain one-token step beside rows that
  verify trees. While recent plans bought no template node, or the template brought less than
  the host time it costs (many concurrent rows on a CPU), steps are lean: the context branches
  alone, no template drafted (``TreeBudget.lean_next``)
* ``pld``: the context branch alone (prompt lookup decoding through the same runner)

With a pair table (tr/pair_table.py; the fixed hybrids by default) the template is drafted from
rows keyed by (token before, token) where the table holds them. Under ``auto`` each row's branch is
the best valued (:data:`BRANCH_PRICE`) of three, each priced by its own measured acceptance, on
full plans and lean steps alike: the row's context match; a chain from the recycled tables (the
pair table's, or without one the matrix's confident chain, ``AdjacencyMatrix.confident_chains``:
first candidates through rows the model has rewritten alike); and the cross-request suffix index's
continuation (tr/suffix_index.py: what followed the row's longest suffix in other requests' text).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch

from tr_serve.tr.acceptance_stats import AcceptanceStats, SuffixStats, observe_template
from tr_serve.tr.budget import TreeBudget
from tr_serve.tr.context_index import ContextIndex
from tr_serve.tr.draft import DraftBatch, DraftPart, build_draft, merge_parts
from tr_serve.tr.matrix import EMPTY, AdjacencyMatrix
from tr_serve.tr.pair_table import PairTable
from tr_serve.tr.proposer import propose
from tr_serve.tr.step_latency import LatencyTable, StepLatency
from tr_serve.tr.suffix_index import SuffixDraft, SuffixIndex
from tr_serve.tr.tenant_rows import RowScopes, TenantRows
from tr_serve.tr.tree import CompiledTree, compile_tree
from tr_serve.tr.tree_spec import TreeSpec
from tr_serve.tr.verifier import Acceptance


@dataclass(frozen=True)
class ContextSettings:
    """How a row's context branch is retrieved: n-gram match lengths and the longest branch."""

    min_ngram: int
    max_ngram: int
    max_tokens: int


# Hybrid: a 1-token match is what the matrix already predicts, so the branch needs 2+; long
# matches earn long branches (the cost-aware budget cuts them by measured acceptance; the
# alternatives measured: docs/token-recycling.md, "Decisions").
HYBRID_CONTEXT = ContextSettings(min_ngram=2, max_ngram=8, max_tokens=16)
# Prompt lookup as vLLM's n-gram proposer is set up in its CPU examples: n-grams of 2-4, 4 drafts.
PLD_CONTEXT = ContextSettings(min_ngram=2, max_ngram=4, max_tokens=4)

# the "match length" of a branch drafted from the recycled tables, not found in the context: the
# pair table's chain, or without a pair table the matrix's confident chain (its own ContextStats
# bucket: the context index matches 2 tokens or more)
TABLE_CHAIN_MATCH = 1
# a confident chain leaves a token only if the model wrote that token's first candidate again, unchanged,
# at least this many times in a row (AdjacencyMatrix.streak). 1, not 2: where a query token costs a third
# of a row's expected tokens (8 concurrent rows on a CPU) the 0.55 chance of streak 1 pays, and the budget
# cuts the chain by its measured acceptance where it does not (docs/token-recycling.md, "Decisions")
CONFIDENT_STREAK = 1
# A row's branch is the context's (or the recycled tables' chain) or the suffix index's, whichever
# is worth more: the most of sum(p_j - BRANCH_PRICE) over the branch's prefixes, p_j its path rates.
# The price stands for a query token's cost in accepted tokens (on one row of this CPU a token
# adds about 4% to a step that emits about 2 tokens); the budget then sizes the chosen branch.
BRANCH_PRICE = 0.1
NODE_CANDIDATES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80)
CHAIN_CAPS = (0, 1, 2, 4, 8, 16)
EXPLORE_EVERY = 16  # every 16th step verifies the runner-up plan, to keep its latency measured
REORDER_EVERY = 64  # steps between re-rankings of the template nodes by estimated acceptance
_PLAIN = compile_tree([], name="none")


def _branch_value(rates: list[float]) -> float:
    """The most of ``sum(p_j - BRANCH_PRICE)`` over the prefixes of a branch of path rates ``rates``."""
    best = total = 0.0
    for p in rates:
        total += p - BRANCH_PRICE
        best = max(best, total)
    return best


class Drafter:
    """Builds each step's draft batch: the template drafted from the matrix, each row's context
    branch, and, under ``auto``, the per-row plan of the :class:`TreeBudget`."""

    def __init__(self, spec: TreeSpec, template: CompiledTree | None, matrix: AdjacencyMatrix,
                 latency: StepLatency | None = None, pairs: PairTable | None = None,
                 suffix: SuffixIndex | None = None):
        if spec.auto_budget and (template is None or latency is None):
            raise ValueError("the cost-aware budget needs a template and a latency table")
        if suffix is not None and not spec.prices_branches:
            raise ValueError("the suffix index drafts a branch the cost-aware budget prices: it needs 'auto'")
        self.spec = spec
        self.template = template
        self.matrix = matrix
        self.pairs = pairs  # second-order rows keyed by (token before, token), or None (tr/pair_table.py)
        self.suffix = suffix  # the replica's cross-request suffix index, or None (tr/suffix_index.py)
        self.context = (PLD_CONTEXT if template is None else HYBRID_CONTEXT) if spec.context else None
        self.budget: TreeBudget | None = None  # the shared tenant's (budget_of: a named tenant's)
        self._tenant_budgets: dict[str, TreeBudget] = {}
        if spec.auto_budget:
            self.budget = self._new_budget(latency)
        # per-node acceptance estimates fed by observe(): the budget's; a caller may set one to
        # measure a fixed tree (scripts/measure_tree_order.py)
        self.acceptance: AcceptanceStats | None = self.budget.acceptance if self.budget else None
        # (tenant, nodes, its budget's order version) -> the subtree and its template nodes
        self._subtrees: dict[tuple[str | None, int, int], tuple[CompiledTree, torch.Tensor]] = {}

    @property
    def order(self) -> list[int]:
        """Template nodes in the order a row adds them (a row verifies a prefix)."""
        if self.budget is not None:
            return self.budget.order
        return list(range(1, self.template.num_nodes + 1)) if self.template is not None else []

    @staticmethod
    def context_tokens(spec: TreeSpec) -> int:
        """The longest context branch a row can add to its tree under ``spec``."""
        if not spec.context:
            return 0
        return (HYBRID_CONTEXT if spec.uses_matrix else PLD_CONTEXT).max_tokens

    @staticmethod
    def plain(roots: torch.Tensor) -> DraftBatch:
        """Plain decoding: the root alone."""
        return build_draft(roots[:, None], _PLAIN, torch.zeros(0, dtype=torch.long))

    def new_context_index(self) -> ContextIndex | None:
        if self.context is None:
            return None
        return ContextIndex(self.context.max_ngram, self.context.min_ngram)

    # ---- drafting ------------------------------------------------------------------------------
    def budget_of(self, tenant: str | None) -> TreeBudget:
        """The cost-aware budget that plans ``tenant``'s rows (None: the shared tenant's,
        :attr:`budget`), made from the priors at a named tenant's first step. Why one per tenant:
        its estimates, calibration and template order are learned from the acceptance of the rows
        it plans, so one budget for all would let one tenant's text size another's trees
        (docs/serving.md, "Tenants and privacy"). They share the step latency: the hardware's."""
        if tenant is None:
            return self.budget
        budget = self._tenant_budgets.get(tenant)
        if budget is None:
            budget = self._tenant_budgets[tenant] = self._new_budget(self.budget.latency)
            budget.fixed_nodes = self.budget.fixed_nodes
        return budget

    def _new_budget(self, latency: StepLatency) -> TreeBudget:
        return TreeBudget(self.template, latency, self.context.max_tokens if self.context else 0,
                          NODE_CANDIDATES, CHAIN_CAPS, EXPLORE_EVERY, REORDER_EVERY)

    def adopt_latency_table(self, table: LatencyTable) -> None:
        """Price every budget's steps by ``table`` from now on (the latency they share)."""
        self.budget.adopt_latency_table(table)
        for budget in self._tenant_budgets.values():
            budget.forget_plans()

    def draft(self, roots: torch.Tensor, contexts: list[ContextIndex] | None = None,
              room: list[int] | None = None, before: torch.Tensor | None = None,
              documents: list[int | None] | None = None, plain_rows: list[bool] | None = None,
              scopes: RowScopes | None = None, tenants: Sequence[str | None] | None = None) -> DraftBatch:
        """roots [b]: each row's last accepted token (the last token of its context, if any).
        room[r]: how many tokens row r may still emit (a branch never drafts past it).
        before [b]: the token before each root (-1: none), for the pair table's rows.
        documents[r]: row r's document in the suffix index (its text so far), None: none.
        plain_rows[r]: True verifies the root alone for row r (the request turned speculation off).
        scopes: the rows that draft through a tenant's overlay over the matrix (tr/tenant_rows.py).
        tenants[r]: row r's named tenant (None, or no list: the shared tenant); under ``auto`` each
        tenant's rows are planned by its own budget (:meth:`budget_of`) and drafted apart, then
        merged into one batch (tr/draft.py merge_parts)."""
        if self.budget is None or tenants is None or not any(t is not None for t in tenants):
            return self._draft(None, roots, contexts, room, before, documents, plain_rows, scopes)
        groups: dict[str | None, list[int]] = {}
        for r, t in enumerate(tenants):
            groups.setdefault(t, []).append(r)
        if len(groups) == 1:  # one named tenant: its budget, every row
            (tenant, rows), = groups.items()
            batch = self._draft(tenant, roots, contexts, room, before, documents, plain_rows, scopes)
            return replace(batch, parts=(DraftPart(tenant, tuple(rows), batch),))
        parts = []
        for tenant, rows in groups.items():
            index = torch.tensor(rows, dtype=torch.long)
            batch = self._draft(tenant, roots[index], _pick(contexts, rows), _pick(room, rows),
                                before[index] if before is not None else None, _pick(documents, rows),
                                _pick(plain_rows, rows), scopes.subset(rows) if scopes is not None else None)
            parts.append(DraftPart(tenant, tuple(rows), batch))
        return merge_parts(parts, roots.shape[0])

    def _draft(self, tenant: str | None, roots: torch.Tensor, contexts: list[ContextIndex] | None,
               room: list[int] | None, before: torch.Tensor | None, documents: list[int | None] | None,
               plain_rows: list[bool] | None, scopes: RowScopes | None) -> DraftBatch:
        """:meth:`draft` for rows of one tenant (None: the shared one), planned by its budget (none:
        a fixed tree)."""
        budget = self.budget_of(tenant) if self.budget is not None else None
        pairs = self.pairs if before is not None else None
        b = roots.shape[0]
        chains: list[list[int]] = [[] for _ in range(b)]
        matches = [0] * b
        caps = ([self.context.max_tokens if room is None else min(self.context.max_tokens, room[r] - 1)
                 for r in range(b)] if self.context is not None else [])  # the longest branch each row may draft
        if self.context is not None and contexts is not None:
            for r, ctx in enumerate(contexts):
                matches[r], chains[r] = ctx.lookup(caps[r])
        lean = budget is not None and budget.lean_next  # the template did not pay lately
        n = self.template.num_nodes if self.template is not None else 0
        cap = self.context.max_tokens if self.context is not None else 0
        agreements, cells = None, None
        if budget is not None and self.context is not None:
            # each row's branch: its context's, the recycled tables' chain or the suffix index's,
            # whichever the budget's estimates value most (_choose_branches). The chain from the
            # tables holds the template's first candidates, but priced by the row's own evidence
            # (the model rewrote them alike, CONFIDENT_STREAK; or the pair table's rows) where the
            # template prices them by their position's average over every row
            if pairs is not None:
                table = pairs.chains(before, roots, caps)
            else:
                table = self.matrix.confident_chains(roots.tolist(), caps, CONFIDENT_STREAK,
                                                     scopes.overlay_of_row if scopes is not None else None)
            found = [None] * b
            if self.suffix is not None and documents is not None:
                found = [self.suffix.lookup(doc, caps[r]) if doc is not None else None
                         for r, doc in enumerate(documents)]
            agreements, cells = self._choose_branches(budget, roots.tolist(), chains, matches, table, found, scopes)
        if lean:
            t0 = time.perf_counter()
            plans = budget.plan_branches(chains, matches, agreements, cells)
            full = roots[:, None]  # no template drafted: the root alone
            budget.observe_host(False, time.perf_counter() - t0)
        elif budget is not None:  # the plan first: the template is then drafted only as deep as it is used
            t0 = time.perf_counter()
            root_list = roots.tolist()
            before_list = before.tolist() if pairs is not None else [EMPTY] * b
            successors = self._successors([(r, [before_list[r], root_list[r], *c[:-1]]) for r, c in enumerate(chains) if c],
                                          scopes)
            plans = budget.plan(root_list, successors, chains, matches, before_list, agreements, cells)
            full = propose(self.matrix, roots, self.template, budget.draft_depth(max(p[0] for p in plans)),
                           pairs, before, scopes)
            budget.observe_host(True, time.perf_counter() - t0)
        else:
            plans = [(n, cap)] * b
            full = (propose(self.matrix, roots, self.template, pairs=pairs, before=before, scopes=scopes)
                    if self.template is not None else roots[:, None])
        if plain_rows is not None:
            plans = [(0, 0) if off else p for p, off in zip(plans, plain_rows)]
            chains = [[] if off else c for c, off in zip(chains, plain_rows)]
        row_nodes = [p[0] for p in plans]
        tree, nodes = self._subtree(max(row_nodes), tenant)
        template_tokens = full[:, torch.cat([torch.zeros(1, dtype=torch.long), nodes])]
        batch = build_draft(template_tokens, tree, nodes, chains, matches, row_nodes, [p[1] for p in plans],
                            agreements, cells)
        return replace(batch, template_draft=full, before_roots=before if pairs is not None else None)

    def _choose_branches(self, budget: TreeBudget, roots: list[int], chains: list[list[int]], matches: list[int],
                         table: list[list[int]], found: list[SuffixDraft | None], scopes: RowScopes | None = None
                         ) -> tuple[list[list[bool]], list[list[int] | None] | None]:
        """Per row, the branch worth most (:func:`_branch_value` of its path rates under
        ``budget``'s estimates; the first on a tie) of: its context's (``chains[r]``, ``matches[r]``),
        the tables' chain ``table[r]`` (match length TABLE_CHAIN_MATCH), the suffix index's
        ``found[r]``; ``chains`` and ``matches`` are set to it in place. Returns every row's
        agreements (the matrix's, per token of its branch) and, when a row took a suffix-index
        branch, the SuffixStats cells of its tokens per row (None elsewhere; None overall when no
        row did). One gather for every option's agreements."""
        options: list[list[tuple[list[int], int, SuffixDraft | None]]] = []
        for r in range(len(chains)):
            row = [(chains[r], matches[r], None)] if chains[r] else []
            if table[r]:
                row.append((table[r], TABLE_CHAIN_MATCH, None))
            if found[r] is not None:
                row.append((found[r].tokens, found[r].match, found[r]))
            options.append(row)
        flat_roots = [roots[r] for r, row in enumerate(options) for _ in row]
        flat_overlays = None
        if scopes is not None:
            of_row = scopes.overlay_of_row
            flat_overlays = [of_row[r] for r, row in enumerate(options) for _ in row]
        agreed = iter(self._agreements(flat_roots, [chain for row in options for chain, _, _ in row], flat_overlays))
        agreements: list[list[bool]] = []
        cells: list[list[int] | None] = []
        for r, row in enumerate(options):
            best, best_value = None, -1.0
            for chain, match, draft in row:
                own = next(agreed)
                row_cells = ([SuffixStats.cell(draft.match, c, n, a) for c, n, a in zip(draft.counts, draft.support, own)]
                             if draft is not None else None)
                value = _branch_value(budget.branch_rates(chain, match, own, row_cells)) if len(row) > 1 else 0.0
                if value > best_value:
                    best, best_value = (chain, match, own, row_cells), value
            if best is None:
                chains[r], matches[r] = [], 0
                agreements.append([])
                cells.append(None)
            else:
                chains[r], matches[r] = best[0], best[1]
                agreements.append(best[2])
                cells.append(best[3])
        return agreements, (cells if any(c is not None for c in cells) else None)

    def _agreements(self, roots: list[int], chains: list[list[int]],
                    overlays: Sequence[TenantRows | None] | None = None) -> list[list[bool]]:
        """Per row, per branch token: whether the matrix's first candidate of the token before it
        (the root, then the branch's own tokens) is that token, the evidence the budget prices
        branch tokens by beside their match length (tr/acceptance_stats.py ContextStats); overlays[i]:
        the tenant rows row i reads through. One gather."""
        before = [t for root, chain in zip(roots, chains) if chain for t in (root, *chain[:-1])]
        own = None
        if overlays is not None:
            own = [o for o, chain in zip(overlays, chains) if chain for _ in chain]
        first = iter(self.matrix.first_candidates(before, own))
        return [[next(first) == tok for tok in chain] for chain in chains]

    def _successors(self, walks: list[tuple[int, list[int]]], scopes: RowScopes | None = None
                    ) -> Callable[[int, int, int], Sequence[int]]:
        """``successors(row, before, token)``: the candidates the proposer drafts for ``row`` after
        ``token`` (whose previous token is ``before``), for the consecutive pairs of ``walks`` (each:
        a row, then the token before its root, the root, then the branch tokens it can walk
        through), read in one gather (plus one per tenant overlay in ``scopes``)."""
        group = scopes.group_of_row if scopes is not None else None
        keys = sorted({(group[r] if group is not None else -1, w[i - 1], w[i])
                       for r, w in walks for i in range(1, len(w))})
        if not keys:
            return lambda row, before, token: {}[(row, before, token)]
        prev = np.asarray([p[1] for p in keys], dtype=np.int64)
        tok = np.asarray([p[2] for p in keys], dtype=np.int64)
        table = self.matrix.table.numpy()
        ranks = np.arange(self.matrix.k)[None, :]
        if self.pairs is None:
            rows = table[tok]
        else:
            rows = self.pairs.successors(table, prev[:, None], tok[:, None], ranks)
        if scopes is not None:
            key_group = np.asarray([p[0] for p in keys])
            for g, (overlay, _) in enumerate(scopes.groups):
                sel = np.flatnonzero(key_group == g)
                if len(sel):
                    rows[sel] = overlay.gather(tok[sel][:, None], ranks, rows[sel])
        found = dict(zip(keys, rows.tolist()))
        if group is None:
            return lambda row, before, token: found[(-1, before, token)]
        return lambda row, before, token: found[(group[row], before, token)]

    def _subtree(self, n: int, tenant: str | None = None) -> tuple[CompiledTree, torch.Tensor]:
        """The first ``n`` nodes of ``tenant``'s budget's order (None: the shared one's) as a tree,
        and their full-template indices."""
        budget = self.budget_of(tenant) if self.budget is not None else None
        version = budget.order_version if budget is not None else 0
        key = (tenant, n, version)
        if key not in self._subtrees:
            if version > 0:  # trees of this budget's older orders
                self._subtrees = {k: v for k, v in self._subtrees.items() if k[0] != tenant or k[2] == version}
            nodes = budget.order[:n] if budget is not None else list(range(1, n + 1))
            if self.template is not None and nodes == list(range(1, n + 1)) and n == self.template.num_nodes:
                tree = self.template
            else:
                paths = [self.template.template[i - 1] for i in nodes] if nodes else []
                tree = compile_tree(paths, name=f"{self.template.name if self.template else 'none'}[{n}]")
            self._subtrees[key] = (tree, torch.tensor(nodes, dtype=torch.long))
        return self._subtrees[key]

    # ---- learning from the verification -----------------------------------------------------
    def observe(self, batch: DraftBatch, acceptance: Acceptance, seconds: float | None) -> None:
        """Hand one verification to the budget (latency, node and branch acceptance), or to the
        acceptance estimates a caller attached to a fixed tree; a batch drafted in parts hands each
        part's rows to the budget that planned them, and the step's latency once."""
        if self.budget is not None:
            if not batch.parts:
                self.budget.observe(batch, acceptance, seconds)
                return
            step = self.budget.observe_latency(batch, seconds)
            for part in batch.parts:
                own = acceptance if len(batch.parts) == 1 else acceptance.of_rows(part.rows, part.batch.tokens.shape[1])
                self.budget_of(part.scope).learn(part.batch, own, step)
        elif self.acceptance is not None:
            observe_template(self.acceptance, batch, acceptance)


def _pick(values: list | None, rows: list[int]) -> list | None:
    """``values`` at ``rows`` (None stays None)."""
    return [values[r] for r in rows] if values is not None else None
