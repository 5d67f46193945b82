"""Second-order recycling: the top-K next tokens the model predicted the last time it saw a *pair*
of tokens (the token before, the token), beside the adjacency matrix's rows keyed by one token.

Why: the matrix's row for a token mixes every context that token was seen in; the two-token
context is the model's own prediction in a much narrower one. Measured on the dev questions
(greedy outputs, real text only, SmolLM2-135M): the next token is the top candidate of the
one-token row at 32% of positions and of the pair's row (the one-token row where the pair was
never seen) at 40%; two levels deep, 17% -> 26%. In the engine, the default template's MAT went
2.46 -> 2.65 and ``auto``'s 1.61 -> 1.71 on 13 questions, outputs unchanged (drafts never change
what is accepted). This goes beyond the paper: its matrix is keyed by one token.

The table is a direct-mapped hash of ``slots`` rows: a pair's row is found at ``hash(pair)`` when
the key stored there is that pair (the last pair written to a slot owns it, as the last sighting of
a token owns its matrix row). A pair that was never seen, or whose slot another pair took since,
drafts from the matrix row of its token. Drafting is a gather and a compare per level, in numpy.
"""

from __future__ import annotations

import numpy as np
import torch

from tr_serve.tr.matrix import EMPTY

_MULTIPLIER = 0x9E3779B1  # Fibonacci hashing: consecutive keys land far apart
DEFAULT_SLOTS = 1 << 18  # 262144 pairs: 8 MiB of int32 rows at K=8, 2 MiB of keys


class PairTable:
    """``[slots, k]`` int32 rows of candidates keyed by (token before, token), and the key of each
    slot (-1: empty). Lives beside an :class:`~tr_serve.tr.matrix.AdjacencyMatrix` of the same
    vocabulary and ``k``, in host memory as it is; replicas keep their own (the fleet shares the matrix)."""

    def __init__(self, vocab_size: int, k: int = 8, slots: int = DEFAULT_SLOTS):
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"pair table slots must be a power of two, got {slots}")
        self.vocab_size = vocab_size
        self.k = k
        self.slots = slots
        self.keys = torch.full((slots,), -1, dtype=torch.long)
        self.rows = torch.full((slots, k), EMPTY, dtype=torch.int32)

    def _keys_and_slots(self, before, token):
        """The pair keys and their slots, for numpy arrays or tensors alike (int64 wraps on
        overflow in both; the mask keeps slots in range)."""
        key = before * self.vocab_size + token
        return key, (key * _MULTIPLIER) & (self.slots - 1)

    def successors(self, table: np.ndarray, before: np.ndarray, token: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        """Candidates of rank ``ranks`` after each (before, token) pair, in numpy over the matrix's ``table``:
        the pair's row where it is stored, else ``table[token]``'s. before, token: [...] int64
        (token >= 0; before < 0 = no token before); ranks broadcasts with them."""
        key, slot = self._keys_and_slots(np.maximum(before, 0), token)
        hit = (self.keys.numpy()[slot] == key) & (before >= 0)
        return np.where(hit, self.rows.numpy()[slot, ranks], table[token, ranks])

    def chains(self, before: torch.Tensor, roots: torch.Tensor, lengths: list[int]) -> list[list[int]]:
        """Per row, the chain of top candidates through stored pairs only: after (before, root) the
        pair's rank-0 token, then after (root, that token) its pair's, ... for at most lengths[r]
        tokens, ending at the first pair the table does not hold (a row with no token before, -1,
        gets none). The budget prices it as a context branch of its own kind."""
        out: list[list[int]] = [[] for _ in lengths]
        keys, rows = self.keys.numpy(), self.rows.numpy()
        prev, tok = before.numpy().astype(np.int64), roots.numpy().astype(np.int64)
        room = np.asarray(lengths)
        alive = (prev >= 0) & (room > 0)
        for j in range(max(lengths, default=0)):
            key, slot = self._keys_and_slots(np.maximum(prev, 0), tok)
            alive &= (keys[slot] == key) & (room > j)
            if not alive.any():
                break
            nxt = rows[slot, 0].astype(np.int64)
            for r in np.flatnonzero(alive).tolist():
                out[r].append(int(nxt[r]))
            prev, tok = tok, nxt
        return out

    def write(self, before: torch.Tensor, token: torch.Tensor, top: torch.Tensor) -> None:
        """Store ``top`` [n, k] as the rows of the pairs (before [n], token [n]); all tokens are
        real (>= 0) and the pairs distinct. Pairs with no token before (-1) are skipped."""
        keep = before >= 0
        if not bool(keep.all()):
            before, token, top = before[keep], token[keep], top[keep]
        if before.numel() == 0:
            return
        key, slot = self._keys_and_slots(before, token)
        # two pairs of one write may share a slot: the index write keeps one of them, a pair owns
        # its slot only together with its own row (keys and rows written in one order, last wins)
        order = torch.argsort(slot, stable=True)
        slot, key, top = slot[order], key[order], top.to(torch.int32)[order]
        last = torch.ones_like(slot, dtype=torch.bool)
        last[:-1] = slot[1:] != slot[:-1]
        self.keys[slot[last]] = key[last]
        self.rows[slot[last]] = top[last]

    def clear(self) -> None:
        self.keys.fill_(-1)
        self.rows.fill_(EMPTY)
