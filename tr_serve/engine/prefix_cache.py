"""Automatic prefix caching over KV-cache rows (no torch here).

A row's KV entries stay in the cache after its request finishes; the full blocks of ``block_size``
tokens it holds are indexed by a hash chained over the blocks before them and scoped by tenant,
so a new request whose prompt starts with the same blocks, for the same tenant, skips their
prefill: it takes a free row holding those blocks and nothing more as it is (nothing moves), or
gets the blocks copied into a row of its own (a copy of KV, not a forward) from a running
request's row, or from a free row that holds more (another conversation's turns, kept).

Why hash chains (vLLM's block hashes, nano-vllm's block manager): block ``i``'s hash covers
every token before it, so one dict lookup per block finds the longest cached prefix, and a row
holding block ``i`` holds blocks ``0..i``. Why the tenant in the hash: one tenant's text never
decides another's prefill (its time to first token would tell the second tenant what the first
one sent). The hash is SHA-256 (truncated), the same in every process: a collision would attend
to another prompt's KV, so it must not be Python's ``hash``.

Free rows are reused least recently freed first, rows holding nothing cached before them, so a
conversation's next turn finds its row while the cache has room.

Example (block_size 2, one tenant): prompt [5, 6, 7, 8, 9] finishes in row 0 with output [10, 11];
its KV covers [5, 6, 7, 8, 9, 10] (the last output token is never fed), blocks (5, 6), (7, 8),
(9, 10). The next turn's prompt [5, 6, 7, 8, 9, 10, 11, 12] is admitted to row 0 with 6 tokens
cached and prefills [11, 12].
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 16  # tokens per hashed block (vLLM's default block size)


def block_hashes(tokens: list[int], block_size: int, tenant: str | None) -> list[bytes]:
    """The chained hash of each full block of ``tokens`` (a trailing partial block has none).

    Example: block_hashes([1, 2, 3], 2, None) is one hash (of block [1, 2]), not the one of
    block_hashes([1, 2, 3], 2, "a"), nor the second of block_hashes([0, 0, 1, 2], 2, None)."""
    parent = hashlib.sha256(b"tenant\0" + (b"" if tenant is None else b"\1" + tenant.encode())).digest()[:16]
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        parent = hashlib.sha256(parent + array("q", block).tobytes()).digest()[:16]
        out.append(parent)
    return out


@dataclass(frozen=True)
class Placement:
    """Where an admitted request goes: its ``row``, and ``cached`` prompt tokens already in the
    KV cache, found in ``source`` (its own row: they are there; another row: copy them first)."""

    row: int
    source: int
    cached: int


class PrefixCache:
    """Which full blocks each of ``num_rows`` rows holds, and the rows that are free.

    ``place`` admits a request to a row; ``hold`` records the blocks a row holds (its prompt once
    prefilled, its prompt and output when it finishes); ``release`` frees a row, keeping its
    blocks until the row is given to another request."""

    def __init__(self, num_rows: int, block_size: int = DEFAULT_BLOCK_SIZE, enabled: bool = True):
        self.num_rows = num_rows
        self.block_size = block_size
        self.enabled = enabled
        self._held: list[list[bytes]] = [[] for _ in range(num_rows)]  # each row's block hashes, in order
        self._rows_of: dict[bytes, set[int]] = {}  # a block's hash -> the rows holding it
        self._freed_at: dict[int, int] = {row: -1 for row in range(num_rows)}  # free row -> when freed
        self._clock = itertools.count()
        self.queried_tokens = 0  # prompt tokens looked up, and those found (monotonic: metrics)
        self.hit_tokens = 0

    @property
    def free_rows(self) -> list[int]:
        return sorted(self._freed_at)

    def place(self, prompt: list[int], tenant: str | None) -> Placement | None:
        """A free row for ``prompt`` (None: none is free) and the longest cached prefix of its
        blocks for ``tenant``, short of its last token (whose logits the prefill must compute)."""
        if not self._freed_at:
            return None
        hashes = block_hashes(prompt[: len(prompt) - 1], self.block_size, tenant) if self.enabled else []
        self.queried_tokens += len(prompt) if self.enabled else 0
        source, blocks = -1, 0
        for i in range(len(hashes) - 1, -1, -1):
            rows = self._rows_of.get(hashes[i])
            if rows:
                # a free row holding these blocks and nothing more is taken as it is; else the
                # blocks are copied, so a row holding more (another conversation) keeps it
                free = sorted(rows & self._freed_at.keys(), key=lambda r: (len(self._held[r]), r))
                source, blocks = (free[0] if free else min(rows)), i + 1
                break
        in_place = source in self._freed_at and (len(self._held[source]) == blocks or len(self._freed_at) == 1)
        row = source if in_place else self._victim(avoid=source)
        del self._freed_at[row]
        self._drop(row, keep=blocks if row == source else 0)
        if blocks and row != source:  # copied in at admission: this row holds them too
            self._hold(row, hashes[:blocks])
        self.hit_tokens += blocks * self.block_size
        return Placement(row, source if blocks else row, blocks * self.block_size)

    def hold(self, row: int, tokens: list[int], tenant: str | None) -> None:
        """Row ``row``'s KV entries are ``tokens`` (a prefix of them: its full blocks count)."""
        if self.enabled:
            self._drop(row, keep=0)
            self._hold(row, block_hashes(tokens, self.block_size, tenant))

    def release(self, row: int, keep: bool = True) -> None:
        """``row`` is free; its blocks stay findable unless ``keep`` is False (its KV is not known good)."""
        if not keep:
            self._drop(row, keep=0)
        self._freed_at[row] = next(self._clock)

    def forget_free_rows(self) -> None:
        """Every free row's blocks are no longer findable (something else wrote those rows)."""
        for row in self._freed_at:
            self._drop(row, keep=0)

    # ---- internals ------------------------------------------------------------------------------
    def _victim(self, avoid: int = -1) -> int:
        """The free row to overwrite (not ``avoid``, a copy's source, while another is free): one
        holding nothing (the lowest), else the least recently freed."""
        rows = [r for r in self._freed_at if r != avoid] or list(self._freed_at)
        empty = [r for r in rows if not self._held[r]]
        if empty:
            return min(empty)
        return min(rows, key=lambda r: (self._freed_at[r], r))

    def _hold(self, row: int, hashes: list[bytes]) -> None:
        self._held[row] = list(hashes)
        for h in hashes:
            self._rows_of.setdefault(h, set()).add(row)

    def _drop(self, row: int, keep: int) -> None:
        """Forget ``row``'s blocks after its first ``keep``."""
        for h in self._held[row][keep:]:
            rows = self._rows_of[h]
            rows.discard(row)
            if not rows:
                del self._rows_of[h]
        del self._held[row][keep:]
