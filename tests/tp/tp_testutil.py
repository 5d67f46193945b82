"""Helpers of the tensor-parallel tests (a uniquely named module: other folders have their own)."""

from __future__ import annotations

import json
import socket

import torch

from tr_serve.data import SPEC_BENCH_DEV

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
DEV = SPEC_BENCH_DEV  # packaged with tr_serve (tr_serve/data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dev_questions(count: int) -> list[dict]:
    assert DEV.exists(), f"missing packaged data file {DEV}"
    rows = [json.loads(line) for line in DEV.read_text().splitlines() if line.strip()]
    return rows[:count]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """top-1 minus top-2 logit of the unsharded ``model`` after ``prompt + prefix``."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def assert_same_or_near_tie(model, prompt: list[int], got: list[int], want: list[int], what: str) -> None:
    """Tokens equal, or they part at a near-tie of the unsharded model (top-2 gap < 1e-3): summing
    the shards' partial results in another order may flip a tie, and nothing else."""
    i = first_difference(got, want)
    if i is None:
        return
    gap = top2_gap(model, prompt, want[:i])
    print(f"\n{what}: first difference at token {i} (got {got[i:i + 3]}, want {want[i:i + 3]}); "
          f"top-2 logit gap there {gap:.3e}")
    assert gap < 1e-3, f"{what}: differs at token {i} where the top-2 logit gap is {gap:.3e} (not a near-tie)"
