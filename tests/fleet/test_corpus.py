"""The fleet's suffix corpus: documents in columns (checked on arrival), held within a token bound,
numbered in arrival order, each (origin, document) once."""

from __future__ import annotations

import dataclasses
from array import array

import numpy as np
import pytest

from tr_serve.fleet.corpus import DocumentBatch, FleetCorpus
from tr_serve.tr.suffix_index import SharedDocument

V = 100


def push(docs: list[tuple[int, str, list[int]]]) -> DocumentBatch:
    """A replica's push: (its document id, namespace, tokens) each."""
    return DocumentBatch.from_shared("ignored", [SharedDocument(d, ns, array("i", t)) for d, ns, t in docs])


def contents(corpus: FleetCorpus) -> list[tuple[int, str, int, str, list[int]]]:
    b = corpus.batch()
    return [(int(b.seqs[i]), b.origins[i], int(b.docs[i]), b.namespaces[i], b.tokens_of(i).tolist())
            for i in range(len(b))]


def test_a_push_becomes_numbered_documents_of_its_origin():
    corpus = FleetCorpus(capacity=100)
    assert corpus.add(push([(3, "default", [1, 2, 3]), (4, "tenant-b", [4, 5])]), origin="A") == 2
    assert corpus.add(push([(3, "default", [7, 8])]), origin="B") == 1  # B's document 3 is another document
    assert contents(corpus) == [(1, "A", 3, "default", [1, 2, 3]), (2, "A", 4, "tenant-b", [4, 5]),
                                (3, "B", 3, "default", [7, 8])]
    assert corpus.last_seq == 3 and corpus.num_tokens == 7 and len(corpus) == 3
    corpus.batch().check(V, numbered=True)


def test_a_document_pushed_again_empty_or_too_long_is_not_added():
    corpus = FleetCorpus(capacity=5)
    assert corpus.add(push([(1, "default", [1, 2])]), origin="A") == 1
    assert corpus.add(push([(1, "default", [1, 2]), (2, "default", []), (3, "default", [1] * 6)]), origin="A") == 0
    assert corpus.last_seq == 1 and corpus.num_tokens == 2


def test_the_oldest_documents_are_evicted_past_the_capacity():
    corpus = FleetCorpus(capacity=10)
    for d in range(6):
        corpus.add(push([(d, "default", [d] * 3)]), origin="A")
        assert corpus.num_tokens <= 10
    assert [c[2] for c in contents(corpus)] == [3, 4, 5] and corpus.evicted_documents == 3
    assert corpus.last_seq == 6 and corpus.nbytes() == 9 * 4
    with pytest.raises(ValueError):
        FleetCorpus(capacity=0)


def test_one_tenants_documents_never_evict_another_tenants():
    corpus = FleetCorpus(capacity=10)
    corpus.add(push([(0, "tenant-b", [9] * 4)]), origin="A")
    for d in range(1, 8):  # tenant-a pushes 21 tokens: its own oldest go, tenant-b's stays
        corpus.add(push([(d, "tenant-a", [d] * 3)]), origin="A")
        assert corpus.namespace_tokens("tenant-a") <= 10
    assert [(c[2], c[3]) for c in contents(corpus)] == [(0, "tenant-b"), (5, "tenant-a"), (6, "tenant-a"),
                                                        (7, "tenant-a")]
    assert corpus.namespace_tokens("tenant-b") == 4 and corpus.num_tokens == 13 and corpus.evicted_documents == 4


def test_restore_keeps_the_numbers_and_trims_to_a_smaller_capacity():
    corpus = FleetCorpus(capacity=100)
    for d in range(4):
        corpus.add(push([(d, f"ns{d % 2}", [d + 1] * 4)]), origin="A")
    again = FleetCorpus.restore(corpus.batch(), capacity=100)
    assert contents(again) == contents(corpus) and again.last_seq == 4
    again.add(push([(9, "ns0", [9])]), origin="B")
    assert again.last_seq == 5  # numbering goes on after the restored documents
    small = FleetCorpus.restore(corpus.batch(), capacity=4)  # per namespace: each keeps its newest
    assert [c[0] for c in contents(small)] == [3, 4] and small.last_seq == 4


def test_check_refuses_inconsistent_or_out_of_vocabulary_batches():
    good = DocumentBatch.of(["A", "A"], [1, 2], ["default", "t"], [[1, 2], [3]], [1, 2])
    good.check(V, numbered=True)
    bad = {
        "tokens outside": dataclasses.replace(good, tokens=np.array([1, 2, V], np.int32)),
        "negative token": dataclasses.replace(good, tokens=np.array([1, -2, 3], np.int32)),
        "offsets": dataclasses.replace(good, offsets=np.array([0, 3, 2], np.int64)),
        "offsets end": dataclasses.replace(good, offsets=np.array([0, 1, 2], np.int64)),
        "lengths": dataclasses.replace(good, namespaces=("default",)),
        "empty namespace": dataclasses.replace(good, namespaces=("default", "")),
        "namespace type": dataclasses.replace(good, namespaces=("default", 5)),
        "list not tuple": dataclasses.replace(good, origins=["A", "A"]),
        "float tokens": dataclasses.replace(good, tokens=np.array([1.0, 2.0, 3.0])),
        "negative id": dataclasses.replace(good, docs=np.array([1, -2], np.int64)),
    }
    for what, batch in bad.items():
        with pytest.raises(ValueError):
            batch.check(V, numbered=False)
            pytest.fail(what)
    for what, batch in {"seq order": dataclasses.replace(good, seqs=np.array([2, 2], np.int64)),
                        "seq zero": dataclasses.replace(good, seqs=np.array([0, 1], np.int64)),
                        "key twice": dataclasses.replace(good, docs=np.array([1, 1], np.int64))}.items():
        batch.check(V, numbered=False)  # fine in a push: the actor numbers and dedups
        with pytest.raises(ValueError):
            batch.check(V, numbered=True)
            pytest.fail(what)


def test_select_and_empty():
    b = DocumentBatch.of(["A", "B", "C"], [1, 2, 3], ["x", "y", "z"], [[1], [2, 2], [3, 3, 3]], [1, 2, 3])
    s = b.select([2, 0])
    assert s.origins == ("C", "A") and s.tokens.tolist() == [3, 3, 3, 1] and s.seqs.tolist() == [3, 1]
    s.check(V, numbered=False)
    e = DocumentBatch.empty()
    e.check(V, numbered=True)
    assert len(e) == 0 and e.num_tokens == 0
