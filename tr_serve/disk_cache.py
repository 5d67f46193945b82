"""JSON files in the user cache (kernel plans, latency calibrations): read defensively, written
atomically, never fatal. A cache that cannot be read is measured again; one that cannot be
written only costs the measurement next time."""

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
    """Write through a per-process temporary file and a rename: concurrent writers (tensor-parallel
    ranks, replicas) never leave a half-written file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not cache the %s in %s: %s", what, path, e)
