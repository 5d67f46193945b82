"""What ``tr-serve`` and the benchmarks' own entry points share on the command line: a parser whose
errors are one line, argument types, the model-path check and a quiet transformers.

Both ``tr_serve/cli.py`` and ``tr_serve/bench`` import this module and neither imports the other's
entry point, so the CLI and the benches do not depend on each other. Standard library only at
import time: ``scripts/peer_vllm.py`` loads this file by its path in a venv without tr_serve.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Sequence


class UsageError(Exception):
    """Bad user input found after parsing (a tree, a model path, a stop string...): exit 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An argparse parser whose errors are a single line (no usage dump) and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_command(subparsers, name: str, help: str, description: str,
                add_arguments: Callable[[argparse.ArgumentParser], None],
                run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """Register a command on ``tr-serve``'s subparsers: its arguments, and ``func=run``."""
    p = subparsers.add_parser(name, help=help, description=description)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run_standalone(prog: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                   run: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """The same command as a program of its own (``python -m tr_serve.bench.<module>``)."""
    parser = OneLineErrorParser(prog=prog, description=description)
    add_arguments(parser)
    return run(parser.parse_args(argv))


# ---- argument types ------------------------------------------------------------------------------

def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "non-negative")


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def positive_int_list(text: str) -> list[int]:
    """``N[,N...]``: a comma-separated list of positive integers (``--concurrency 1,4,8``)."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...] positive integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"expected N[,N...] positive integers, got {text!r}")
    return levels


# ---- checks and set-up ---------------------------------------------------------------------------

def missing_model_path(model: str) -> str | None:
    """The error for a model given as a local path (``/``, ``./``, ``../``, ``~``, or a ``.gguf``
    file) that does not exist; None when the model is there or is not a path (a hub id, an alias)."""
    local = model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf")
    if local and not os.path.exists(os.path.expanduser(model)):
        return f"model path {model} does not exist"
    return None


def check_model_arg(model: str) -> None:
    """:func:`missing_model_path` as a :class:`UsageError`."""
    error = missing_model_path(model)
    if error:
        raise UsageError(error)


def quiet_transformers() -> None:
    """No progress bars and only errors from transformers: a command's output is its own."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover - never block a command on logging setup
        pass
