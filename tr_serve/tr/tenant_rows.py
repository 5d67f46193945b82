"""Per-tenant matrix overlays: the rows a named tenant's own text wrote, over the shared matrix.

A named tenant drafts from the shared rows (the shipped prior, plus what the shared tenant wrote)
with its own rows on top, and its prefill and verification write only its own rows: what one
tenant's text teaches reaches its own drafts and nobody else's (docs/serving.md, "Tenants and
privacy"). An overlay holds changed rows only, at most ``capacity``; past that the rows the tenant
wrote least recently make room, so one tenant's traffic never evicts another's rows.

Reads are numpy gathers, as on the shared table: a vocabulary-sized index (int32, -1: no row
here) maps a token to its slot, so drafting a named tenant's rows costs one extra gather per tree
level, not a search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tr_serve.tr.matrix import EMPTY, STREAK_CAP, AdjacencyMatrix, winning_nodes

NO_SLOT = -1


class TenantRows:
    """One tenant's overlay: ``rows`` [capacity, k] int32 at the tokens ``token_of`` [capacity]
    (EMPTY: a free slot), each with its :attr:`AdjacencyMatrix.streak` and the write clock that
    picks what to evict."""

    def __init__(self, vocab_size: int, k: int, capacity: int):
        if capacity < 1:
            raise ValueError(f"an overlay holds at least one row, got capacity {capacity}")
        self.k = k
        self.capacity = capacity
        self.slot_of = np.full(vocab_size, NO_SLOT, dtype=np.int32)
        self.token_of = np.full(capacity, EMPTY, dtype=np.int64)
        self.rows = np.full((capacity, k), EMPTY, dtype=np.int32)
        self.streak = np.zeros(capacity, dtype=np.int8)
        self.written = np.zeros(capacity, dtype=np.int64)  # the write clock when each slot was last written
        self.changed = np.zeros(capacity, dtype=bool)  # written here since the fleet last took it
        self.clock = 0
        self.evictions = 0

    @property
    def num_rows(self) -> int:
        return int((self.token_of != EMPTY).sum())

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.slot_of, self.token_of, self.rows, self.streak, self.written, self.changed))

    def write(self, ids: np.ndarray, rows: np.ndarray, base: AdjacencyMatrix) -> None:
        """Rows ``rows`` [n, k] at the distinct tokens ``ids`` [n]; a token's streak goes on from
        the row it drafted from (its own, else the shared one) where the first candidate stays."""
        self.clock += 1
        slots = self.slot_of[ids]
        new = slots == NO_SLOT
        if new.any():
            slots = slots.copy()
            slots[new] = self._claim(int(new.sum()), keep=slots[~new])
            self.slot_of[ids[new]] = slots[new]
            self.token_of[slots[new]] = ids[new]
        first_before = np.where(new, base.table.numpy()[ids, 0], self.rows[slots, 0])
        streak_before = np.where(new, base.streak.numpy()[ids], self.streak[slots])
        kept = first_before == rows[:, 0]
        self.streak[slots] = np.where(kept, np.minimum(streak_before + 1, STREAK_CAP), 0)
        self.rows[slots] = rows
        self.written[slots] = self.clock
        self.changed[slots] = True

    def take_changed(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens [n] and rows [n, k] written since the last take (what the fleet pushes)."""
        slots = np.flatnonzero(self.changed & (self.token_of != EMPTY))
        self.changed[:] = False
        return self.token_of[slots].copy(), self.rows[slots].copy()

    def adopt(self, ids: np.ndarray, rows: np.ndarray) -> int:
        """The fleet's merged rows of this tenant (``rows`` [n, k] at distinct ``ids`` [n]): each
        replaces a row held here unless that row changed here since the last take (it is newer),
        and fills free slots otherwise; it never evicts a row this replica learned. Returns the
        rows written."""
        slots = self.slot_of[ids]
        held = slots != NO_SLOT
        mine = np.zeros(len(ids), dtype=bool)
        mine[held] = self.changed[slots[held]]
        take = held & ~mine
        new = np.flatnonzero(~held)
        free = np.flatnonzero(self.token_of == EMPTY)[: len(new)]
        new = new[: len(free)]
        self.slot_of[ids[new]] = free
        self.token_of[free] = ids[new]
        slots = slots.copy()
        slots[new] = free
        take[new] = True
        at = slots[take]
        self.rows[at] = rows[take]
        self.streak[at] = 0  # how long another replica's first candidate held is not known here
        self.written[at] = self.clock
        return int(take.sum())

    def _claim(self, n: int, keep: np.ndarray) -> np.ndarray:
        """``n`` slots: free ones first, then the least recently written (never one of ``keep``,
        the slots this write updates)."""
        free = np.flatnonzero(self.token_of == EMPTY)
        if len(free) >= n:
            return free[:n]
        age = self.written.copy()
        age[free] = -1  # free slots first
        age[keep] = np.iinfo(np.int64).max
        if n > self.capacity - len(keep):
            raise ValueError(f"{n} new rows do not fit an overlay of {self.capacity} beside the {len(keep)} it updates")
        slots = np.argsort(age, kind="stable")[:n]
        evicted = self.token_of[slots]
        evicted = evicted[evicted != EMPTY]
        self.slot_of[evicted] = NO_SLOT
        self.evictions += len(evicted)
        return slots

    def gather(self, tokens: np.ndarray, ranks: np.ndarray, shared: np.ndarray) -> np.ndarray:
        """The candidates of rank ``ranks`` after ``tokens`` (>= 0, any shape ``ranks`` broadcasts
        with): this overlay's where it holds the token's row, else ``shared`` (the shared table's)."""
        slot = self.slot_of[tokens]
        return np.where(slot != NO_SLOT, self.rows[np.maximum(slot, 0), ranks], shared)

    def first_and_streak(self, token: int, table: np.ndarray, streak: np.ndarray) -> tuple[int, int]:
        slot = int(self.slot_of[token])
        if slot == NO_SLOT:
            return int(table[token, 0]), int(streak[token])
        return int(self.rows[slot, 0]), int(self.streak[slot])


@dataclass(frozen=True)
class RowScopes:
    """Which rows of a step's batch draft through which overlay: ``groups`` of (overlay, the row
    indices [g] int64); rows in no group draft from the shared rows alone."""

    groups: tuple[tuple[TenantRows, np.ndarray], ...]
    group_of_row: tuple[int, ...]  # per row, its index in groups (-1: none)

    @property
    def overlay_of_row(self) -> tuple[TenantRows | None, ...]:
        return tuple(self.groups[g][0] if g >= 0 else None for g in self.group_of_row)

    def subset(self, rows: list[int]) -> "RowScopes | None":
        """The scopes of the batch made of ``rows`` (in that order); None when none of them reads an overlay."""
        picked = [self.group_of_row[r] for r in rows]
        kept = sorted({g for g in picked if g >= 0})
        if not kept:
            return None
        renumber = {g: i for i, g in enumerate(kept)}
        groups = tuple((self.groups[g][0], np.asarray([j for j, h in enumerate(picked) if h == g], dtype=np.int64))
                       for g in kept)
        return RowScopes(groups, tuple(renumber.get(g, -1) for g in picked))

    def gather(self, parent_tok: np.ndarray, ranks: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        """``drafted`` [b, m] (from the shared rows, after ``parent_tok`` [b, m] at ``ranks`` [m])
        with each group's rows read through its overlay."""
        for overlay, rows in self.groups:
            drafted[rows] = overlay.gather(np.maximum(parent_tok[rows], 0), ranks, drafted[rows])
        return drafted


class TenantMatrices:
    """Every named tenant's overlay on one replica, made at its first write."""

    def __init__(self, matrix: AdjacencyMatrix, capacity: int):
        if capacity < 1:
            raise ValueError(f"tenant_matrix_rows must be >= 1, got {capacity}")
        self.matrix = matrix
        self.capacity = capacity
        self.overlays: dict[str, TenantRows] = {}

    def scopes(self, tenants: list[str | None]) -> RowScopes | None:
        """The batch's :class:`RowScopes` (``tenants[r]``: row r's named tenant, None: the shared
        rows alone); None when no row has an overlay yet."""
        by_overlay: dict[str, list[int]] = {}
        for r, t in enumerate(tenants):
            if t is not None and t in self.overlays:
                by_overlay.setdefault(t, []).append(r)
        if not by_overlay:
            return None
        names = list(by_overlay)
        groups = tuple((self.overlays[t], np.asarray(by_overlay[t], dtype=np.int64)) for t in names)
        group_of_row = tuple(names.index(t) if t in by_overlay else -1 for t in tenants)
        return RowScopes(groups, group_of_row)

    def _overlay(self, tenant: str) -> TenantRows:
        """``tenant``'s overlay, made at its first write."""
        overlay = self.overlays.get(tenant)
        if overlay is None:
            overlay = self.overlays[tenant] = TenantRows(self.matrix.vocab_size, self.matrix.k, self.capacity)
        return overlay

    def recycle(self, tenant: str, tokens: torch.Tensor, top: torch.Tensor,
                preferred: torch.Tensor | None = None) -> None:
        """:meth:`AdjacencyMatrix.recycle` into ``tenant``'s overlay (the same winner per token)."""
        token_list = tokens.reshape(-1).tolist()
        prefer = preferred.reshape(-1).tolist() if preferred is not None else None
        index = winning_nodes(token_list, prefer)
        if not index:
            return
        top_np = (top.numpy() if isinstance(top, torch.Tensor) else np.asarray(top)).reshape(len(token_list), -1)
        overlay = self._overlay(tenant)
        ids = np.asarray([token_list[i] for i in index], dtype=np.int64)
        rows = top_np[index, : self.matrix.k].astype(np.int32)
        if len(ids) > self.capacity:  # more distinct tokens than the overlay holds: keep the last ones
            ids, rows = ids[-self.capacity :], rows[-self.capacity :]
        overlay.write(ids, rows, self.matrix)

    def take_changed(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per tenant id, the (tokens [n], rows [n, k]) its overlay wrote since the last take."""
        taken = {t: o.take_changed() for t, o in list(self.overlays.items())}
        return {t: v for t, v in taken.items() if len(v[0])}

    def adopt(self, tenant: str, ids: np.ndarray, rows: np.ndarray) -> int:
        """:meth:`TenantRows.adopt` into ``tenant``'s overlay, made if it has none yet."""
        return self._overlay(tenant).adopt(np.asarray(ids, dtype=np.int64), np.asarray(rows, dtype=np.int32))

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tenant id: rows held, the cap, bytes and rows evicted so far."""
        return {t: {"rows": o.num_rows, "capacity": o.capacity, "bytes": o.nbytes, "evictions": o.evictions}
                for t, o in dict(self.overlays).items()}  # a copy: the step thread may add one meanwhile

    def totals(self) -> dict[str, int]:
        """Over every overlay: what ``/v1/tr/stats`` reports (totals, no tenant ids: any caller may read it)."""
        per = self.stats().values()
        return {"tenants": len(per), "rows": sum(s["rows"] for s in per), "bytes": sum(s["bytes"] for s in per),
                "evictions": sum(s["evictions"] for s in per), "rows_per_tenant": self.capacity}
