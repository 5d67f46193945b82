"""The cross-request suffix index: longest-suffix match over other requests' text, votes per depth,
namespaces kept apart, memory bounded by evicting the oldest documents."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tr_serve.tr.suffix_index import SuffixDraft, SuffixIndex


def feed(index: SuffixIndex, tokens: list[int], namespace: str = "default") -> int:
    doc = index.open(namespace)
    index.extend(doc, tokens)
    return doc


def brute_force(docs: dict[int, list[int]], text: list[int], exclude: int, min_match: int, max_match: int,
                max_tokens: int) -> SuffixDraft | None:
    """What the index must return, by scanning every position of every other document: the
    occurrences of the longest suffix of ``text`` (min_match..max_match tokens) that have a next
    token, then the majority continuation depth by depth (ties: the most recent occurrence)."""
    occurrences = []  # (match length, (doc, position) for recency, doc tokens, position of the next token)
    for doc, toks in docs.items():  # creation order
        if doc == exclude:
            continue
        for pos in range(min_match, len(toks)):
            length = 0
            while length < min(max_match, pos, len(text)) and toks[pos - 1 - length] == text[-1 - length]:
                length += 1
            if length >= min_match:
                occurrences.append((length, (doc, pos), toks, pos))
    if not occurrences:
        return None
    best = max(o[0] for o in occurrences)
    # most recent first: a later document, or later in the same document (the index appends in this order)
    alive = [(t, p) for _, _, t, p in sorted((o for o in occurrences if o[0] == best), key=lambda o: o[1], reverse=True)]
    tokens, support, counts = [], [], []
    for _ in range(max_tokens):
        votes = Counter(t[p] for t, p in alive if p < len(t))
        if not votes:
            break
        top = max(votes.values())
        tok = next(t[p] for t, p in alive if p < len(t) and votes[t[p]] == top)
        tokens.append(tok)
        support.append(sum(votes.values()))
        counts.append(top)
        alive = [(t, p + 1) for t, p in alive if p < len(t) and t[p] == tok]
    return SuffixDraft(best, tokens, support, counts)


def test_drafts_the_majority_continuation_of_the_longest_match_with_its_votes():
    index = SuffixIndex(capacity=1000)
    feed(index, [1, 2, 3, 4, 5, 6, 7, 8])
    feed(index, [9, 2, 3, 4, 5, 6, 7, 9])
    feed(index, [4, 4, 4, 5, 6, 1])  # "4 5 6" continues with 1 here: a 3-token match only
    mine = feed(index, [0, 0, 2, 3, 4, 5, 6])
    draft = index.lookup(mine, 4)
    # "2 3 4 5 6" (5 tokens) occurs in the first two documents, not in the third; both went on
    # with 7, then 8 (first document) or 9 (second): one vote each, the most recent wins; the
    # second document ends there
    assert draft == SuffixDraft(5, [7, 9], [2, 2], [2, 1])
    assert draft.confidence(0) == 1.0 and draft.confidence(1) == 0.5


def test_a_requests_own_text_never_drafts_for_it():
    index = SuffixIndex(capacity=1000)
    mine = feed(index, [1, 2, 3, 4, 1, 2, 3])
    assert index.lookup(mine, 4) is None  # "1 2 3 -> 4" is its own text: the context index's
    other = feed(index, [1, 2, 3, 9])
    assert index.lookup(mine, 4).tokens == [9]
    assert index.lookup_text([1, 2, 3], "default", 4, exclude=other).tokens == [4, 1, 2, 3]


def test_one_namespaces_text_never_drafts_for_another():
    index = SuffixIndex(capacity=1000)
    feed(index, [5, 6, 7, 8, 9, 10], namespace="tenant-a")
    b = feed(index, [1, 5, 6, 7], namespace="tenant-b")
    assert index.lookup(b, 4) is None
    a = feed(index, [1, 5, 6, 7], namespace="tenant-a")
    assert index.lookup(a, 4).tokens == [8, 9, 10]
    feed(index, [5, 6, 7, 20], namespace="tenant-b")
    assert index.lookup(b, 4).tokens == [20]
    assert index.lookup(a, 4).tokens == [8, 9, 10]


def test_running_documents_draft_as_they_grow():
    index = SuffixIndex(capacity=1000)
    running = feed(index, [1, 2, 3])
    mine = feed(index, [7, 1, 2, 3])
    assert index.lookup(mine, 4) is None  # nothing followed "1 2 3" yet
    index.extend(running, [4])
    assert index.lookup(mine, 4).tokens == [4]
    index.extend(running, [5, 6])
    assert index.lookup(mine, 4).tokens == [4, 5, 6]


def test_lookups_equal_a_scan_of_every_other_document():
    rng = random.Random(7)
    for trial in range(40):
        vocab = rng.choice([3, 5, 8])
        index = SuffixIndex(capacity=10_000, min_match=3, max_match=6, max_occurrences=10_000)
        docs: dict[int, list[int]] = {}
        for _ in range(rng.randint(1, 6)):
            toks = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
            doc = index.open()
            for i in range(0, len(toks), 5):  # fed piece by piece, as the engine does
                index.extend(doc, toks[i : i + 5])
            docs[doc] = toks
        mine = index.open()
        text = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        index.extend(mine, text)
        docs[mine] = text
        want = brute_force(docs, text, mine, 3, 6, 5)
        assert index.lookup(mine, 5) == want, (trial, docs, text)


def test_memory_is_bounded_by_evicting_the_oldest_documents():
    rng = random.Random(3)
    index = SuffixIndex(capacity=2000)
    first = feed(index, [rng.randrange(500) for _ in range(300)])
    docs = [first]
    while index.num_tokens + 300 <= 2000:
        docs.append(feed(index, [rng.randrange(500) for _ in range(300)]))
    at_limit = index.nbytes()
    sizes = []
    for _ in range(60):  # 9x the capacity more
        docs.append(feed(index, [rng.randrange(500) for _ in range(300)]))
        assert index.num_tokens <= 2000
        assert index.num_grams() <= index.num_occurrences() <= index.num_tokens
        sizes.append(index.nbytes())
    assert first not in index and docs[-1] in index
    assert index.evicted_documents == len(docs) - index.num_documents()
    assert [d for d in docs if d in index] == docs[-index.num_documents():]  # the newest kept, the oldest gone
    # the bytes settle: a dict keeps room for the keys it lost (at most a doubling of its table)
    assert max(sizes) < 2 * at_limit and max(sizes[30:]) <= 1.01 * max(sizes[:30])


def test_one_namespaces_text_never_evicts_another_namespaces():
    index = SuffixIndex(capacity=10)
    theirs = feed(index, [1, 2, 3, 4, 5, 6], namespace="tenant-b")
    mine = feed(index, [1, 2, 3], namespace="tenant-b")
    for _ in range(5):  # tenant-a's 20 tokens: its own oldest documents go, never tenant-b's
        feed(index, [7, 8, 9, 10], namespace="tenant-a")
        assert index.namespace_tokens("tenant-a") <= 10
    assert theirs in index and index.namespace_tokens("tenant-b") == 9
    assert index.lookup(mine, 3).tokens == [4, 5, 6]
    assert index.num_tokens == 9 + 8 and index.evicted_documents == 3
    feed(index, [1, 2], namespace="tenant-b")  # 11 of tenant-b: its oldest goes
    assert theirs not in index and index.namespace_tokens("tenant-b") == 5 and index.namespace_tokens("tenant-a") == 8


def test_evicted_text_never_drafts_and_an_evicted_running_document_stops_growing():
    index = SuffixIndex(capacity=10)
    running = feed(index, [1, 2, 3, 4, 5, 6])
    mine = feed(index, [1, 2, 3])
    assert index.lookup(mine, 3).tokens == [4, 5, 6]
    feed(index, [9, 9, 9, 9])  # 13 tokens: the oldest document goes
    assert running not in index and index.num_tokens == 7
    assert index.lookup(mine, 3) is None
    index.extend(running, [7, 8])  # a no-op
    assert index.num_tokens == 7 and index.document_length(running) == 0
    assert index.lookup(running, 3) is None


def test_a_lookup_reads_the_newest_occurrences_of_other_documents_only():
    index = SuffixIndex(capacity=1000, max_occurrences=2)
    for nxt in (10, 11, 12):
        feed(index, [1, 2, 3, nxt])
    mine = feed(index, [1, 2, 3])
    draft = index.lookup(mine, 1)
    assert draft.support == [2] and draft.tokens == [12]  # 10 is older than the two newest, which vote
    index.extend(mine, [7, 1, 2, 3, 7, 1, 2, 3])  # its own occurrences are newer still: skipped, not counted
    assert index.lookup(mine, 1) == SuffixDraft(3, [12], [2], [1])


def test_bad_settings_and_tokens_are_refused():
    with pytest.raises(ValueError):
        SuffixIndex(capacity=0)
    with pytest.raises(ValueError):
        SuffixIndex(min_match=0)
    index = SuffixIndex(capacity=100)
    doc = index.open()
    with pytest.raises(ValueError):
        index.extend(doc, [1, -1])
    with pytest.raises(ValueError):
        index.extend(doc, [1 << 20])
    assert index.num_tokens == 0 and index.document_length(doc) == 0


# ---- sharing with the fleet: finished documents out, other replicas' documents in -----------------

def test_finished_documents_are_exported_once_in_finish_order_as_copies():
    index = SuffixIndex(capacity=1000)
    a, b, running = feed(index, [1, 2, 3, 4]), feed(index, [5, 6, 7], namespace="tenant-b"), feed(index, [8, 9])
    assert index.export_documents(0) == ([], 0)  # nothing finished yet
    index.finish(b)
    index.finish(a)
    index.finish(a)  # twice: still once
    docs, cursor = index.export_documents(0)
    assert [(d.doc, d.namespace, d.tokens.tolist()) for d in docs] == [(b, "tenant-b", [5, 6, 7]), (a, "default", [1, 2, 3, 4])]
    docs[0].tokens[0] = 99  # a copy: the index's text is untouched
    assert index.lookup_text([5, 6, 7], "tenant-b", 1) is None and index.document_length(b) == 3
    assert index.export_documents(cursor) == ([], cursor)
    index.finish(running)
    docs, later = index.export_documents(cursor)
    assert [d.doc for d in docs] == [running] and later > cursor
    assert [d.doc for d in index.export_documents(0)[0]] == [b, a, running]  # from the start again (a restarted actor)


def test_imported_documents_draft_within_their_namespace_are_held_once_and_never_exported():
    index = SuffixIndex(capacity=1000)
    doc = index.import_document(("replica-a", 7), "tenant-a")
    index.extend(doc, [1, 2, 3, 4, 5])
    index.finish(doc)  # not this replica's: never exported
    assert index.export_documents(0) == ([], 0)
    assert index.import_document(("replica-a", 7), "tenant-a") is None and index.holds(("replica-a", 7))
    assert index.lookup_text([9, 1, 2, 3], "tenant-a", 2).tokens == [4, 5]
    assert index.lookup_text([9, 1, 2, 3], "tenant-b", 2) is None
    other = index.import_document(("replica-b", 7), "tenant-a")  # the same id elsewhere: another document
    assert other is not None and other != doc


def test_eviction_forgets_exports_and_imported_keys():
    index = SuffixIndex(capacity=10)
    mine = feed(index, [1, 2, 3, 4, 5, 6])
    index.finish(mine)
    theirs = index.import_document(("replica-a", 1), "default")
    index.extend(theirs, [7, 8, 9, 10, 11])  # 11 tokens: the oldest (mine) goes
    assert mine not in index and index.export_documents(0) == ([], 1)
    feed(index, [12] * 6)  # and now the imported one
    assert not index.holds(("replica-a", 1))
    again = index.import_document(("replica-a", 1), "default")  # evicted text may come back
    assert again is not None and index.holds(("replica-a", 1))
