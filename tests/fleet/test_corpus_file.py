"""The fleet's suffix corpus on disk (Arrow IPC, beside the matrix's snapshots): round trip, and
refusal, with the reason, of bad or foreign files; the newest good file is the one loaded."""

from __future__ import annotations

import logging
import os
import stat

import numpy as np
import pyarrow as pa
import pytest

from tr_serve.fleet.corpus import DocumentBatch, FleetCorpus
from tr_serve.fleet.corpus_file import FORMAT, PREFIX, load_newest_corpus, read_corpus, write_corpus
from tr_serve.fleet.snapshot import MAX_SNAPSHOT_BYTES, Identity, SnapshotRefused, remove_stale_temp_files, snapshot_files

V = 50
ID = Identity("model-a", V, 4, "f" * 64, "fleet-1")


def some_corpus(n: int = 4, seed: int = 0) -> DocumentBatch:
    rng = np.random.default_rng(seed)
    corpus = FleetCorpus(capacity=1000)
    for d in range(n):
        corpus.add(DocumentBatch.of(["x"], [d], [f"tenant-{d % 2}"], [rng.integers(0, V, size=3 + d)]),
                   origin=f"replica-{d % 3}")
    return corpus.batch()


def same(a: DocumentBatch, b: DocumentBatch) -> bool:
    return (a.origins == b.origins and a.namespaces == b.namespaces and np.array_equal(a.docs, b.docs)
            and np.array_equal(a.offsets, b.offsets) and np.array_equal(a.tokens, b.tokens)
            and np.array_equal(a.seqs, b.seqs))


def test_round_trip_beside_the_matrix_files(tmp_path):
    batch = some_corpus()
    path = write_corpus(tmp_path, batch, ID, now=1234.5)
    assert path.name.startswith(PREFIX) and path.name.endswith(f"-s{int(batch.seqs[-1]):010d}.arrow")
    assert same(read_corpus(path, ID), batch)
    assert snapshot_files(tmp_path) == [] and snapshot_files(tmp_path, PREFIX) == [path]  # not a matrix file
    md = pa.ipc.open_file(pa.OSFile(str(path))).schema.metadata
    assert md[b"tr_serve.format"] == FORMAT.encode() and md[b"namespace"] == b"fleet-1"
    assert md[b"documents"] == b"4" and md[b"tokens"] == str(batch.num_tokens).encode()
    empty = write_corpus(tmp_path, DocumentBatch.empty(), ID, now=2000.0)
    assert len(read_corpus(empty, ID)) == 0


def test_keeps_the_newest_few_and_removes_stale_temp_files(tmp_path):
    for i in range(5):
        write_corpus(tmp_path, some_corpus(i + 1), ID, keep=2, now=1000.0 + i)
    files = snapshot_files(tmp_path, PREFIX)
    assert [len(read_corpus(p, ID)) for p in files] == [5, 4]
    stale = tmp_path / f".{PREFIX}00000000000000000001-s0000000001.arrow.tmp-123"
    stale.write_bytes(b"half")
    remove_stale_temp_files(tmp_path, ("matrix-", PREFIX))
    assert not stale.exists() and len(snapshot_files(tmp_path, PREFIX)) == 2


@pytest.mark.parametrize("other, reason", [
    (Identity("model-b", V, 4, "f" * 64, "fleet-1"), "belongs to model 'model-b'"),
    (Identity("model-a", V, 4, "f" * 64, "fleet-2"), "belongs to fleet namespace 'fleet-2'"),
    (Identity("model-a", V, 4, "e" * 64, "fleet-1"), "tokenizer fingerprint"),
    (Identity("model-a", V + 1, 4, "f" * 64, "fleet-1"), "vocabulary size is 51"),
])
def test_a_file_of_another_model_fleet_tokenizer_or_vocabulary_is_refused(tmp_path, caplog, other, reason):
    mine = write_corpus(tmp_path, some_corpus(2), ID, now=1000.0)
    foreign = write_corpus(tmp_path, some_corpus(3), other, now=2000.0)
    with pytest.raises(SnapshotRefused, match=reason):
        read_corpus(foreign, ID)
    with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
        batch, path = load_newest_corpus(tmp_path, ID)
    assert path == mine and len(batch) == 2
    assert any(foreign.name in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def write_table(tmp_path, columns: dict, meta: dict, name: str = "corpus-00000000000000000009-s0000000009.arrow"):
    table = pa.table(columns).replace_schema_metadata(meta)
    path = tmp_path / name
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def good_columns_and_meta(tmp_path):
    path = write_corpus(tmp_path / "src", some_corpus(3), ID)
    table = pa.ipc.open_file(pa.OSFile(str(path))).read_all()
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items()}
    return {name: table.column(name) for name in table.column_names}, meta


def bad_tokens(columns, values):
    offsets = np.asarray(columns["tokens"].combine_chunks().offsets)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32()))


@pytest.mark.parametrize("case, reason", [
    ("format", "format 'tr_serve.matrix/1'"),
    ("no metadata", "bad or missing metadata"),
    ("documents", "metadata says 4"),
    ("last seq", "metadata says 99"),
    ("token out of range", "outside the vocabulary"),
    ("token type", "not large_list<int32>"),
    ("missing column", "bad columns"),
    ("repeated document", "the same (origin, document id) twice"),
    ("seq order", "strictly increasing"),
    ("null namespace", "nulls"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path, case, reason):
    columns, meta = good_columns_and_meta(tmp_path)
    tokens = np.asarray(columns["tokens"].combine_chunks().flatten())
    if case == "format":
        meta["tr_serve.format"] = "tr_serve.matrix/1"
    elif case == "no metadata":
        del meta["last_seq"]
    elif case == "documents":
        meta["documents"] = "4"
    elif case == "last seq":
        meta["last_seq"] = "99"
    elif case == "token out of range":
        columns["tokens"] = bad_tokens(columns, np.where(np.arange(tokens.size) == 2, V, tokens))
    elif case == "token type":
        columns["tokens"] = pa.array([[1], [2], [3]], type=pa.list_(pa.int64()))
    elif case == "missing column":
        del columns["origin"]
    elif case == "repeated document":
        columns["origin"] = pa.array(["r", "r", "r"])
        columns["doc"] = pa.array([1, 1, 2], type=pa.int64())
    elif case == "seq order":
        columns["seq"] = pa.array([1, 3, 2], type=pa.int64())
    elif case == "null namespace":
        columns["namespace"] = pa.array(["a", None, "b"], type=pa.string())
    path = write_table(tmp_path, columns, meta)
    with pytest.raises(SnapshotRefused, match=reason.replace("(", r"\(").replace(")", r"\)")):
        read_corpus(path, ID)


def test_truncated_or_garbage_files_never_crash_and_the_next_one_loads(tmp_path, caplog):
    good = write_corpus(tmp_path, some_corpus(2), ID, now=1000.0)
    bad = write_corpus(tmp_path, some_corpus(3), ID, now=2000.0)
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])
    (tmp_path / f"{PREFIX}00000000000000000003-s0000000001.arrow").write_bytes(b"\x00" * 64)  # the oldest name
    with pytest.raises(SnapshotRefused, match="unreadable"):
        read_corpus(bad, ID)
    with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
        batch, path = load_newest_corpus(tmp_path, ID)
    assert path == good and len(batch) == 2
    assert any("refusing suffix corpus snapshot" in r.getMessage() and bad.name in r.getMessage()
               for r in caplog.records)
    assert load_newest_corpus(tmp_path / "missing", ID) is None


def test_files_are_0600_and_the_folders_made_for_them_0700(tmp_path):
    old = os.umask(0o022)
    try:
        folder = tmp_path / "root" / "fleet-1"
        path = write_corpus(folder, some_corpus(), ID)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


def test_an_oversized_file_is_refused_unread_and_the_next_one_loads(tmp_path, caplog):
    good = write_corpus(tmp_path, some_corpus(2), ID, now=1000.0)
    big = tmp_path / f"{PREFIX}{int(2000 * 1e9):020d}-s0000000009.arrow"
    with open(big, "wb") as f:
        f.truncate(MAX_SNAPSHOT_BYTES + 1)  # sparse: no disk used, and reading it would take 1 GiB
    with pytest.raises(SnapshotRefused, match=f"{MAX_SNAPSHOT_BYTES + 1} bytes, over the {MAX_SNAPSHOT_BYTES}"):
        read_corpus(big, ID)
    size = good.stat().st_size
    with pytest.raises(SnapshotRefused, match="not read"):
        read_corpus(good, ID, max_bytes=size - 1)
    assert len(read_corpus(good, ID, max_bytes=size)) == 2
    with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
        batch, path = load_newest_corpus(tmp_path, ID)
    assert path == good and len(batch) == 2
    assert any("refusing suffix corpus snapshot" in r.getMessage() and big.name in r.getMessage()
               for r in caplog.records)
