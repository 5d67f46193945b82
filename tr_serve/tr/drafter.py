"""Each step's draft: matrix nodes from a template, a context branch per row, under a budget.

* fixed budget: every row verifies the whole template, plus its context branch (``+ctx``)
* ``auto``: per row, how many of the nodes with the best estimated path-acceptance rates to verify
  (an acceptance-driven shape, re-ranked as the estimates move) and a cap on its context branch,
  chosen together to maximise expected tokens per second under the measured step latency
  (tr/budget.py); a row with nothing promising runs a plain one-token step beside rows that
  verify trees
* ``pld``: the context branch alone (prompt lookup decoding through the same runner)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tr_serve.tr.budget import AcceptanceStats, ContextStats, StepLatency, choose_plan
from tr_serve.tr.context_index import ContextIndex
from tr_serve.tr.draft import DraftBatch, build_draft
from tr_serve.tr.matrix import AdjacencyMatrix
from tr_serve.tr.proposer import propose
from tr_serve.tr.tree import CompiledTree, compile_tree, order_by_rates
from tr_serve.tr.tree_spec import TreeSpec
from tr_serve.tr.verifier import Acceptance


@dataclass(frozen=True)
class ContextSettings:
    """How a row's context branch is retrieved: n-gram match lengths and the longest branch."""

    min_ngram: int
    max_ngram: int
    max_tokens: int


# Hybrid: a 1-token match is what the matrix already predicts, so the branch needs 2+; long
# matches earn long branches (the cost-aware budget cuts them by measured acceptance). Measured on
# 8 dev questions x 96 tokens with 2.2.2+ctx (MAT; 2.2.2 alone 2.15): this 2.36; 1-token matches
# with 4 tokens per matched token 2.35, with 16 tokens 2.30; 32-token branches 2.37.
HYBRID_CONTEXT = ContextSettings(min_ngram=2, max_ngram=8, max_tokens=16)
# Prompt lookup as vLLM's n-gram proposer is set up in its CPU examples: n-grams of 2-4, 4 drafts.
PLD_CONTEXT = ContextSettings(min_ngram=2, max_ngram=4, max_tokens=4)

NODE_CANDIDATES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80)
CHAIN_CAPS = (0, 1, 2, 4, 8, 16)
EXPLORE_EVERY = 16  # every 16th step verifies the runner-up plan, to keep its latency measured
REORDER_EVERY = 64  # steps between re-rankings of the template nodes by estimated acceptance
_NOT_VERIFIED = 1 << 30
_PLAIN = compile_tree([], name="none")


class Drafter:
    def __init__(self, spec: TreeSpec, template: CompiledTree | None, matrix: AdjacencyMatrix,
                 latency: StepLatency | None = None):
        if spec.auto_budget and (template is None or latency is None):
            raise ValueError("the cost-aware budget needs a template and a latency table")
        self.spec = spec
        self.template = template
        self.matrix = matrix
        self.latency = latency if spec.auto_budget else None
        self.context = (PLD_CONTEXT if template is None else HYBRID_CONTEXT) if spec.context else None
        n = template.num_nodes if template is not None else 0
        self.acceptance = AcceptanceStats(template) if spec.auto_budget else None
        self.context_stats = ContextStats(self.context.max_tokens) if spec.context and spec.auto_budget else None
        self.order = list(range(1, n + 1))  # template nodes in the order a budget adds them
        self._subtrees: dict[int, tuple[CompiledTree, torch.Tensor]] = {}
        self.node_candidates = tuple(sorted({c for c in NODE_CANDIDATES if c < n} | {n}))
        self._steps = 0
        # moving average of the template nodes verified per step: prompt seeding pays only while
        # the matrix is used (engine.py)
        self.mean_nodes = float(min(n, 2))

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
    def draft(self, roots: torch.Tensor, contexts: list[ContextIndex] | None = None,
              room: list[int] | None = None) -> DraftBatch:
        """roots [b]: each row's last accepted token (the last token of its context, if any).
        room[r]: how many tokens row r may still emit (a branch never drafts past it)."""
        b = roots.shape[0]
        full = propose(self.matrix, roots, self.template) if self.template is not None else roots[:, None]
        chains: list[list[int]] = [[] for _ in range(b)]
        matches = [0] * b
        if self.context is not None and contexts is not None:
            for r, ctx in enumerate(contexts):
                cap = self.context.max_tokens if room is None else min(self.context.max_tokens, room[r] - 1)
                matches[r], chains[r] = ctx.lookup(cap)
        n = self.template.num_nodes if self.template is not None else 0
        cap = self.context.max_tokens if self.context is not None else 0
        plans = self._plan(full, chains, matches) if self.spec.auto_budget else [(n, cap)] * b
        row_nodes = [p[0] for p in plans]
        tree, nodes = self._subtree(max(row_nodes))
        template_tokens = full[:, torch.cat([torch.zeros(1, dtype=torch.long), nodes])]
        batch = build_draft(template_tokens, tree, nodes, chains, matches, row_nodes, [p[1] for p in plans])
        return replace(batch, template_draft=full)

    def _plan(self, full: torch.Tensor, chains: list[list[int]], matches: list[int]) -> list[tuple[int, int]]:
        """Per row, (template nodes, branch cap): the cost-aware budget (tr/budget.py)."""
        self._steps += 1
        rates = self.acceptance.rate_list()  # path rate of full-template node i at [i-1]
        if self._steps % REORDER_EVERY == 0:
            self._reorder(rates)
        position = {node: i for i, node in enumerate(self.order)}
        order_rates = [rates[node - 1] for node in self.order]
        chain_info = []
        full_rows = full.tolist() if any(chains) else None
        for r, chain in enumerate(chains):
            merge_pos, node = [], 0
            for tok in chain:
                nxt = next((c for c in self.template.children[node] if full_rows[r][c] == tok), None)
                if nxt is None:
                    break
                merge_pos.append(position[nxt])
                node = nxt
            merge_pos += [_NOT_VERIFIED] * (len(chain) - len(merge_pos))
            rates_r = self.context_stats.path_rates(matches[r])[: len(chain)] if self.context_stats and chain else []
            chain_info.append((merge_pos, rates_r))
        caps = CHAIN_CAPS if self.context_stats is not None else (0,)
        explore = self._steps % EXPLORE_EVERY == 0
        plans = choose_plan(order_rates, chain_info, self.latency, self.node_candidates, caps, explore)
        if not explore:
            mean = sum(n for n, _ in plans) / max(1, len(plans))
            self.mean_nodes += 0.1 * (mean - self.mean_nodes)
        return plans

    def _reorder(self, rates: list[float]) -> None:
        paths = self.template.template
        ranked = order_by_rates(paths, rates)
        index = {p: i + 1 for i, p in enumerate(paths)}
        order = [index[p] for p in ranked]
        if order != self.order:
            self.order = order
            self._subtrees.clear()

    def _subtree(self, n: int) -> tuple[CompiledTree, torch.Tensor]:
        """The first ``n`` nodes of the current order as a tree, and their full-template indices."""
        if n not in self._subtrees:
            nodes = self.order[:n]
            if self.template is not None and nodes == list(range(1, n + 1)) and n == self.template.num_nodes:
                tree = self.template
            else:
                paths = [self.template.template[i - 1] for i in nodes] if nodes else []
                tree = compile_tree(paths, name=f"{self.template.name if self.template else 'none'}[{n}]")
            self._subtrees[n] = (tree, torch.tensor(nodes, dtype=torch.long))
        return self._subtrees[n]

    # ---- learning from the verification -----------------------------------------------------
    def observe(self, batch: DraftBatch, acceptance: Acceptance, seconds: float | None) -> None:
        """Update the acceptance estimates (the model's argmax choices: for sampled rows too, as
        a proxy) and the measured latency of this step's shape."""
        rows = batch.tokens.shape[0]
        if self.latency is not None and seconds is not None:
            self.latency.observe(rows, batch.num_inputs, seconds, batch.tokens.shape[1])
        if self.acceptance is not None:
            n_full = self.template.num_nodes
            cols = torch.cat([torch.zeros(1, dtype=torch.long), batch.template_nodes])
            choice = torch.zeros(rows, n_full + 1, dtype=torch.long)
            choice[:, cols] = acceptance.choices[:, : len(cols)]
            verified = torch.zeros(rows, n_full + 1, dtype=torch.bool)
            verified[:, cols] = torch.arange(len(cols))[None, :] <= torch.tensor(batch.row_nodes)[:, None]
            self.acceptance.update(batch.template_draft, choice, verified)
        if self.context_stats is not None and any(batch.chain_columns):
            ok = acceptance.accepted_mask.tolist()
            parents = batch.parents.tolist()
            outcomes = []
            for r, cols in enumerate(batch.chain_columns):
                if cols:
                    outcomes.append((batch.match_lengths[r], [ok[r][parents[r][c]] for c in cols],
                                     [ok[r][c] for c in cols]))
            self.context_stats.update(outcomes)

