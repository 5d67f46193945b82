"""Per-request context index: the continuation of the longest recent n-gram match.

One request's text (prompt + accepted output) is indexed as it grows. For every n in
``min_ngram..max_ngram`` a hash map sends each n-gram to the position just after its most recent
occurrence that has a continuation. The lookup tries the longest suffix n-gram first and returns
the tokens that followed it last time: prompt lookup decoding, done incrementally.

Why an n-gram hash, not a suffix automaton: on a 30 ms CPU step both are negligible, but the hash
is a dozen lines with nothing to get wrong (no clones, no suffix links), gives the *most recent*
occurrence directly (SAM gives the first end position and needs a side map for recency, which
matters for outputs that repeat with variations), and matches longer than ``max_ngram`` add little
confidence over a match of ``max_ngram`` (measured by the acceptance-by-match-length statistics in
tr/acceptance_stats.py). Cost: ``max_ngram`` dict writes per appended token and at most ``max_ngram`` lookups
per step: O(1) each, no rescans of the context.
"""

from __future__ import annotations

from typing import Iterable

# extends of at least this many tokens (a prompt) are indexed n by n with dict.update: 0.49 -> 0.27 ms
# for a 400-token prompt with n-grams of 2-8; a step's 1-3 tokens are faster in the plain loop
# (1.4-2.9 us against 10-12)
BULK_TOKENS = 16


class ContextIndex:
    def __init__(self, max_ngram: int = 8, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # n-gram -> index (into self.tokens) of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks = self.tokens
        start = len(toks)
        toks.extend(map(int, tokens))
        end = len(toks)
        if end - start >= BULK_TOKENS:
            self._index_bulk(start, end)
            return
        for pos in range(start, end):  # the token at pos continues every n-gram ending at pos-1
            for n in range(self.min_ngram, min(self.max_ngram, pos) + 1):  # shorter ones are never looked up
                self._next[tuple(toks[pos - n : pos])] = pos

    def _index_bulk(self, start: int, end: int) -> None:
        """What the loop in :meth:`extend` does for positions start..end-1, one ``dict.update`` per n
        (later positions overwrite earlier ones, as in the loop)."""
        toks, nxt = self.tokens, self._next
        for n in range(self.min_ngram, self.max_ngram + 1):
            first = max(start, n)
            if first < end:
                nxt.update(zip(zip(*[toks[first - n + i : end - n + i] for i in range(n)]), range(first, end)))

    def lookup(self, max_tokens: int) -> tuple[int, list[int]]:
        """(match length, continuation of at most ``max_tokens``) for the longest suffix n-gram of
        the text (``min_ngram`` <= n <= ``max_ngram``) seen before; (0, []) if none."""
        toks = self.tokens
        if max_tokens <= 0:
            return 0, []
        for n in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            start = self._next.get(tuple(toks[len(toks) - n :]))
            if start is not None:
                return n, self._copy(start, max_tokens)
        return 0, []

    def _copy(self, start: int, count: int) -> list[int]:
        """``count`` tokens from ``start`` on, as an overlapping copy (LZ77's): the match says the
        text after the suffix repeats the text after ``start``, so once the copy reaches the end
        it goes on with the tokens it has just predicted (a period-p loop keeps being drafted)."""
        toks, end = self.tokens, len(self.tokens)
        out = toks[start : start + count]
        while len(out) < count:
            out.append(out[start + len(out) - end])
        return out
