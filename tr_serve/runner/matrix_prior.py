"""A fresh matrix's first rows from the model itself: for every token ``t``, the model's top-k next
tokens after ``[BOS, t]`` (``t`` alone when the tokenizer has no BOS).

Why: the matrix learns a token's row only once that token has been decoded, so a fresh replica
drafts nothing after most tokens for its first thousands of tokens. This prior is what the model
predicts after the token with no other context: no training and no data, one forward per
vocabulary token (batched over the BOS's cached keys), computed once per model and kept in the
user cache. Recycling overwrites a row the first time its token is verified, so a warm matrix is
unchanged by it; the fleet's snapshot never erases it (``AdjacencyMatrix.adopt`` keeps a row
the snapshot holds nothing for). Drafts never change the output, so neither can the prior.

Measured on one stream of SmolLM2-135M: ``tr:auto`` MAT 1.71 -> 1.87 and 1.50x -> 1.57x plain decoding
(docs/token-recycling.md, "Decisions").

The embedded model's prior also ships inside the package (``tr_serve/data``, written by
``scripts/package_matrix_prior.py``): computing it takes about two minutes on a 2-core CPU, paid
by every fresh machine (a user's first start, every CI run) before anything else can happen. It is
used only for the weights it was computed from (the same fingerprint), any ``k`` up to its 8.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from tr_serve.data import EMBEDDED_MATRIX_PRIOR
from tr_serve.disk_cache import save_atomically
from tr_serve.model_loader import cache_root
from tr_serve.runner.hf_compat import cache_kwargs
from tr_serve.tr.matrix import EMPTY

logger = logging.getLogger(__name__)

PRIOR_VERSION = 1  # bump when the way rows are computed changes: cached priors are computed again
MAX_BATCH = 512  # tokens per forward
FORWARD_SECONDS = 0.25  # a deferred computation's forwards take about this long: a request waits at most one


def weights_fingerprint(model) -> str:
    """A sample of the first and last parameters' values: two models under one name (random test
    models, a checkpoint written again) do not share a prior."""
    params = list(model.parameters())
    h = hashlib.sha256()
    for p in (params[0], params[-1]):
        flat = p.detach().reshape(-1)
        h.update(flat[:: max(1, flat.numel() // 4096)].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def prior_key(model, model_id: str, vocab: int, k: int, bos: int | None) -> str:
    dtype = next(model.parameters()).dtype
    raw = f"{model_id}|{weights_fingerprint(model)}|{dtype}|{vocab}|{k}|{bos}|v{PRIOR_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


@torch.inference_mode()
def first_token_logits(model, vocab: int, bos: int | None,
                       batch: int | Callable[[], int] = 512) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, logits [n, vocab] float32 on the model's device) for consecutive tokens
    ``start..start+n-1``: row t = the model's next-token logits after ``[bos, t]``. ``batch``: tokens
    per forward, or a function asked before each forward (a deferred computation sizes its forwards
    to its slices).

    Each forward is a one-token query per token over the BOS's cached keys and values (the BOS is
    run once), so the cost is one token's forward per vocabulary entry."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    prefix = None
    if bos is not None and 0 <= bos < vocab:
        prefix = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([[bos]], device=device), **cache_kwargs(model, prefix))
    start = 0
    while start < vocab:
        size = max(1, int(batch() if callable(batch) else batch))
        ids = torch.arange(start, min(start + size, vocab), device=device)
        if prefix is None:
            logits = model(input_ids=ids[:, None]).logits[:, -1]
        else:
            cache = copy.deepcopy(prefix)
            cache.batch_repeat_interleave(len(ids))
            positions = torch.ones(len(ids), 1, dtype=torch.long, device=device)
            logits = model(input_ids=ids[:, None], position_ids=positions, **cache_kwargs(model, cache)).logits[:, -1]
        yield start, logits[:, :vocab].float()
        start += len(ids)


def first_token_rows(model, vocab: int, k: int, bos: int | None,
                     batch: int | Callable[[], int] = 512) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, rows [n, k] int32 on the CPU) for consecutive tokens ``start..start+n-1``: row t = the
    model's k likeliest tokens after ``[bos, t]`` (:func:`first_token_logits`, same ``batch``)."""
    for start, logits in first_token_logits(model, vocab, bos, batch):
        yield start, torch.topk(logits, k, dim=-1).indices.to("cpu", torch.int32)


def first_token_top_k(model, vocab: int, k: int, bos: int | None, batch: int = 512) -> torch.Tensor:
    """[vocab, k] int32 on the CPU: row t = the model's k likeliest tokens after ``[bos, t]``
    (:func:`first_token_rows`, ``batch`` tokens per forward)."""
    return torch.cat([rows for _, rows in first_token_rows(model, vocab, k, bos, batch)])


def _cache_path(key: str) -> Path:
    return cache_root() / "matrix_prior" / f"{key}.pt"


def _load(path: Path, vocab: int, k: int) -> torch.Tensor | None:
    if not path.exists():
        return None
    try:
        table = torch.load(path, weights_only=True)
    except Exception as e:  # a torn or foreign file: computed again
        logger.warning("ignoring unreadable matrix prior %s: %s", path, e)
        return None
    if (not isinstance(table, torch.Tensor) or table.dtype != torch.int32 or tuple(table.shape) != (vocab, k)
            or bool(((table < 0) | (table >= vocab)).any())):
        logger.warning("ignoring malformed matrix prior %s", path)
        return None
    return table


def save_packaged(path: Path, model, table: torch.Tensor, bos: int | None) -> None:
    """Write ``table`` [vocab, k] as a packaged prior of ``model`` (uint16 ids, compressed)."""
    if int(table.max()) > np.iinfo(np.uint16).max:
        raise ValueError("a packaged prior holds token ids below 65536 only")
    np.savez_compressed(path, rows=table.numpy().astype(np.uint16), fingerprint=weights_fingerprint(model),
                        bos=-1 if bos is None else bos, version=PRIOR_VERSION)


def packaged(model, vocab: int, k: int, bos: int | None, path: Path = EMBEDDED_MATRIX_PRIOR) -> torch.Tensor | None:
    """The packaged prior's first ``k`` columns (each row's top-k: ``topk`` sorts) when it was
    computed from these weights with this BOS, by this version; None otherwise."""
    if not path.exists():
        return None
    try:
        with np.load(path) as data:
            if (int(data["version"]) != PRIOR_VERSION or int(data["bos"]) != (-1 if bos is None else bos)
                    or str(data["fingerprint"]) != weights_fingerprint(model)):
                return None  # another model's (or an older computation's): the rows are not even read
            rows = data["rows"]
    except Exception as e:  # a torn or foreign file (zipfile, numpy and key errors): computed instead
        logger.warning("ignoring unreadable packaged matrix prior %s: %s", path, e)
        return None
    if rows.ndim != 2 or rows.shape[0] != vocab or rows.shape[1] < k or int(rows.max()) >= vocab:
        return None
    return torch.from_numpy(rows[:, :k].astype(np.int32))


def load_or_compute(model, model_id: str, vocab: int, k: int, bos: int | None) -> torch.Tensor:
    """The prior of ``model``: the packaged one when it was computed from these weights, else from
    the user cache, else computed (and cached: a cache that cannot be written only costs the
    computation next time).

    Inside :func:`tr_serve.runner.startup_work.deferring` (a replica starting), a prior that is
    neither packaged nor cached is not computed here: this returns a table of EMPTY rows (seeding
    it changes nothing) and registers a :class:`PriorComputation` that seeds the matrix's empty rows
    after the replica is ready."""
    from tr_serve.runner import startup_work

    table = packaged(model, vocab, k, bos)
    if table is not None:
        return table
    path = _cache_path(prior_key(model, model_id, vocab, k, bos))
    table = _load(path, vocab, k)
    if table is not None:
        return table
    work = startup_work.current()
    if work is not None:
        job = PriorComputation(model, model_id, vocab, k, bos, path)
        work.add(job)
        return job.table.clone()
    logger.info("computing the matrix prior of %s (%d tokens, once; cached in %s)", model_id, vocab, path)
    table = first_token_top_k(model, vocab, k, bos)
    save_atomically(path, lambda tmp: torch.save(table, tmp), "matrix prior")
    return table


class PriorComputation:
    """A prior computed after the replica is ready (runner/startup_work.py), in forwards sized to
    the slices :meth:`advance` is given (about :data:`FORWARD_SECONDS` each, at most 512 tokens),
    each slice's rows seeded into the matrix at once. The matrix's own rule keeps recycling's rows:
    :meth:`AdjacencyMatrix.seed` fills only rows that are still EMPTY, so a row recycling wrote
    first is never overwritten, and a row the prior filled is overwritten by recycling as before.
    Cached once complete, as :func:`load_or_compute` caches it."""

    name = "matrix prior"
    order = 2  # last: the longest, and only drafts better

    def __init__(self, model, model_id: str, vocab: int, k: int, bos: int | None, path: Path):
        self.path = path
        self.table = torch.full((vocab, k), EMPTY, dtype=torch.int32)
        self.filled = 0  # rows computed, from row 0
        self._batch = 16  # the first forward's tokens; then sized from the time a token took
        self._rows = first_token_rows(model, vocab, k, bos, lambda: self._batch)
        logger.info("computing the matrix prior of %s (%d tokens) after start-up, between steps (cached in %s)",
                    model_id, vocab, path)

    def advance(self, seconds: float, runner=None, matrix=None) -> bool:
        end = time.perf_counter() + seconds
        done = False
        while True:
            t0 = time.perf_counter()
            try:
                start, rows = next(self._rows)
            except StopIteration:
                done = True
                break
            per_token = (time.perf_counter() - t0) / len(rows)
            self._batch = max(1, min(MAX_BATCH, int(FORWARD_SECONDS / max(per_token, 1e-9))))
            self.table[start:start + len(rows)] = rows
            self.filled = start + len(rows)
            if time.perf_counter() >= end:
                break
        if matrix is not None:
            matrix.seed(self.table)  # the empty rows only
        if done:
            save_atomically(self.path, lambda tmp: torch.save(self.table, tmp), "matrix prior")
        return done
