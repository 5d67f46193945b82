"""Matrix snapshots on disk: one Arrow IPC file per snapshot.

File ``matrix-<created ns>-v<version>.arrow`` holds the filled rows only::

    row         int32                       token id of the row
    candidates  fixed_size_list<int32>[K]   best first, -1 = none
    scores      fixed_size_list<float32>[K] the merge scores (tr_serve.fleet.merge)
    stamp       float64                     time the scores refer to (unix seconds)

and schema metadata ``tr_serve.format``, ``model_id``, ``namespace``, ``vocab_size``, ``k``,
``tokenizer_fingerprint``, ``version``, ``created_at``, ``rows``.

Writes go to a hidden temporary file in the same folder, fsynced, then ``os.replace``-d into
place, so a reader sees a whole file or none. Files are created 0600, and the folders this module
creates 0700 (whatever the umask): the files hold what tenants' requests taught the fleet. Reading
refuses (with the reason) a file larger than its cap (checked with ``os.stat``, before a byte is
read: :func:`matrix_file_cap`, :data:`MAX_SNAPSHOT_BYTES`), unreadable, of another format, model,
tokenizer, vocabulary size or K, or whose contents are out of range; :func:`load_newest` logs that
and tries the next file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from tr_serve.fleet.merge import EMPTY

T = TypeVar("T")

logger = logging.getLogger("tr_serve.fleet")

FORMAT = "tr_serve.matrix/1"
PREFIX = "matrix-"  # snapshot file names: the matrix's; fleet/corpus_file.py has its own
_SUFFIX = ".arrow"
_TMP_MARK = ".tmp-"
FILE_MODE = 0o600  # snapshot files: owner only
DIR_MODE = 0o700  # folders created for them: owner only
# No snapshot file is read past this size, whatever it claims to hold (the corpus's files are held to
# it; a matrix file to the tighter matrix_file_cap of its vocabulary and K).
MAX_SNAPSHOT_BYTES = 1 << 30
# A matrix file's bytes per row (row id, K candidates, K scores, stamp) are 4 + 8 K + 8; the cap
# allows twice that for every row of the vocabulary, plus the Arrow framing and metadata.
_MATRIX_FILE_SLACK = 1 << 20


class SnapshotRefused(Exception):
    """A snapshot file that must not be loaded; ``str(e)`` says why."""


@dataclass(frozen=True)
class Identity:
    """What a snapshot must match to be loaded."""

    model_id: str
    vocab_size: int
    k: int
    tokenizer_fingerprint: str
    namespace: str = "default"


@dataclass(frozen=True)
class SnapshotMeta:
    identity: Identity
    version: int
    created_at: float
    rows: int


@dataclass
class MatrixState:
    """The actor's whole state: candidates [V, K] int32, scores [V, K] float32, stamp [V] float64."""

    cands: np.ndarray
    scores: np.ndarray
    stamp: np.ndarray

    @classmethod
    def empty(cls, vocab_size: int, k: int) -> "MatrixState":
        return cls(np.full((vocab_size, k), EMPTY, dtype=np.int32), np.zeros((vocab_size, k), dtype=np.float32),
                   np.zeros(vocab_size, dtype=np.float64))

    def filled_rows(self) -> np.ndarray:
        return np.flatnonzero(self.cands[:, 0] != EMPTY)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's sorted ``(token, id)`` vocabulary items."""
    items = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()


def matrix_file_cap(vocab_size: int, k: int) -> int:
    """The largest matrix snapshot file read for a ``vocab_size`` x ``k`` matrix: twice the bytes
    of a file with every row filled, plus 1 MiB (never above :data:`MAX_SNAPSHOT_BYTES`)."""
    return min(MAX_SNAPSHOT_BYTES, 2 * vocab_size * (4 + 8 * k + 8) + _MATRIX_FILE_SLACK)


def private_folder(folder: Path) -> Path:
    """``folder``, created if absent with any missing folder above it, each of them 0700 whatever the
    umask. A folder that exists already keeps its mode."""
    folder = Path(os.path.abspath(folder))
    for part in [*reversed(folder.parents), folder]:
        try:
            part.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(part, DIR_MODE)
    return folder


def snapshot_files(folder: Path, prefix: str = PREFIX) -> list[Path]:
    """Snapshot files of a folder (``prefix``: the matrix's, or the suffix corpus's), newest first
    (names sort by creation time)."""
    try:
        names = [p for p in Path(folder).iterdir()
                 if p.name.startswith(prefix) and p.name.endswith(_SUFFIX) and p.is_file()]
    except FileNotFoundError:
        return []
    return sorted(names, key=lambda p: p.name, reverse=True)


def write_snapshot(folder: Path, state: MatrixState, identity: Identity, version: int, keep: int = 3,
                   now: float | None = None) -> Path:
    """Write the filled rows of ``state`` as a new snapshot (temp file + rename), then keep only the
    ``keep`` newest snapshot files. Returns the new file."""
    import pyarrow as pa

    folder = private_folder(folder)
    created = time.time() if now is None else now
    vocab, k = state.cands.shape
    if (vocab, k) != (identity.vocab_size, identity.k):
        raise ValueError(f"state is [{vocab}, {k}] but the identity says [{identity.vocab_size}, {identity.k}]")
    rows = state.filled_rows()
    meta = {
        "tr_serve.format": FORMAT,
        "model_id": identity.model_id,
        "namespace": identity.namespace,
        "vocab_size": str(identity.vocab_size),
        "k": str(identity.k),
        "tokenizer_fingerprint": identity.tokenizer_fingerprint,
        "version": str(int(version)),
        "created_at": repr(float(created)),
        "rows": str(int(rows.size)),
    }
    cands = state.cands[rows].astype(np.int32, copy=False).reshape(-1)
    scores = state.scores[rows].astype(np.float32, copy=False).reshape(-1)
    table = pa.table({
        "row": pa.array(rows.astype(np.int32)),
        "candidates": pa.FixedSizeListArray.from_arrays(pa.array(cands, type=pa.int32()), k),
        "scores": pa.FixedSizeListArray.from_arrays(pa.array(scores, type=pa.float32()), k),
        "stamp": pa.array(state.stamp[rows].astype(np.float64)),
    }).replace_schema_metadata(meta)
    final = write_table_atomically(folder, f"{PREFIX}{int(created * 1e9):020d}-v{int(version):010d}{_SUFFIX}", table)
    prune(folder, keep)
    return final


def write_table_atomically(folder: Path, name: str, table) -> Path:
    """Write an Arrow table as the IPC file ``folder/name``: a hidden temporary file created 0600,
    fsynced, then renamed, so that a reader sees a whole file or none."""
    import pyarrow as pa

    final = folder / name
    tmp = folder / f".{name}{_TMP_MARK}{os.getpid()}"
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue()
    try:
        tmp.unlink()  # left by a write of this process that died; the name is this process's own
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    try:
        try:
            os.fchmod(fd, FILE_MODE)  # exactly 0600, whatever the umask
            with memoryview(data) as view:
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(folder)
    return final


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prune(folder: Path, keep: int, prefix: str = PREFIX) -> list[Path]:
    """Delete all but the ``keep`` newest snapshot files of ``prefix``; returns the deleted ones."""
    removed = []
    for p in snapshot_files(folder, prefix)[max(keep, 1):]:
        try:
            p.unlink()
            removed.append(p)
        except OSError as e:
            logger.warning("could not delete old matrix snapshot %s: %s", p, e)
    return removed


def remove_stale_temp_files(folder: Path, prefixes: tuple[str, ...] = (PREFIX,)) -> None:
    """Temporary files left by a writer that died mid-write (only the one actor writes here)."""
    try:
        for p in Path(folder).iterdir():
            if p.name.startswith(tuple("." + prefix for prefix in prefixes)) and _TMP_MARK in p.name:
                try:
                    p.unlink()
                except OSError:
                    pass
    except FileNotFoundError:
        pass


def open_checked(path: Path, expect: Identity, file_format: str, fleet_namespace: bool = False,
                 max_bytes: int = MAX_SNAPSHOT_BYTES):
    """(table, metadata) of one Arrow IPC snapshot file of ``file_format`` made for ``expect``'s
    model, tokenizer and vocabulary (and, with ``fleet_namespace``, its fleet namespace); raises
    :class:`SnapshotRefused` with the reason. A file larger than ``max_bytes`` (and
    :data:`MAX_SNAPSHOT_BYTES`) is refused unread. The caller checks its own fields and columns."""
    import pyarrow as pa

    limit = min(max_bytes, MAX_SNAPSHOT_BYTES)
    try:
        st = os.stat(path)
    except OSError as e:
        raise SnapshotRefused(f"cannot stat it ({type(e).__name__}: {e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SnapshotRefused("not a regular file")
    if st.st_size > limit:
        raise SnapshotRefused(f"it is {st.st_size} bytes, over the {limit} a snapshot may have: not read")
    try:
        with open(path, "rb") as f:  # owned bytes: nothing refers to the file afterwards
            data = f.read(limit + 1)
        if len(data) > limit:  # grew after the stat
            raise SnapshotRefused(f"it is over the {limit} bytes a snapshot may have: not read")
        reader = pa.ipc.open_file(pa.BufferReader(data))
        schema = reader.schema
        table = reader.read_all()
    except (OSError, pa.ArrowException, ValueError) as e:
        raise SnapshotRefused(f"unreadable Arrow IPC file ({type(e).__name__}: {e})") from None
    meta = {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in (schema.metadata or {}).items()}
    fmt = meta.get("tr_serve.format")
    if fmt != file_format:
        raise SnapshotRefused(f"format {fmt!r} is not {file_format!r}")
    try:
        vocab, model_id, fingerprint = int(meta["vocab_size"]), meta["model_id"], meta["tokenizer_fingerprint"]
        namespace = meta["namespace"] if fleet_namespace else expect.namespace
    except (KeyError, ValueError) as e:
        raise SnapshotRefused(f"bad or missing metadata ({type(e).__name__}: {e})") from None
    if model_id != expect.model_id:
        raise SnapshotRefused(f"it belongs to model {model_id!r}, not {expect.model_id!r}")
    if namespace != expect.namespace:
        raise SnapshotRefused(f"it belongs to fleet namespace {namespace!r}, not {expect.namespace!r}")
    if fingerprint != expect.tokenizer_fingerprint:
        raise SnapshotRefused(f"its tokenizer fingerprint {fingerprint[:12]}... differs from this model's "
                              f"{expect.tokenizer_fingerprint[:12]}...")
    if vocab != expect.vocab_size:
        raise SnapshotRefused(f"its vocabulary size is {vocab}, not {expect.vocab_size}")
    return table, meta


def newest_accepted(folder: Path, prefix: str, read: Callable[[Path], T], what: str) -> tuple[T, Path] | None:
    """The newest file of ``prefix`` in ``folder`` that ``read`` accepts, with its path; a refused
    file is logged (why) and skipped, and nothing a file holds crashes the caller. None: none."""
    for path in snapshot_files(folder, prefix):
        try:
            return read(path), path
        except SnapshotRefused as e:
            logger.warning("refusing %s snapshot %s: %s; trying the next one", what, path, e)
        except Exception as e:  # never crash on a file
            logger.warning("refusing %s snapshot %s: unexpected %s: %s; trying the next one", what, path,
                           type(e).__name__, e)
    return None


def read_snapshot(path: Path, expect: Identity) -> tuple[MatrixState, SnapshotMeta]:
    """Load one snapshot for ``expect``; raises :class:`SnapshotRefused` with the reason."""
    import pyarrow as pa

    table, meta = open_checked(path, expect, FORMAT, max_bytes=matrix_file_cap(expect.vocab_size, expect.k))
    vocab = expect.vocab_size
    try:
        k, version = int(meta["k"]), int(meta["version"])
        created, nrows = float(meta["created_at"]), int(meta["rows"])
    except (KeyError, ValueError) as e:
        raise SnapshotRefused(f"bad or missing metadata ({type(e).__name__}: {e})") from None
    if k != expect.k:
        raise SnapshotRefused(f"its K is {k}, not {expect.k}")
    try:
        rows = np.asarray(table.column("row").to_numpy(), dtype=np.int64)
        cands = _fixed_list(table, "candidates", k).astype(np.int32)
        scores = _fixed_list(table, "scores", k).astype(np.float32)
        stamp = np.asarray(table.column("stamp").to_numpy(), dtype=np.float64)
    except (KeyError, ValueError, TypeError, pa.ArrowException) as e:
        raise SnapshotRefused(f"bad columns ({type(e).__name__}: {e})") from None
    n = rows.size
    if n != nrows or cands.shape != (n, k) or scores.shape != (n, k) or stamp.shape != (n,):
        raise SnapshotRefused(f"column lengths do not match the {nrows} rows of its metadata")
    if n and (rows.min() < 0 or rows.max() >= vocab or np.unique(rows).size != n):
        raise SnapshotRefused("row ids out of range or repeated")
    if n and (cands.min() < EMPTY or cands.max() >= vocab):
        raise SnapshotRefused("candidate token ids out of range")
    if not (np.isfinite(scores).all() and np.isfinite(stamp).all()) or (n and scores.min() < 0):
        raise SnapshotRefused("scores or stamps are not finite non-negative numbers")
    state = MatrixState.empty(vocab, k)
    state.cands[rows], state.scores[rows], state.stamp[rows] = cands, scores, stamp
    return state, SnapshotMeta(expect, version, created, n)


def _fixed_list(table, name: str, k: int) -> np.ndarray:
    import pyarrow as pa

    col = table.column(name).combine_chunks()
    if not pa.types.is_fixed_size_list(col.type) or col.type.list_size != k:
        raise ValueError(f"column {name!r} is {col.type}, not fixed_size_list[{k}]")
    if col.null_count:
        raise ValueError(f"column {name!r} has nulls")
    flat = col.flatten().to_numpy(zero_copy_only=False)
    return np.asarray(flat).reshape(len(col), k)


def load_newest(folder: Path, expect: Identity) -> tuple[MatrixState, SnapshotMeta, Path] | None:
    """The newest snapshot of ``folder`` that :func:`read_snapshot` accepts (refused files logged
    and skipped). ``None`` when there is none: start empty."""
    found = newest_accepted(folder, PREFIX, lambda path: read_snapshot(path, expect), "matrix")
    if found is None:
        return None
    (state, meta), path = found
    logger.info("loaded matrix snapshot %s (version %d, %d rows)", path, meta.version, meta.rows)
    return state, meta, path
