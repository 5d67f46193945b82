"""The fleet's suffix corpus: the finished documents (a request's prompt and output token ids, with
its tenant namespace) that replicas indexed in their suffix index (tr/suffix_index.py), held by the
fleet actor so that a fresh replica drafts from what the whole fleet saw.

* :class:`DocumentBatch` -- documents in columns: one token buffer and offsets, so that a push, the
  object-store broadcast and the disk file (fleet/corpus_file.py) each move a few numpy arrays, not
  a Python list per document. Anything received is checked (:meth:`DocumentBatch.check`).
* :class:`FleetCorpus`   -- the actor's store: within ``capacity`` tokens per namespace, each
  namespace's oldest documents evicted first (one tenant's text never evicts another's), each numbered in arrival order (``seq``) so that a replica asks
  for what came after the last one it indexed. A document is keyed by (origin replica, its id
  there): pushed twice (a push re-sent after a timeout, or after the actor restarted) it is held once.

Namespaces travel with their documents: a replica indexes each one under its own namespace, and
its suffix index drafts for a request only from documents of the request's namespace.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tr_serve.tr.suffix_index import SharedDocument

MAX_NAME = 256  # characters of an origin (replica id) or a namespace


@dataclass(frozen=True)
class DocumentBatch:
    """``n`` documents: document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``, of namespace
    ``namespaces[i]``, indexed first by replica ``origins[i]`` as its document ``docs[i]``;
    ``seqs[i]`` is its number in the fleet's corpus (0 in a push: the actor numbers them)."""

    origins: tuple[str, ...]
    docs: np.ndarray  # int64 [n]
    namespaces: tuple[str, ...]
    offsets: np.ndarray  # int64 [n + 1], offsets[0] == 0
    tokens: np.ndarray  # int32 [offsets[-1]]
    seqs: np.ndarray  # int64 [n]

    @classmethod
    def empty(cls) -> "DocumentBatch":
        return cls((), np.zeros(0, np.int64), (), np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64))

    @classmethod
    def of(cls, origins: Sequence[str], docs: Sequence[int], namespaces: Sequence[str],
           token_lists: Sequence[Sequence[int]], seqs: Sequence[int] | None = None) -> "DocumentBatch":
        lengths = np.array([len(t) for t in token_lists], dtype=np.int64)
        offsets = np.zeros(len(token_lists) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        parts = [np.asarray(t, dtype=np.int32).reshape(-1) for t in token_lists]
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        seqs = np.zeros(len(token_lists), np.int64) if seqs is None else np.asarray(seqs, dtype=np.int64)
        return cls(tuple(origins), np.asarray(docs, dtype=np.int64).reshape(-1), tuple(namespaces), offsets,
                   tokens, seqs)

    @classmethod
    def from_shared(cls, origin: str, documents: Sequence[SharedDocument]) -> "DocumentBatch":
        """What a replica pushes: its finished documents (SuffixIndex.export_documents)."""
        # array('i') is 4-byte on every platform torch runs on: read its buffer as int32 directly
        return cls.of([origin] * len(documents), [d.doc for d in documents], [d.namespace for d in documents],
                      [np.frombuffer(d.tokens, dtype=np.int32) for d in documents])

    def __len__(self) -> int:
        return len(self.namespaces)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def tokens_of(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def select(self, rows: Sequence[int]) -> "DocumentBatch":
        """The documents ``rows``, in that order."""
        rows = [int(r) for r in rows]
        return DocumentBatch.of([self.origins[r] for r in rows], self.docs[rows], [self.namespaces[r] for r in rows],
                                [self.tokens_of(r) for r in rows], self.seqs[rows])

    def check(self, vocab_size: int, numbered: bool) -> None:
        """Raise ValueError (saying what is wrong) unless every column is consistent and every token id
        is below ``vocab_size``; ``numbered``: the corpus's own form, with ``seqs`` >= 1, strictly
        increasing, and each (origin, doc) once."""
        n = len(self.namespaces)
        arrays = {"docs": self.docs, "offsets": self.offsets, "tokens": self.tokens, "seqs": self.seqs}
        for name, a in arrays.items():
            if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype.kind not in "iu":
                raise ValueError(f"documents: {name} is not a 1-D integer array")
        if not isinstance(self.origins, tuple) or not isinstance(self.namespaces, tuple):
            raise ValueError("documents: origins and namespaces must be tuples of strings")
        if len(self.origins) != n or self.docs.size != n or self.seqs.size != n or self.offsets.size != n + 1:
            raise ValueError(f"documents: column lengths disagree ({n} namespaces, {len(self.origins)} origins, "
                             f"{self.docs.size} ids, {self.seqs.size} seqs, {self.offsets.size} offsets)")
        if self.offsets[0] != 0 or self.offsets[-1] != self.tokens.size or np.any(np.diff(self.offsets) < 0):
            raise ValueError("documents: offsets do not cut the token buffer into documents")
        if self.tokens.size and (self.tokens.min() < 0 or self.tokens.max() >= vocab_size):
            raise ValueError(f"documents: token ids outside the vocabulary [0, {vocab_size})")
        if n and self.docs.min() < 0:
            raise ValueError("documents: negative document ids")
        for what, names in (("origin", self.origins), ("namespace", self.namespaces)):
            if any(not isinstance(s, str) or not 0 < len(s) <= MAX_NAME for s in names):
                raise ValueError(f"documents: every {what} must be a string of 1 to {MAX_NAME} characters")
        if numbered:
            if n and (self.seqs[0] < 1 or np.any(np.diff(self.seqs) <= 0)):
                raise ValueError("documents: sequence numbers are not >= 1 and strictly increasing")
            if len(set(zip(self.origins, self.docs.tolist()))) != n:
                raise ValueError("documents: the same (origin, document id) twice")


class FleetCorpus:
    """Documents of the fleet within ``capacity`` tokens per namespace, each namespace's oldest evicted first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"fleet suffix corpus capacity must be >= 1 token, got {capacity}")
        self.capacity = capacity
        # (origin, doc) -> (seq, namespace, tokens), in seq order: the first is the next evicted
        self._docs: "OrderedDict[tuple[str, int], tuple[int, str, np.ndarray]]" = OrderedDict()
        self.num_tokens = 0
        self._namespace_tokens: dict[str, int] = {}
        self.last_seq = 0  # the number of the newest document ever added (never goes back)
        self.evicted_documents = 0

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, batch: DocumentBatch, origin: str) -> int:
        """Add the documents of a push from replica ``origin`` (its ids in ``batch.docs``; the
        batch's own origins are not trusted), numbered from ``last_seq + 1``; documents held
        already, empty ones and ones longer than ``capacity`` are skipped. Returns how many were added."""
        added = 0
        for i in range(len(batch)):
            key = (origin, int(batch.docs[i]))
            tokens = batch.tokens_of(i)
            if key in self._docs or not 0 < tokens.size <= self.capacity:
                continue
            self.last_seq += 1
            self._put(key, self.last_seq, batch.namespaces[i], tokens)
            added += 1
        return added

    @classmethod
    def restore(cls, batch: DocumentBatch, capacity: int) -> "FleetCorpus":
        """A corpus from its own checked form (a disk snapshot), numbers kept; past ``capacity``
        (a smaller setting than when it was written) the oldest documents are evicted."""
        corpus = cls(capacity)
        for i in range(len(batch)):
            tokens = batch.tokens_of(i)
            if 0 < tokens.size <= capacity:
                corpus._put((batch.origins[i], int(batch.docs[i])), int(batch.seqs[i]), batch.namespaces[i], tokens)
        corpus.last_seq = int(batch.seqs[-1]) if len(batch) else 0
        return corpus

    def _put(self, key: tuple[str, int], seq: int, namespace: str, tokens: np.ndarray) -> None:
        self._docs[key] = (seq, namespace, np.array(tokens, dtype=np.int32))  # owned: never a view of a push
        self.num_tokens += tokens.size
        self._namespace_tokens[namespace] = self._namespace_tokens.get(namespace, 0) + tokens.size
        if self._namespace_tokens[namespace] <= self.capacity:
            return
        for old_key, (_, old_namespace, old) in list(self._docs.items()):  # oldest first
            if old_namespace != namespace:
                continue
            del self._docs[old_key]
            self.num_tokens -= old.size
            self._namespace_tokens[namespace] -= old.size
            self.evicted_documents += 1
            if self._namespace_tokens[namespace] <= self.capacity:
                break

    def namespace_tokens(self, namespace: str) -> int:
        """Tokens held of ``namespace``'s documents (at most ``capacity``)."""
        return self._namespace_tokens.get(namespace, 0)

    def batch(self) -> DocumentBatch:
        """Every document held, oldest first, in the corpus's numbered form (a copy)."""
        keys = list(self._docs)
        values = list(self._docs.values())
        return DocumentBatch.of([k[0] for k in keys], [k[1] for k in keys], [v[1] for v in values],
                                [v[2] for v in values], [v[0] for v in values])

    def nbytes(self) -> int:
        """Bytes of the token arrays held (the keys and the dict add about 200 bytes a document)."""
        return sum(v[2].nbytes for v in self._docs.values())
