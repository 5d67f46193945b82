"""Cross-request suffix index: what followed the longest matching suffix in *other* requests' text.

The per-request context index (tr/context_index.py) drafts from one request's own prompt and
output; the matrix and the pair table know one or two tokens of context. This index holds the
prompts and outputs of many requests of a replica (finished ones, and running ones as they grow)
and, for a row's text, finds the occurrences of its longest suffix in the other requests' text,
then drafts the continuation most of them went on with, one token at a time, with how many
occurrences reached each depth (``support``) and how many of those went on with the drafted token
(``counts``): the per-depth confidence the cost-aware budget prices (tr/acceptance_stats.py SuffixStats).
This is SuffixDecoding's frequency-weighted suffix match, built for bounded memory and a CPU step.

Structure. Each request is a *document*: its tokens in an ``array('i')``, growing while it runs.
Every position of a document, from its ``min_match``-th on, is an *occurrence* of the
``min_match``-gram before it, packed as one int (document id, position of the token that followed).
A namespace's head map sends each ``min_match``-gram to its newest occurrence, and each document
keeps, per position, the occurrence of the same gram before it (an ``array('q')``): hash chains, as
LZ77 compressors keep them. A lookup walks the chain of the row's last ``min_match`` tokens, newest
first, for at most ``max_occurrences`` occurrences of other documents, extends each one's match
backwards (at most ``max_match`` tokens), keeps the occurrences of the longest match and walks their
continuations forwards. Cost: a few integer ops, one dict write and one array append per indexed
token; a lookup at most ``max_occurrences x (max_match + max_tokens)`` token compares (a few tens of
microseconds on the usual grams, whose chains are short). No rescans of the text.

Bounded memory: at most ``capacity`` tokens are held per namespace; past it the namespace's
oldest documents are evicted whole, running ones included (a document evicted while its request
runs is no longer indexed). Per namespace, so one tenant's text never evicts another's. A chain ends at an evicted document's occurrence, and a head that pointed into
one is removed with it, so every map and array holds at most one entry per held token
(:meth:`SuffixIndex.nbytes` reports the bytes: about 100 a token of distinct text, DEFAULT_CAPACITY).

Tenants: each document belongs to a namespace, and a lookup only ever reads documents of the
requester's namespace, so one tenant's text never drafts for another's (the fleet's matrix is
kept apart by the same namespace: tr_serve/fleet/config.py).

Fleet sharing (tr_serve/fleet/suffix_share.py): the engine marks a request's document
:meth:`SuffixIndex.finish`-ed when the request retires; :meth:`SuffixIndex.export_documents` hands
out the finished ones after a cursor, and another replica indexes them with
:meth:`SuffixIndex.import_document` (under their origin's key, never twice) and :meth:`extend`.
Imported documents are never exported again, and they count against the same ``capacity``.
"""

from __future__ import annotations

import sys
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

DEFAULT_NAMESPACE = "default"  # as tr_serve.fleet.config.DEFAULT_NAMESPACE (which imports pydantic)
# 2^18 tokens: about 250 chat requests of 1k tokens. Measured at the limit (nbytes and tracemalloc
# agree): 97 bytes a token of distinct text (the dev questions' prompts and greedy answers, 5.9 MiB
# at 65,536 tokens), so at most about 25 MiB here; 9.8 MiB with that text four times over (fewer
# distinct grams)
DEFAULT_CAPACITY = 1 << 18
# 3, not 2: one and two tokens of context are the matrix's and the pair table's (the model's own
# top-K there beats text counts); a 3-gram shared by two requests is the shortest match the
# other requests' text adds to them
MIN_MATCH = 3
MAX_MATCH = 32  # backward comparison stops here: longer matches are rare and add no confidence
# occurrences of other documents a lookup reads, the newest: bounds its work on very common grams
# (chat-template tokens, "of the") and keeps the votes about recent text. Measured offline on the
# dev questions' greedy outputs (each question's positions looked up in the index of the ones
# before it): the first drafted token was right at 7.8-8.0% of the positions with 4 to 64
# occurrences read; 16 costs a quarter of 64's work on common grams
MAX_OCCURRENCES = 16
MAX_VISITS_PER_OCCURRENCE = 4  # a chain walk also skips the requester's own occurrences, at most this many times more
_TOKEN_BITS = 20  # grams pack min_match token ids of < 2^20 (a 1M vocabulary) in one int
_POS_BITS = 32  # an occurrence packs (document id, position) in one int


@dataclass(frozen=True)
class SuffixDraft:
    """One lookup's branch: ``tokens[j]`` was the continuation of ``counts[j]`` of the ``support[j]``
    occurrences that matched the row's suffix (``match`` tokens long) and went on with
    ``tokens[:j]``. ``counts[j] / support[j]`` is the depth's confidence."""

    match: int
    tokens: list[int]
    support: list[int]
    counts: list[int]

    def confidence(self, j: int) -> float:
        return self.counts[j] / self.support[j]


@dataclass(frozen=True)
class SharedDocument:
    """A finished document of this replica as it leaves for the fleet: its id here, its namespace
    and a copy of its tokens."""

    doc: int
    namespace: str
    tokens: array  # array('i')


@dataclass
class _Document:
    namespace: str
    tokens: array = field(default_factory=lambda: array("i"))
    prev: array = field(default_factory=lambda: array("q"))  # per position: the gram's occurrence before it (-1: none)


class SuffixIndex:
    """Documents of many requests, per namespace, within ``capacity`` tokens per namespace."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, min_match: int = MIN_MATCH, max_match: int = MAX_MATCH,
                 max_occurrences: int = MAX_OCCURRENCES):
        if capacity < 1:
            raise ValueError(f"suffix index capacity must be >= 1 token, got {capacity}")
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {max_occurrences}")
        self.capacity = capacity
        self.min_match = min_match
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self._docs: dict[int, _Document] = {}
        self._heads: dict[str, dict[int, int]] = {}  # namespace -> gram -> its newest occurrence
        self._held: dict[str, dict[int, None]] = {}  # namespace -> its documents, oldest (the next evicted) first
        self._namespace_tokens: dict[str, int] = {}
        self._next_id = 0
        self.num_tokens = 0
        self.evicted_documents = 0
        self._finished: dict[int, int] = {}  # this replica's finished documents -> finish sequence, in that order
        self._finish_seq = 0
        self._keys: dict[Hashable, int] = {}  # imported documents: origin key -> document id
        self._key_of: dict[int, Hashable] = {}

    # ---- feeding ---------------------------------------------------------------------------------
    def open(self, namespace: str = DEFAULT_NAMESPACE) -> int:
        """A new, empty document of ``namespace``; returns its id."""
        doc = self._next_id
        self._next_id += 1
        self._docs[doc] = _Document(namespace)
        self._heads.setdefault(namespace, {})
        self._held.setdefault(namespace, {})[doc] = None
        self._namespace_tokens.setdefault(namespace, 0)
        return doc

    def __contains__(self, doc: int) -> bool:
        return doc in self._docs

    def document_length(self, doc: int) -> int:
        """Tokens held of ``doc`` (0 once evicted)."""
        d = self._docs.get(doc)
        return len(d.tokens) if d is not None else 0

    def extend(self, doc: int, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to ``doc`` and index them; a no-op for an evicted document. Evicts
        the oldest documents of its namespace while it holds more than ``capacity`` tokens."""
        d = self._docs.get(doc)
        if d is None:
            return
        toks, prev = d.tokens, d.prev
        start = len(toks)
        toks.extend(tokens)
        end = len(toks)
        if end == start:
            return
        if max(toks[start:end]) >> _TOKEN_BITS or min(toks[start:end]) < 0:
            del toks[start:end]
            raise ValueError(f"suffix index: token ids must be in [0, 2^{_TOKEN_BITS})")
        heads, m = self._heads[d.namespace], self.min_match
        base = doc << _POS_BITS
        mask = (1 << (_TOKEN_BITS * m)) - 1
        key = 0
        for t in toks[max(0, start - m) : start]:  # the gram before the first new token
            key = ((key << _TOKEN_BITS) | t) & mask
        get = heads.get
        for pos in range(start, end):  # the token at pos follows the gram toks[pos-m:pos]
            if pos >= m:
                prev.append(get(key, -1))
                heads[key] = base | pos
            else:
                prev.append(-1)
            key = ((key << _TOKEN_BITS) | toks[pos]) & mask
        self.num_tokens += end - start
        namespace = d.namespace
        self._namespace_tokens[namespace] += end - start
        while self._namespace_tokens.get(namespace, 0) > self.capacity:
            self._evict_oldest(namespace)

    def namespace_tokens(self, namespace: str = DEFAULT_NAMESPACE) -> int:
        """Tokens held of ``namespace``'s text (at most ``capacity``)."""
        return self._namespace_tokens.get(namespace, 0)

    def _evict_oldest(self, namespace: str) -> None:
        held = self._held[namespace]
        doc = next(iter(held))
        d = self._docs.pop(doc)
        del held[doc]
        self._finished.pop(doc, None)
        key = self._key_of.pop(doc, None)
        if key is not None:
            del self._keys[key]
        toks, m = d.tokens, self.min_match
        heads = self._heads[d.namespace]
        base = doc << _POS_BITS
        key, mask = 0, (1 << (_TOKEN_BITS * m)) - 1
        for pos, t in enumerate(toks):
            if pos >= m and heads.get(key) == base | pos:  # the gram's newest occurrence: its chain goes too
                del heads[key]
            key = ((key << _TOKEN_BITS) | t) & mask
        self.num_tokens -= len(toks)
        self._namespace_tokens[namespace] -= len(toks)
        self.evicted_documents += 1
        if not held:
            del self._heads[namespace], self._held[namespace], self._namespace_tokens[namespace]

    # ---- sharing with the fleet --------------------------------------------------------------------
    def finish(self, doc: int) -> None:
        """``doc``'s request is over: its text grows no more and :meth:`export_documents` hands it
        out. A no-op for an evicted, an imported or an already finished document."""
        if doc in self._docs and doc not in self._key_of and doc not in self._finished:
            self._finish_seq += 1
            self._finished[doc] = self._finish_seq

    def export_documents(self, since: int = 0) -> tuple[list[SharedDocument], int]:
        """This replica's documents finished after cursor ``since`` and still held, oldest first,
        their tokens copied; and the cursor to pass next time.
        Documents that came from elsewhere (:meth:`import_document`) are never exported."""
        out = []
        for doc in reversed(self._finished):  # newest first: stop at the cursor
            if self._finished[doc] <= since:
                break
            d = self._docs[doc]
            out.append(SharedDocument(doc, d.namespace, d.tokens[:]))
        out.reverse()
        return out, max(since, self._finish_seq)

    def import_document(self, key: Hashable, namespace: str) -> int | None:
        """A new, empty document for text another replica indexed, under ``key`` (its origin and
        its id there; feed it with :meth:`extend`); None when a document of ``key`` is held
        already, so that the same text never counts twice."""
        if key in self._keys:
            return None
        doc = self.open(namespace)
        self._keys[key] = doc
        self._key_of[doc] = key
        return doc

    def holds(self, key: Hashable) -> bool:
        """Whether the imported document of ``key`` is held (not evicted)."""
        return key in self._keys

    # ---- drafting --------------------------------------------------------------------------------
    def lookup(self, doc: int, max_tokens: int) -> SuffixDraft | None:
        """The branch for the text of ``doc`` (the requester's own document, which is excluded from
        the match): the continuation of the longest suffix of that text found in the other
        documents of its namespace, at most ``max_tokens`` tokens; None when no suffix of
        ``min_match`` tokens occurs elsewhere or the document was evicted."""
        d = self._docs.get(doc)
        if d is None or max_tokens <= 0:
            return None
        return self.lookup_text(d.tokens, d.namespace, max_tokens, exclude=doc)

    def lookup_text(self, text: Sequence[int], namespace: str, max_tokens: int,
                    exclude: int | None = None) -> SuffixDraft | None:
        """:meth:`lookup` for any ``text`` (a request's prompt and output so far)."""
        m, n = self.min_match, len(text)
        heads = self._heads.get(namespace)
        if n < m or heads is None or max_tokens <= 0:
            return None
        key = 0
        for t in text[n - m :]:
            key = (key << _TOKEN_BITS) | t
        entry = heads.get(key, -1)
        docs, limit = self._docs, min(self.max_match, n)
        best, best_len = [], 0
        low = (1 << _POS_BITS) - 1
        found, visits = 0, 0
        # newest first (ties of the vote go to recent text); the excluded document's own occurrences
        # are skipped, at most MAX_VISITS_PER_OCCURRENCE times the occurrences a lookup reads
        while entry >= 0 and found < self.max_occurrences and visits < MAX_VISITS_PER_OCCURRENCE * self.max_occurrences:
            d = docs.get(entry >> _POS_BITS)
            if d is None:  # evicted: the chain's older part went with it
                break
            pos = entry & low
            visits += 1
            if entry >> _POS_BITS != exclude:
                found += 1
                toks = d.tokens
                length, top = m, min(limit, pos)
                while length < top and toks[pos - 1 - length] == text[n - 1 - length]:
                    length += 1
                if length > best_len:
                    best, best_len = [(toks, pos)], length
                elif length == best_len:
                    best.append((toks, pos))
            entry = d.prev[pos]
        if not best:
            return None
        tokens, support, counts = [], [], []
        alive = best
        while len(tokens) < max_tokens:
            if len(alive) == 1:  # one occurrence left: the rest of its text, one vote of one each
                t, p = alive[0]
                rest = t[p : p + max_tokens - len(tokens)].tolist()
                tokens += rest
                support += [1] * len(rest)
                counts += [1] * len(rest)
                break
            votes = Counter(t[p] for t, p in alive if p < len(t))  # running documents may end here
            if not votes:
                break
            total = sum(votes.values())
            tok, count = max(votes.items(), key=_by_count)  # the first of equal counts: the most recent
            tokens.append(tok)
            support.append(total)
            counts.append(count)
            alive = [(t, p + 1) for t, p in alive if p < len(t) and t[p] == tok]
        return SuffixDraft(best_len, tokens, support, counts) if tokens else None

    # ---- size ------------------------------------------------------------------------------------
    def num_documents(self) -> int:
        return len(self._docs)

    def num_occurrences(self) -> int:
        """Occurrences held: one per position past each document's first ``min_match``."""
        return sum(max(0, len(d.tokens) - self.min_match) for d in self._docs.values())

    def num_grams(self) -> int:
        """Grams with a head (an occurrence in a held document)."""
        return sum(len(heads) for heads in self._heads.values())

    def nbytes(self) -> int:
        """Bytes the index holds: the documents' token and chain arrays, the head maps, their keys
        and values (``sys.getsizeof``; shared small ints counted too)."""
        size = sys.getsizeof(self._docs) + sys.getsizeof(self._heads) + sys.getsizeof(self._finished)
        size += sum(sys.getsizeof(held) for held in self._held.values())
        size += sys.getsizeof(self._keys) + sys.getsizeof(self._key_of)
        size += sum(sys.getsizeof(key) for key in self._keys)
        for d in self._docs.values():
            size += sys.getsizeof(d) + sys.getsizeof(d.tokens) + sys.getsizeof(d.prev)
        for heads in self._heads.values():
            size += sys.getsizeof(heads) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in heads.items())
        return size


def _by_count(item: tuple[int, int]) -> int:
    return item[1]
