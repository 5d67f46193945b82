"""Files in the user cache (kernel plans and latency calibrations as JSON, the matrix prior as a
tensor): read defensively, written atomically, never fatal. A cache that cannot be read is
measured again; one that cannot be written only costs the measurement next time."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def load_json(path: Path, parse: Callable[[Any], T | None], what: str) -> T | None:
    """``parse(data)`` of the file's JSON; None when the file is absent, unreadable or refused by
    ``parse`` (which may raise KeyError, TypeError or ValueError on a malformed file)."""
    if not path.exists():
        return None
    try:
        return parse(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable %s %s: %s", what, path, e)
        return None


def save_json(path: Path, data: Any, what: str) -> None:
    save_atomically(path, lambda tmp: tmp.write_text(json.dumps(data)), what)


def save_atomically(path: Path, write: Callable[[Path], Any], what: str) -> None:
    """``write(tmp)`` to a per-process temporary file, then a rename: concurrent writers
    (tensor-parallel ranks, replicas) never leave a half-written file. (``torch.save`` reports a
    file it cannot open as a RuntimeError.)"""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        write(tmp)
        tmp.replace(path)
    except (OSError, RuntimeError) as e:
        logger.warning("could not cache the %s in %s: %s", what, path, e)


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` + ``.lock`` across processes (``flock``) while the
    block runs: of several processes about to measure the same thing for the cache (the ranks of
    a tensor-parallel replica, parallel test workers), one measures while the others wait, then
    read its result, instead of all measuring at once on contended cores. A lock that cannot be
    taken (no ``fcntl``, a cache that cannot be written) only means no waiting."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "a")
    except (ImportError, OSError) as e:
        logger.debug("no lock for %s: %s", path, e)
        yield
        return
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as e:
            logger.debug("could not lock %s: %s", path, e)
        yield  # closing the file releases the lock


def load_or_make(path: Path, load: Callable[[], T | None], make: Callable[[], T]) -> tuple[T, bool]:
    """``load()`` (the cached value at ``path``, or None), else ``make()`` (measure it and save it)
    under :func:`exclusive`, after one more ``load()`` there: a process that waited for another one
    measuring the same value reads it instead of measuring again. Returns (value, made here)."""
    value = load()
    if value is not None:
        return value, False
    with exclusive(path):
        value = load()
        if value is not None:
            return value, False
        return make(), True
