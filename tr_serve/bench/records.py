"""What every benchmark here reads and writes: questions, runs, per-method summaries.

Standard library only, on purpose: ``scripts/peer_vllm.py`` runs in vLLM's own venv, without
tr_serve's dependencies, and loads this file by its path, so both engines select the same questions
and write the same JSON shape from one copy of the code.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


class BenchError(ValueError):
    """Bad benchmark input (arguments, question file, model): reported as one line, exit 2."""


# ---- questions ---------------------------------------------------------------------------------

@dataclass
class Question:
    question_id: Any
    category: str
    text: str
    prompt_ids: list[int] = field(default_factory=list)


def read_questions(path: str | os.PathLike) -> list[Question]:
    """All questions of a Spec-Bench JSONL file, first turn only, in file order."""
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"question file {p} does not exist (give one with --questions)")
    out: list[Question] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise BenchError(f"{p}:{lineno}: each line must be a JSON object")
            missing = [k for k in ("question_id", "category", "turns") if k not in obj]
            if missing:
                raise BenchError(f"{p}:{lineno}: missing {', '.join(missing)}")
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
                raise BenchError(f"{p}:{lineno}: 'turns' must be a non-empty list of strings")
            out.append(Question(obj["question_id"], str(obj["category"]), turns[0]))
    if not out:
        raise BenchError(f"question file {p} has no questions")
    return out


def select_questions(questions: Sequence[Question], per_category: int) -> tuple[list[Question], list[Question]]:
    """The first ``per_category`` questions of each category (categories in order of first
    appearance, questions in file order), and the questions left over."""
    by_cat: "OrderedDict[str, list[Question]]" = OrderedDict()
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    chosen = [q for qs in by_cat.values() for q in qs[:per_category]]
    picked = {id(q) for q in chosen}
    rest = [q for q in questions if id(q) not in picked]
    return chosen, rest


def warmup_questions(chosen: Sequence[Question], rest: Sequence[Question], n: int) -> list[Question]:
    """Warm-up questions: unmeasured ones first (one per category, round robin, so the TR matrices
    are warmed on varied text), falling back to measured ones when the file has too few."""
    if n <= 0:
        return []
    by_cat: "OrderedDict[str, list[Question]]" = OrderedDict()
    for q in rest:
        by_cat.setdefault(q.category, []).append(q)
    ordered: list[Question] = []
    depth = 0
    while len(ordered) < len(rest):
        for qs in by_cat.values():
            if depth < len(qs):
                ordered.append(qs[depth])
        depth += 1
    pool = ordered + list(chosen)
    return [pool[i % len(pool)] for i in range(n)]


# ---- runs and their summary --------------------------------------------------------------------

@dataclass
class Run:
    """One method on one question. ``accepted`` / ``forwards`` is the MAT (both exclude the
    prefill forward and its first token)."""

    question_id: Any
    category: str
    token_ids: list[int]
    seconds: float
    forwards: int  # verification forwards, prefill excluded
    accepted: int  # tokens those forwards emitted (the prefill's first token excluded)
    finish: str = ""
    spec: dict | None = None  # a peer engine's own speculative-decoding counters for this question

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


def ratio(num: float, den: float, empty: float | None) -> float | None:
    return num / den if den else empty


def first_mismatch(reference: Sequence[int], other: Sequence[int]) -> dict | None:
    """Where ``other`` first leaves ``reference`` (None when they are equal)."""
    pos = next((i for i, (x, y) in enumerate(zip(reference, other)) if x != y), None)
    if pos is None:
        if len(reference) == len(other):
            return None
        pos = min(len(reference), len(other))
    return {"position": pos, "reference_len": len(reference), "method_len": len(other),
            "reference_token": reference[pos] if pos < len(reference) else None,
            "method_token": other[pos] if pos < len(other) else None}


def check_same_questions(runs_by_method: dict[str, Sequence[Run]], base: str) -> None:
    want = [r.question_id for r in runs_by_method[base]]
    for name, runs in runs_by_method.items():
        if [r.question_id for r in runs] != want:
            raise ValueError(f"method {name} ran other questions than {base}")


def _totals(runs: Sequence[Run]) -> tuple[int, float, int, int]:
    return (sum(r.new_tokens for r in runs), sum(r.seconds for r in runs),
            sum(r.accepted for r in runs), sum(r.forwards for r in runs))


def _tokens_per_s(runs: Sequence[Run], category: str | None = None) -> float:
    t, s, _, _ = _totals([r for r in runs if category is None or r.category == category])
    return ratio(t, s, 0.0)


def method_entry(runs: Sequence[Run], reference: Sequence[Run] | None, check_against: Sequence[Run] | None,
                 categories: Sequence[str], question_extra=None) -> dict[str, Any]:
    """One method's JSON entry: MAT, tokens/s, speedup over ``reference``'s runs (None: the
    method is its own reference), per category, per question, and ``identical`` to
    ``check_against``'s tokens (None: not checked) with where each differing question first
    differs. ``question_extra(run)`` adds fields to a question's record."""
    tok, sec, acc, fwd = _totals(runs)
    entry: dict[str, Any] = {
        "mat": ratio(acc, fwd, None),
        "tokens_per_s": _tokens_per_s(runs),
        "speedup": 1.0 if reference is None else ratio(_tokens_per_s(runs), _tokens_per_s(reference), 0.0),
        "identical": None,
        "per_category": {},
        "new_tokens": tok,
        "seconds": sec,
        "verification_forwards": fwd,
        "accepted": acc,
    }
    for cat in categories:
        t, _, a, f = _totals([r for r in runs if r.category == cat])
        entry["per_category"][cat] = {
            "mat": ratio(a, f, None),
            "speedup": 1.0 if reference is None else ratio(_tokens_per_s(runs, cat), _tokens_per_s(reference, cat), 0.0),
            "tokens_per_s": _tokens_per_s(runs, cat),
            "new_tokens": t,
        }
    per_q, mismatches = [], []
    for i, r in enumerate(runs):
        q = {"question_id": r.question_id, "category": r.category, "new_tokens": r.new_tokens,
             "verification_forwards": r.forwards, "accepted": r.accepted, "seconds": round(r.seconds, 6),
             "finish": r.finish}
        if question_extra is not None:
            q.update(question_extra(r))
        if check_against is not None:
            mm = first_mismatch(check_against[i].token_ids, r.token_ids)
            q["identical"] = mm is None
            if mm is not None:
                mismatches.append({"question_id": r.question_id, "category": r.category, **mm})
        per_q.append(q)
    if check_against is not None:
        entry["identical"] = not mismatches
        if mismatches:
            entry["mismatches"] = mismatches
    entry["per_question"] = per_q
    return entry


def selection_record(questions_file: str, chosen: Sequence[Question], warm: Sequence[Question],
                     categories: Sequence[str]) -> dict[str, Any]:
    """The JSON fields that say which questions a run measured and warmed up on (in this order)."""
    return {"questions_file": str(questions_file), "questions": len(chosen),
            "question_ids": [q.question_id for q in chosen], "categories": list(categories),
            "warmup_question_ids": [q.question_id for q in warm]}


def round_floats(obj, digits: int = 6):
    """``obj`` with every float rounded (non-finite ones as null), for the JSON."""
    if isinstance(obj, float):
        return round(obj, digits) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [round_floats(v, digits) for v in obj]
    return obj
