"""The adjacency matrix: for each token, the top-K next tokens the target model last predicted."""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch

EMPTY = -1  # "no candidate": drafts a node that can never be accepted, and is never an index
STREAK_CAP = 15  # AdjacencyMatrix.streak saturates here


def last_occurrences(tokens: list[int]) -> list[int]:
    """Positions of the last occurrence of each distinct token, ascending: the only positions whose
    logits a :meth:`AdjacencyMatrix.recycle` of ``tokens`` keeps (the last occurrence wins), so
    prompt seeding runs the LM head over these alone (about 57% of a Spec-Bench prompt)."""
    last = {t: i for i, t in enumerate(tokens)}
    return sorted(last.values())


def write_rows_on_host(table: np.ndarray, streak: np.ndarray, dirty: np.ndarray, ids: np.ndarray,
                       rows: np.ndarray) -> None:
    """:meth:`AdjacencyMatrix.recycle`'s write on host views: ``rows`` [n, k] at the distinct ``ids``
    [n], each row's streak raised where its first candidate stays, reset where it changes."""
    kept = table[ids, 0] == rows[:, 0]  # the first candidate written again
    streak[ids] = np.where(kept, np.minimum(streak[ids] + 1, STREAK_CAP), 0)
    table[ids] = rows
    dirty[ids] = True


class RowOverlay(Protocol):
    """Rows read over this matrix's for one tenant (tr/tenant_rows.py TenantRows, which imports this module)."""

    def first_and_streak(self, token: int, table: np.ndarray, streak: np.ndarray) -> tuple[int, int]:
        ...


class PairRows(Protocol):
    """Where :meth:`AdjacencyMatrix.recycle` also writes rows keyed by (token before, token): the
    pair table (tr/pair_table.py, which imports this module)."""

    def write(self, before: torch.Tensor, token: torch.Tensor, top: torch.Tensor) -> None:
        ...


def _winners(keys: list, tokens: list[int], prefer: list[bool] | None) -> dict:
    """key -> the node whose logits it keeps, over the nodes whose token is real: the last one,
    unless only an earlier one is ``prefer``-red (on an accepted path)."""
    winner: dict = {}
    for i, (key, t) in enumerate(zip(keys, tokens)):
        if t < 0:
            continue
        j = winner.get(key)
        if j is None or not (prefer is not None and prefer[j] and not prefer[i]):
            winner[key] = i
    return winner


def winning_nodes(tokens: list[int], prefer: list[bool] | None) -> list[int]:
    """The nodes whose logits :meth:`AdjacencyMatrix.recycle` keeps, ascending: one per distinct
    real token (a node on an accepted path first, then the last occurrence)."""
    return sorted(_winners(tokens, tokens, prefer).values())


class AdjacencyMatrix:
    """``[vocab, k]`` int32 table of candidate next tokens, plus the set of rows changed since the
    last :meth:`take_dirty_rows` (what a replica pushes to the fleet), plus each row's
    :attr:`streak`.

    ``streak[t]``: how many overwrites in a row of row ``t`` (by :meth:`recycle`) kept its first
    candidate unchanged, up to :data:`STREAK_CAP`. Why: a row the model keeps rewriting with the
    same first choice predicts a next token that does not depend on the context, and that is the
    one case where a single matrix node is worth a query token on a busy step. Measured offline
    on 30 dev questions x 128 tokens with a hot matrix, the first candidate after the root was the
    model's choice 0.26 of the time at streak 0 (72% of the roots), 0.55 at 1, 0.75-0.79 at 2-3 and
    0.95 at 4 or more (16% of the roots at 2 or more).

    The table lives in host memory whatever the model's device: drafting reads it through numpy
    views, and the step's one copy from the device brings the top-k ids it recycles."""

    def __init__(self, vocab_size: int, k: int = 8):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.vocab_size = vocab_size
        self.k = k
        self.table = torch.full((vocab_size, k), EMPTY, dtype=torch.int32)
        self._dirty = torch.zeros(vocab_size, dtype=torch.bool)
        self.streak = torch.zeros(vocab_size, dtype=torch.int8)

    def recycle(self, tokens: torch.Tensor, top: torch.Tensor, preferred: torch.Tensor | None = None,
                pairs: PairRows | None = None, before: torch.Tensor | None = None) -> None:
        """Overwrite the rows of ``tokens`` [n] (or any shape) with ``top`` [n, >= k] (host, or the
        tokens' shape plus that last axis): the model's top next
        tokens after each of them, best first (the runner computes them where the logits are).

        Tokens that are :data:`EMPTY` (tree nodes that drafted nothing) are skipped. When a token
        occurs at several nodes, a ``preferred`` one (bool [n]: a node on an accepted path, whose
        logits follow the real text) wins over the others, then the last occurrence. With ``pairs``
        and ``before`` [n] (the token before each node, -1 for none), the same top-k also becomes
        the rows of the pairs (before, token) in the pair table, one winner per pair by the same
        rule.
        """
        # which node's ids each token keeps, decided on the host: a few dozen nodes per step, so a
        # dict walk beats the tensor version (a vocabulary-sized scatter and ~10 small ops)
        token_list = tokens.reshape(-1).tolist()
        prefer = preferred.reshape(-1).tolist() if preferred is not None else None
        index = winning_nodes(token_list, prefer)  # the node whose ids each token keeps
        if not index:
            return
        top_np = (top.numpy() if isinstance(top, torch.Tensor) else np.asarray(top)).reshape(len(token_list), -1)
        ids = np.asarray([token_list[i] for i in index])  # distinct: one winner per token
        write_rows_on_host(self.table.numpy(), self.streak.numpy(), self._dirty.numpy(), ids,
                           top_np[index, : self.k].astype(np.int32))
        if pairs is not None and before is not None:
            before_list = before.reshape(-1).tolist()
            pair_winner = _winners(list(zip(before_list, token_list)), token_list, prefer)
            pair_index = sorted(i for pair, i in pair_winner.items() if pair[0] >= 0)  # no token before: no pair
            if pair_index:
                pairs.write(torch.tensor([before_list[i] for i in pair_index], dtype=torch.long),
                            torch.tensor([token_list[i] for i in pair_index], dtype=torch.long),
                            torch.from_numpy(top_np[pair_index, : self.k].astype(np.int32)))

    @property
    def device(self) -> torch.device:
        return self.table.device

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """A copy of the rows ``ids`` [n]: [n, k] int32 on the matrix's device (what a replica pushes)."""
        return self.table[ids.to(self.table.device)]

    def adopt(self, table: torch.Tensor, keep_ids: torch.Tensor | None = None,
              keep_rows: torch.Tensor | None = None) -> None:
        """Take over ``table`` [vocab, k] (the fleet's snapshot, another matrix's table), then write
        ``keep_rows`` [n, k] back at ``keep_ids`` [n] (this replica's own rows the snapshot does not
        hold yet). A row the snapshot holds nothing for (EMPTY) keeps this matrix's: an empty row
        carries no information, and the matrix may hold a prior there (runner/matrix_prior.py).
        A pinned CPU ``table`` is copied asynchronously on CUDA. The dirty set is left as it is:
        adopted rows are not this matrix's changes to push."""
        if tuple(table.shape) != tuple(self.table.shape):
            raise ValueError(f"cannot adopt a table of shape {tuple(table.shape)} into {tuple(self.table.shape)}")
        table = table.to(self.table.device, non_blocking=table.is_pinned())
        own = table[:, 0] == EMPTY  # rows the snapshot holds nothing for keep ours (a prior's, say)
        before = self.table[:, 0].clone()
        self.table.copy_(torch.where(own[:, None], self.table, table))
        if keep_ids is not None and keep_ids.numel():
            self.table[keep_ids.to(self.table.device)] = keep_rows.to(self.table.device)
        self.streak.masked_fill_(self.table[:, 0] != before, 0)  # a new first candidate starts over

    def seed(self, prior: torch.Tensor) -> int:
        """Fill the rows that hold nothing yet (EMPTY) from ``prior`` [vocab, k]; rows already learned
        are kept. Not marked dirty: a prior is every replica's own starting point, not a change for
        the fleet. Returns how many rows were filled."""
        if tuple(prior.shape) != tuple(self.table.shape):
            raise ValueError(f"cannot seed a table of shape {tuple(self.table.shape)} from {tuple(prior.shape)}")
        empty = self.table[:, 0] == EMPTY
        self.table[empty] = prior.to(self.table.device, torch.int32)[empty]  # an empty row's streak is 0 already
        return int(empty.sum())

    def take_dirty_rows(self) -> torch.Tensor:
        """Ids of rows changed since the last call (and clear the set)."""
        ids = self._dirty.nonzero().flatten()
        self._dirty[ids] = False
        return ids

    def num_filled_rows(self) -> int:
        return int((self.table[:, 0] != EMPTY).sum())

    def clear(self) -> None:
        self.table.fill_(EMPTY)
        self._dirty.zero_()
        self.streak.zero_()

    def first_candidates(self, tokens: list[int], overlays: Sequence[RowOverlay | None] | None = None) -> list[int]:
        """Each token's first candidate (EMPTY where its row holds nothing); ``overlays[i]``: the
        tenant rows token i reads through (tr/tenant_rows.py), None: the shared rows."""
        if not tokens:
            return []
        first = self.table[:, 0].numpy()[tokens].tolist()
        if overlays is not None:
            table, streak = self.table.numpy(), self.streak.numpy()
            first = [o.first_and_streak(t, table, streak)[0] if o is not None else f
                     for t, f, o in zip(tokens, first, overlays)]
        return first

    def confident_chains(self, roots: list[int], caps: list[int], min_streak: int,
                         overlays: Sequence[RowOverlay | None] | None = None) -> list[list[int]]:
        """Per root, the chain of first candidates from it (root -> its first candidate -> that
        token's first candidate ...) while each token it leaves has a :attr:`streak` of at least
        ``min_streak``, at most ``caps[i]`` tokens: a context-free branch for a row whose context
        has no match; ``overlays[i]``: the tenant rows root i's chain reads through, None: the
        shared rows. Read through numpy views, no copy."""
        table, first, streak = self.table.numpy(), self.table[:, 0].numpy(), self.streak.numpy()
        chains = []
        for i, (token, cap) in enumerate(zip(roots, caps)):
            overlay = overlays[i] if overlays is not None else None
            chain: list[int] = []
            while len(chain) < cap and token >= 0:
                if overlay is None:
                    nxt, confidence = int(first[token]), int(streak[token])
                else:
                    nxt, confidence = overlay.first_and_streak(token, table, streak)
                if confidence < min_streak or nxt < 0:
                    break
                token = nxt
                chain.append(token)
            chains.append(chain)
        return chains
