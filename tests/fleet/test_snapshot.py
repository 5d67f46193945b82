"""Matrix snapshots on disk (Arrow IPC): round trip, refusal of bad or foreign files, atomic writes."""

from __future__ import annotations

import logging
import os
import stat

import numpy as np
import pyarrow as pa
import pytest

from tr_serve.fleet import FleetSyncConfig
from tr_serve.fleet.config import model_key
from tr_serve.fleet.merge import EMPTY
from tr_serve.fleet.snapshot import (FORMAT, MAX_SNAPSHOT_BYTES, Identity, MatrixState, SnapshotRefused, load_newest,
                                     matrix_file_cap, read_snapshot, remove_stale_temp_files, snapshot_files,
                                     tokenizer_fingerprint, write_snapshot)

V, K = 50, 4
ID = Identity("model-a", V, K, "f" * 64, "default")


def some_state(seed: int = 0) -> MatrixState:
    rng = np.random.default_rng(seed)
    st = MatrixState.empty(V, K)
    rows = rng.choice(V, size=12, replace=False)
    st.cands[rows] = rng.integers(0, V, size=(12, K))
    st.cands[rows[0], 2:] = EMPTY  # a short row
    st.scores[rows] = rng.random((12, K)).astype(np.float32)
    st.scores[rows[0], 2:] = 0
    st.stamp[rows] = 1_700_000_000 + rng.random(12)
    return st


def test_round_trip(tmp_path):
    st = some_state()
    path = write_snapshot(tmp_path, st, ID, version=17, now=1234.5)
    back, meta = read_snapshot(path, ID)
    assert np.array_equal(back.cands, st.cands)
    assert np.allclose(back.scores, st.scores) and np.array_equal(back.stamp, st.stamp)
    assert meta.version == 17 and meta.created_at == 1234.5 and meta.rows == 12
    md = pa.ipc.open_file(pa.OSFile(str(path))).schema.metadata
    assert md[b"tr_serve.format"] == FORMAT.encode() and md[b"model_id"] == b"model-a"
    assert md[b"tokenizer_fingerprint"] == b"f" * 64 and md[b"vocab_size"] == b"50" and md[b"k"] == b"4"
    assert path.name.startswith("matrix-") and path.name.endswith("-v0000000017.arrow")


def test_write_goes_through_a_temp_file_then_rename(tmp_path, monkeypatch):
    calls = []
    real = os.replace

    def spy(src, dst):
        calls.append((str(src), str(dst)))
        assert os.path.exists(src) and not os.path.exists(dst)  # complete temp file, final name not yet there
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    path = write_snapshot(tmp_path, some_state(), ID, version=1)
    (src, dst), = calls
    assert dst == str(path) and os.path.dirname(src) == str(tmp_path) and os.path.basename(src).startswith(".")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_snapshot(tmp_path, some_state(), ID, version=1)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_files_are_removed(tmp_path):
    stale = tmp_path / ".matrix-00000000000000000001-v0000000001.arrow.tmp-123"
    stale.write_bytes(b"half a file")
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    remove_stale_temp_files(tmp_path)
    assert not stale.exists() and other.exists()


def test_keeps_the_newest_few(tmp_path):
    for v in range(1, 6):
        write_snapshot(tmp_path, some_state(v), ID, version=v, keep=3, now=1000.0 + v)
    files = snapshot_files(tmp_path)
    assert [read_snapshot(p, ID)[1].version for p in files] == [5, 4, 3]


def test_corrupt_file_is_refused_and_logged_then_the_next_one_loads(tmp_path, caplog):
    good = write_snapshot(tmp_path, some_state(1), ID, version=3, now=1000.0)
    bad = write_snapshot(tmp_path, some_state(2), ID, version=4, now=2000.0)
    bad.write_bytes(bad.read_bytes()[: len(bad.read_bytes()) // 2])  # truncated
    with pytest.raises(SnapshotRefused, match="unreadable"):
        read_snapshot(bad, ID)
    with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
        state, meta, path = load_newest(tmp_path, ID)
    assert path == good and meta.version == 3
    assert np.array_equal(state.cands, some_state(1).cands)
    refused = [r for r in caplog.records if "refusing matrix snapshot" in r.getMessage()]
    assert len(refused) == 1 and bad.name in refused[0].getMessage() and "unreadable" in refused[0].getMessage()


def test_garbage_file_never_crashes(tmp_path, caplog):
    (tmp_path / "matrix-00000000000000000009-v0000000009.arrow").write_bytes(b"\x00" * 100)
    with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
        assert load_newest(tmp_path, ID) is None  # nothing good: the actor starts empty
    assert any("unreadable" in r.getMessage() for r in caplog.records)
    assert load_newest(tmp_path / "missing", ID) is None


@pytest.mark.parametrize("other, reason", [
    (Identity("model-b", V, K, "f" * 64), "belongs to model 'model-b'"),
    (Identity("model-a", V, K, "e" * 64), "tokenizer fingerprint"),
    (Identity("model-a", V + 1, K, "f" * 64), "vocabulary size is 51"),
    (Identity("model-a", V, K + 1, "f" * 64), "its K is 5"),
])
def test_file_of_another_model_tokenizer_vocab_or_k_is_refused(tmp_path, caplog, other, reason):
    st = MatrixState.empty(other.vocab_size, other.k)
    st.cands[0, 0] = 1
    st.scores[0, 0] = 1.0
    foreign = write_snapshot(tmp_path, st, other, version=9, now=2000.0)
    mine = write_snapshot(tmp_path, some_state(), ID, version=2, now=1000.0)
    with pytest.raises(SnapshotRefused, match=reason):
        read_snapshot(foreign, ID)
    with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
        _, meta, path = load_newest(tmp_path, ID)
    assert path == mine and meta.version == 2
    assert any(foreign.name in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_out_of_range_contents_are_refused(tmp_path):
    st = some_state()
    st.cands[st.filled_rows()[0], 0] = V + 7
    path = write_snapshot(tmp_path, st, ID, version=1)
    with pytest.raises(SnapshotRefused, match="out of range"):
        read_snapshot(path, ID)


def test_tokenizer_fingerprint_is_stable_and_order_free():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

    a = tokenizer_fingerprint(Tok({"a": 0, "b": 1}))
    assert a == tokenizer_fingerprint(Tok({"b": 1, "a": 0})) and len(a) == 64
    assert a != tokenizer_fingerprint(Tok({"a": 1, "b": 0}))


def test_config_defaults_and_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "cache"))
    cfg = FleetSyncConfig()
    assert (cfg.enabled, cfg.sync_interval_s, cfg.snapshot_interval_s, cfg.keep_snapshots) == (False, 2.0, 60.0, 3)
    assert cfg.snapshot_root() == tmp_path / "cache" / "matrix"
    folder = FleetSyncConfig(namespace="tenant-1").snapshot_folder("/models/My Model.gguf")
    assert folder.parent.parent == tmp_path / "cache" / "matrix" and folder.name == "tenant-1"
    assert folder.parent.name.startswith("models_My_Model.gguf-") and "/" not in folder.parent.name
    assert model_key("a/b") != model_key("a_b")  # sanitized names stay distinct
    with pytest.raises(ValueError):
        FleetSyncConfig(namespace="../etc")
    with pytest.raises(ValueError):
        FleetSyncConfig(sync_interval_s=0)
    with pytest.raises(ValueError):
        FleetSyncConfig(unknown=1)


def test_files_are_0600_and_the_folders_made_for_them_0700(tmp_path):
    old = os.umask(0o022)  # a usual umask would leave 0644 files and 0755 folders
    try:
        folder = tmp_path / "root" / "model" / "default"
        path = write_snapshot(folder, some_state(), ID, version=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for made in (folder, folder.parent, folder.parent.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made


def test_an_oversized_file_is_refused_unread_and_the_next_one_loads(tmp_path, monkeypatch, caplog):
    good = write_snapshot(tmp_path, some_state(1), ID, version=3, now=1000.0)
    cap = matrix_file_cap(V, K)
    assert good.stat().st_size < cap <= MAX_SNAPSHOT_BYTES
    big = tmp_path / f"matrix-{int(2000 * 1e9):020d}-v0000000004.arrow"
    with open(big, "wb") as f:
        f.truncate(cap + 1)  # sparse: no disk used
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    with pytest.raises(SnapshotRefused, match=f"{cap + 1} bytes, over the {cap}"):
        read_snapshot(big, ID)
    assert str(big) not in opened  # refused on its size alone
    with caplog.at_level(logging.WARNING, logger="tr_serve.fleet"):
        state, meta, path = load_newest(tmp_path, ID)
    assert path == good and meta.version == 3
    assert any("refusing matrix snapshot" in r.getMessage() and big.name in r.getMessage() for r in caplog.records)


def test_the_matrix_cap_fits_a_full_matrix_and_stays_under_the_global_one(tmp_path):
    full = MatrixState.empty(V, K)
    full.cands[:] = 0
    full.scores[:] = 1.0
    path = write_snapshot(tmp_path, full, ID, version=1)
    assert path.stat().st_size < matrix_file_cap(V, K)
    assert read_snapshot(path, ID)[1].rows == V
    assert matrix_file_cap(10**9, 64) == MAX_SNAPSHOT_BYTES
