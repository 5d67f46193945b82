"""Files in the user cache (kernel plans and latency calibrations as JSON, the matrix prior as a
tensor): read defensively, written atomically, never fatal. A cache that cannot be read is
measured again; one that cannot be written only costs the measurement next time."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

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
