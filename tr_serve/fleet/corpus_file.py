"""The fleet's suffix corpus on disk: one Arrow IPC file per snapshot, beside the matrix's.

File ``corpus-<created ns>-s<last seq>.arrow`` holds every document of the corpus, oldest first::

    seq        int64               its number in the corpus (strictly increasing)
    origin     string              the replica that indexed it
    doc        int64               its document id there
    namespace  string              the tenant it drafts for
    tokens     large_list<int32>   prompt and output token ids

and schema metadata ``tr_serve.format``, ``model_id``, ``namespace`` (the fleet's), ``vocab_size``,
``tokenizer_fingerprint``, ``last_seq``, ``created_at``, ``documents``, ``tokens``.

Written as the matrix's are (fleet/snapshot.py: temp file created 0600, fsync, rename, in folders
created 0700; the ``keep`` newest kept). Reading refuses (with the reason, :class:`SnapshotRefused`)
a file larger than ``max_bytes`` (default :data:`MAX_SNAPSHOT_BYTES`) without reading it, or one
that is unreadable, of another format, model, tokenizer, vocabulary or fleet namespace (tenants'
text never crosses fleets), or whose columns disagree with each other or with its metadata, or hold token ids outside
the vocabulary; :func:`load_newest_corpus` logs that and tries the next file.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from tr_serve.fleet.corpus import DocumentBatch
from tr_serve.fleet.snapshot import (MAX_SNAPSHOT_BYTES, Identity, SnapshotRefused, newest_accepted, open_checked,
                                     private_folder, prune, write_table_atomically)

logger = logging.getLogger("tr_serve.fleet")

FORMAT = "tr_serve.suffix_corpus/1"
PREFIX = "corpus-"


def write_corpus(folder: Path, batch: DocumentBatch, identity: Identity, keep: int = 3,
                 now: float | None = None) -> Path:
    """Write ``batch`` (the corpus's numbered form, FleetCorpus.batch) as a new snapshot file, then
    keep only the ``keep`` newest corpus files. Returns the new file."""
    import pyarrow as pa

    folder = private_folder(folder)
    created = time.time() if now is None else now
    last_seq = int(batch.seqs[-1]) if len(batch) else 0
    meta = {
        "tr_serve.format": FORMAT,
        "model_id": identity.model_id,
        "namespace": identity.namespace,
        "vocab_size": str(identity.vocab_size),
        "tokenizer_fingerprint": identity.tokenizer_fingerprint,
        "last_seq": str(last_seq),
        "created_at": repr(float(created)),
        "documents": str(len(batch)),
        "tokens": str(batch.num_tokens),
    }
    table = pa.table({
        "seq": pa.array(batch.seqs.astype(np.int64)),
        "origin": pa.array(list(batch.origins), type=pa.string()),
        "doc": pa.array(batch.docs.astype(np.int64)),
        "namespace": pa.array(list(batch.namespaces), type=pa.string()),
        "tokens": pa.LargeListArray.from_arrays(pa.array(batch.offsets.astype(np.int64)),
                                                pa.array(batch.tokens.astype(np.int32), type=pa.int32())),
    }).replace_schema_metadata(meta)
    final = write_table_atomically(folder, f"{PREFIX}{int(created * 1e9):020d}-s{last_seq:010d}.arrow", table)
    prune(folder, keep, PREFIX)
    return final


def read_corpus(path: Path, expect: Identity, max_bytes: int = MAX_SNAPSHOT_BYTES) -> DocumentBatch:
    """Load one corpus snapshot for ``expect``; raises :class:`SnapshotRefused` with the reason (a
    file over ``max_bytes`` is refused unread)."""
    import pyarrow as pa

    table, meta = open_checked(path, expect, FORMAT, fleet_namespace=True, max_bytes=max_bytes)
    vocab = expect.vocab_size
    try:
        last_seq, ndocs, ntokens = int(meta["last_seq"]), int(meta["documents"]), int(meta["tokens"])
        float(meta["created_at"])
    except (KeyError, ValueError) as e:
        raise SnapshotRefused(f"bad or missing metadata ({type(e).__name__}: {e})") from None
    try:
        tokens_col = table.column("tokens").combine_chunks()
        if not pa.types.is_large_list(tokens_col.type) or not pa.types.is_int32(tokens_col.type.value_type):
            raise TypeError(f"column 'tokens' is {tokens_col.type}, not large_list<int32>")
        columns = {name: table.column(name) for name in ("seq", "origin", "doc", "namespace")}
        if any(c.null_count for c in columns.values()) or tokens_col.null_count or tokens_col.values.null_count:
            raise ValueError("a column has nulls")
        offsets = np.asarray(tokens_col.offsets.to_numpy(), dtype=np.int64)
        batch = DocumentBatch(tuple(columns["origin"].to_pylist()), np.asarray(columns["doc"].to_numpy(), np.int64),
                              tuple(columns["namespace"].to_pylist()), offsets - offsets[0],
                              np.asarray(tokens_col.flatten().to_numpy(), dtype=np.int32),
                              np.asarray(columns["seq"].to_numpy(), np.int64))
    except (KeyError, ValueError, TypeError, IndexError, pa.ArrowException) as e:
        raise SnapshotRefused(f"bad columns ({type(e).__name__}: {e})") from None
    if len(batch) != ndocs or batch.num_tokens != ntokens:
        raise SnapshotRefused(f"it holds {len(batch)} documents of {batch.num_tokens} tokens, its metadata says "
                              f"{ndocs} of {ntokens}")
    try:
        batch.check(vocab, numbered=True)
    except ValueError as e:
        raise SnapshotRefused(str(e)) from None
    if len(batch) and int(batch.seqs[-1]) != last_seq:
        raise SnapshotRefused(f"its newest document is number {int(batch.seqs[-1])}, its metadata says {last_seq}")
    return batch


def load_newest_corpus(folder: Path, expect: Identity,
                       max_bytes: int = MAX_SNAPSHOT_BYTES) -> tuple[DocumentBatch, Path] | None:
    """The newest corpus snapshot of ``folder`` that :func:`read_corpus` accepts (refused files
    logged and skipped). ``None`` when there is none: start with an empty corpus."""
    found = newest_accepted(folder, PREFIX, lambda path: read_corpus(path, expect, max_bytes), "suffix corpus")
    if found is not None:
        batch, path = found
        logger.info("loaded suffix corpus snapshot %s (%d documents, %d tokens)", path, len(batch), batch.num_tokens)
    return found
