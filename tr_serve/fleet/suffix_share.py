"""Replica side of the fleet's suffix corpus (fleet/corpus.py): which of this replica's finished
documents the actor has, and which of the fleet's documents this replica has indexed.

``MatrixSync`` (fleet/sync.py) drives it in each of its rounds:

1. **Take**, between steps with the matrix's dirty rows: the documents the engine finished since
   the last push the actor confirmed (``SuffixIndex.export_documents`` from that cursor), copied.
   A failed push leaves the cursor where it was, so the next round takes them again; what waits
   is bounded by the index's own capacity (evicted documents are not exported).
2. **Push**, in the same call as the rows. The actor keys documents by (origin, id): one sent
   twice is held once. A confirmed push moves the cursor.
3. **Import**, when the corpus has documents newer than the last one imported: the corpus object
   is fetched off the token path, the documents of *other* replicas newer than that are picked
   (the newest that fit the index's capacity; never this replica's own, which it holds already)
   and indexed between steps, at most ``IMPORT_TOKENS_PER_STEP`` tokens between two steps.

A restarted actor (a new epoch; it may have reloaded an older disk snapshot) is sent every held
finished document again, and its corpus is imported from the start: documents held already are
skipped by key (``SuffixIndex.import_document``).
"""

from __future__ import annotations

from typing import Any

from tr_serve.fleet.corpus import DocumentBatch
from tr_serve.tr.suffix_index import SuffixIndex

# tokens indexed between two engine steps: about 4 ms at the 450 ns a token SuffixIndex.extend
# measured on one CPU core, a fraction of a step; a fresh replica fills a 2^18-token index in 32 steps
IMPORT_TOKENS_PER_STEP = 8192


class CorpusImport:
    """Documents to index into a replica's suffix index, a budget of tokens at a time (a document
    may span several calls: it drafts from what is indexed of it meanwhile, as a running request's)."""

    def __init__(self, batch: DocumentBatch):
        self.batch = batch
        self._next = 0  # the document being indexed
        self._pos = 0  # its tokens indexed so far
        self._doc: int | None = None
        self.documents = 0
        self.tokens = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self.batch)

    def drop(self) -> None:
        """Index nothing more (the engine has no suffix index any more)."""
        self._next = len(self.batch)

    def run(self, index: SuffixIndex, budget: int) -> int:
        """Index at most ``budget`` more tokens; returns how many were."""
        spent, b = 0, self.batch
        while self._next < len(b) and spent < budget:
            i = self._next
            if self._pos == 0:
                self._doc = index.import_document((b.origins[i], int(b.docs[i])), b.namespaces[i])
                if self._doc is None:  # held already
                    self._next += 1
                    continue
                self.documents += 1
            tokens = b.tokens_of(i)
            end = min(tokens.size, self._pos + budget - spent)
            index.extend(self._doc, tokens[self._pos : end].tolist())
            spent += end - self._pos
            self._pos = end
            if end == tokens.size:
                self._next, self._pos = self._next + 1, 0
        self.tokens += spent
        return spent


class SuffixShare:
    """One replica's bookkeeping; ``replica_id`` is its origin in the corpus."""

    def __init__(self, replica_id: str, vocab_size: int):
        self.replica_id = replica_id
        self.vocab_size = vocab_size
        self.capacity = 0  # the engine's suffix index capacity, seen at each take (0: it has none)
        self._confirmed = 0  # export cursor up to which the actor has this replica's documents
        self._taken: tuple[DocumentBatch, int] | None = None  # the documents of the push under way, and their cursor
        self.imported_seq = 0  # corpus documents up to this number are indexed (or were skipped), this epoch
        # figures
        self.documents_pushed = 0
        self.documents_shared = 0  # of those, the ones the actor added (not held already)
        self.documents_imported = 0
        self.tokens_imported = 0
        self.imports = 0

    @property
    def active(self) -> bool:
        """Whether the engine has a suffix index to share (known after the first take)."""
        return self.capacity > 0

    # ---- between steps (engine thread) ----------------------------------------------------------
    def take(self, engine) -> None:
        """The documents the engine finished since the confirmed cursor (``engine``: the stepped
        ``Engine``, whose ``suffix`` is its index or None)."""
        index: SuffixIndex | None = getattr(engine, "suffix", None)
        self.capacity = index.capacity if index is not None else 0
        self._taken = None
        if index is not None:
            docs, cursor = index.export_documents(self._confirmed)
            if docs:
                self._taken = (DocumentBatch.from_shared(self.replica_id, docs), cursor)

    # ---- event loop ---------------------------------------------------------------------------------
    def payload(self) -> DocumentBatch | None:
        """What the push carries (None: no finished document since the confirmed cursor)."""
        return self._taken[0] if self._taken is not None else None

    def pushed(self, reply: dict[str, Any] | None) -> None:
        """After the push: ``reply`` is the actor's, None when the push failed (the documents are
        taken again next round). Call before handling a change of epoch in that reply."""
        taken, self._taken = self._taken, None
        if reply is None or taken is None:
            return
        self._confirmed = taken[1]
        self.documents_pushed += len(taken[0])
        self.documents_shared += int(reply.get("documents_added", 0))
        if int(reply.get("corpus_seq_before", -1)) == self.imported_seq:
            self.imported_seq = int(reply["corpus_seq"])  # nothing but ours came in: no fetch needed

    def needs_import(self, corpus_seq: int) -> bool:
        return self.active and corpus_seq > self.imported_seq

    def plan(self, corpus: DocumentBatch) -> CorpusImport:
        """The documents of ``corpus`` (the actor's numbered form, checked here: ValueError) to index:
        other replicas', newer than the last imported, the newest that fit the index's capacity,
        oldest first (so that the newest are evicted last)."""
        corpus.check(self.vocab_size, numbered=True)
        chosen, room = [], self.capacity
        for i in range(len(corpus) - 1, -1, -1):
            if int(corpus.seqs[i]) <= self.imported_seq:
                break
            if corpus.origins[i] == self.replica_id:
                continue
            size = int(corpus.offsets[i + 1] - corpus.offsets[i])
            if size > room:
                break
            room -= size
            chosen.append(i)
        return CorpusImport(corpus.select(chosen[::-1]))

    def imported(self, job: CorpusImport, corpus_seq: int) -> None:
        """``job`` ran to its end: the corpus up to ``corpus_seq`` is this replica's."""
        self.imported_seq = corpus_seq
        self.documents_imported += job.documents
        self.tokens_imported += job.tokens
        self.imports += 1

    def restarted(self) -> None:
        """The actor restarted: send every held finished document again, import its corpus from the start."""
        self._confirmed = 0
        self.imported_seq = 0

    def stats(self) -> dict[str, Any]:
        return {"suffix_shared": self.active, "documents_pushed": self.documents_pushed,
                "documents_shared": self.documents_shared, "documents_imported": self.documents_imported,
                "tokens_imported": self.tokens_imported, "corpus_seq_imported": self.imported_seq}

