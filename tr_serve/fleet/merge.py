"""The fleet merge rule: how rows pushed by many replicas become one adjacency matrix.

Pure NumPy functions (no Ray, no torch, no clock): the matrix actor calls them with its own time.

State per token row ``r``: up to K candidates ``cands[r]`` (best first, :data:`EMPTY` = none),
their scores ``scores[r]`` (float, >= 0) and ``stamp[r]``, the time the scores refer to.

Rule, for a row pushed at time ``now`` with candidates ``new[0..K-1]`` (a replica's top-K, best
first):

1. **Recency.** Old scores decay with a half-life: they are multiplied by
   ``0.5 ** ((now - stamp) / half_life_s)``. (A push older than the row's stamp -- clocks that
   went back -- is decayed instead, by the same formula the other way round, so the result is
   always expressed at ``max(now, stamp)``, which becomes the new stamp.)
2. **Votes by rank.** The candidate at rank ``i`` of the push gets the vote ``1 / (i + 1)``
   (reciprocal rank: 1, 1/2, 1/3, ...). :data:`EMPTY` entries vote for nothing.
3. **Union.** A token's score is its decayed old score plus its new vote; a token in only one of
   the two lists keeps just that part.
4. **Top-K.** The K highest scores are kept, best first (column 0 is what the proposer drafts
   first). **Ties** go to the newer evidence: candidates of the push in their push rank order,
   then the old candidates in their old order. Fewer than K distinct tokens leave the tail
   :data:`EMPTY` with score 0. The output never contains a token twice.

So a row seen by one replica only becomes exactly that replica's row (ranks kept); a candidate
several replicas agree on outranks one a single replica just proposed; and stale agreement fades
out with the half-life, so the fleet follows what the model predicts now.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1  # == tr_serve.tr.matrix.EMPTY

_CHUNK_ROWS = 4096  # rows merged at once: bounds the [rows, 2K, 2K] comparison tensor


def rank_weights(k: int) -> np.ndarray:
    """Vote of the candidate at each rank: ``1 / (rank + 1)``."""
    return 1.0 / np.arange(1, k + 1, dtype=np.float64)


def decay(age_s, half_life_s: float):
    """``0.5 ** (age / half_life)`` for ``age >= 0`` (a negative age counts as 0)."""
    if half_life_s <= 0:
        raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
    return np.power(0.5, np.maximum(np.asarray(age_s, dtype=np.float64), 0.0) / half_life_s)


def merge_rows(old_cands: np.ndarray, old_scores: np.ndarray, old_stamp: np.ndarray, new_cands: np.ndarray,
               now: float, half_life_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge ``new_cands`` [n, K] (one push, best first) into the state of the same n rows.

    Returns new ``(cands int32 [n, K], scores float32 [n, K], stamp float64 [n])``; the inputs
    are not modified.
    """
    old_cands = np.asarray(old_cands)
    new_cands = np.asarray(new_cands)
    if old_cands.ndim != 2 or new_cands.shape != old_cands.shape:
        raise ValueError(f"expected two [n, K] candidate arrays of one shape, got {old_cands.shape} and "
                         f"{new_cands.shape}")
    n, k = new_cands.shape
    out_c = np.empty((n, k), dtype=np.int32)
    out_s = np.empty((n, k), dtype=np.float32)
    out_t = np.empty(n, dtype=np.float64)
    for lo in range(0, n, _CHUNK_ROWS):
        hi = min(n, lo + _CHUNK_ROWS)
        c, s, t = _merge_chunk(old_cands[lo:hi], np.asarray(old_scores[lo:hi], dtype=np.float64),
                               np.asarray(old_stamp[lo:hi], dtype=np.float64), new_cands[lo:hi], float(now),
                               half_life_s)
        out_c[lo:hi], out_s[lo:hi], out_t[lo:hi] = c, s, t
    return out_c, out_s, out_t


def _merge_chunk(old_c, old_s, old_t, new_c, now, half_life_s):
    n, k = new_c.shape
    ref = np.maximum(old_t, now)
    old_f = decay(ref - old_t, half_life_s)
    new_f = decay(ref - now, half_life_s)
    new_s = np.where(new_c != EMPTY, rank_weights(k)[None, :] * new_f[:, None], 0.0)
    old_s = np.where(old_c != EMPTY, np.maximum(old_s, 0.0) * old_f[:, None], 0.0)
    cands = np.concatenate([new_c, old_c], axis=1).astype(np.int32)  # priority order: push, then old
    score = np.concatenate([new_s, old_s], axis=1)
    valid = cands != EMPTY
    same = (cands[:, :, None] == cands[:, None, :]) & valid[:, :, None]  # [n, 2K, 2K]
    total = (same * score[:, None, :]).sum(axis=2)
    earlier = np.tril(np.ones((2 * k, 2 * k), dtype=bool), -1)  # earlier[a, b]: column b comes before a
    first = valid & ~(same & earlier[None]).any(axis=2)  # keep each token once, at its best priority
    key = np.where(first, total, -np.inf)
    order = np.argsort(-key, axis=1, kind="stable")[:, :k]  # stable: ties keep the priority order
    top_c = np.take_along_axis(cands, order, axis=1)
    top_s = np.take_along_axis(key, order, axis=1)
    missing = ~np.isfinite(top_s)
    top_c[missing] = EMPTY
    top_s[missing] = 0.0
    return top_c, top_s.astype(np.float32), ref


def last_per_row(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A push may name a row twice: keep the last occurrence of each id (ids sorted)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return ids, np.asarray(rows).reshape(0, *np.asarray(rows).shape[1:])
    rev = ids[::-1]
    uniq, idx = np.unique(rev, return_index=True)
    return uniq, np.asarray(rows)[len(ids) - 1 - idx]


def merge_push(cands: np.ndarray, scores: np.ndarray, stamp: np.ndarray, ids: np.ndarray, rows: np.ndarray,
               now: float, half_life_s: float) -> int:
    """Apply one push to the full state arrays in place (the actor's bookkeeping around
    :func:`merge_rows`); returns the number of rows merged."""
    ids, rows = last_per_row(ids, rows)
    if ids.size == 0:
        return 0
    c, s, t = merge_rows(cands[ids], scores[ids], stamp[ids], rows, now, half_life_s)
    cands[ids], scores[ids], stamp[ids] = c, s, t
    return int(ids.size)
