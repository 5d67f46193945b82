"""Acceptance statistics of the cost-aware budget: how often each template node, context-branch
token and suffix-index branch token is the model's choice, learned from each verification.

Greedy or sampled, the tokens a step accepts form one chain of the tree, so the expected number of
accepted drafts of a template prefix is the sum of its nodes' path-acceptance rates ``p_i``; these
classes estimate them (tr/budget.py prices plans with them).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from tr_serve.tr.matrix import EMPTY
from tr_serve.tr.tree import CompiledTree, path_prior

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

    def _conditional_rates(self) -> np.ndarray:
        """q_i for nodes 1..n (index 0 here = node 1); 0 where nothing has been observed."""
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
