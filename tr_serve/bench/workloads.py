"""What ``tr-serve bench --workload`` sends: independent questions, or conversations whose later
requests revisit the earlier ones' answers.

* ``questions`` (the default): the first turn of each selected question, one request each.
* ``multi-turn``: each question of the file with a second turn (MT-bench's: "rewrite your previous
  response ...") as a conversation of two requests: its first turn (category ``turn-1``), then its
  second turn after the first turn and its answer (``turn-2``).
* ``code-revision``: each ``coding`` question answered (``code-write``), then
  :data:`REVISIONS` requests that each hand the code of that answer back with one change to make
  (``code-revise``): their outputs repeat the code and each other.

A later request's prompt holds the *baseline's* answer to the earlier one: every method's answer is
the same (the bench checks it), and the baseline runs first for every request. Warm-up requests
are first turns of questions no conversation uses. The per-category table then shows where drafting
from earlier requests pays (second turns, revisions) and where it cannot (first turns, new code).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tr_serve.bench.records import BenchError, Question, read_questions, select_questions, warmup_questions

WORKLOADS = ("questions", "multi-turn", "code-revision")
CODE_CATEGORY = "coding"
# one change per request, each small enough that the answer is the code again with an edit
REVISIONS = (
    "add a comment at the top that says what it does",
    "rename the variables to longer, clearer names",
    "add a docstring to every function",
)
_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|$)", re.DOTALL)


@dataclass
class FollowUp(Question):
    """A request whose prompt holds an earlier request's answer: its messages are built from the
    baseline's answer to ``source`` once that has run (:meth:`Workload.prepare`)."""

    source: Question | None = None
    build: Callable[[str], list[dict[str, str]]] | None = None


@dataclass
class Workload:
    """The measured requests in order, the warm-up requests, and the baseline's answers so far."""

    name: str
    chosen: list[Question]
    warm: list[Question]
    answers: dict[int, str] = field(default_factory=dict)  # id(question) -> the baseline's answer text

    @property
    def categories(self) -> list[str]:
        return list(dict.fromkeys(q.category for q in self.chosen))

    def prepare(self, q: Question, tokenizer) -> None:
        """Encode ``q``'s prompt if it is not yet: a follow-up's from its source's answer."""
        from tr_serve.engine.prompt import encode_prompt

        if q.prompt_ids:
            return
        if isinstance(q, FollowUp):
            q.prompt_ids = encode_prompt(tokenizer, q.build(self.answers[id(q.source)]))
        else:
            q.prompt_ids = encode_prompt(tokenizer, [{"role": "user", "content": q.text}])

    def answered(self, q: Question, token_ids: list[int], tokenizer) -> None:
        """The baseline's answer to ``q``, which the requests that follow it quote."""
        self.answers[id(q)] = tokenizer.decode(token_ids, skip_special_tokens=True)


def build_workload(name: str, path: str, per_category: int, warmup: int) -> Workload:
    """The requests of workload ``name`` from the Spec-Bench JSONL at ``path``."""
    if name == "questions":
        chosen, rest = select_questions(read_questions(path), per_category)
        return Workload(name, chosen, warmup_questions(chosen, rest, warmup))
    rows = _read_rows(path)
    if name == "multi-turn":
        bases = _first_per_category([r for r in rows if len(r["turns"]) > 1], per_category)
        chosen = [q for row in bases for q in _multi_turn(row)]
    elif name == "code-revision":
        bases = [r for r in rows if r["category"] == CODE_CATEGORY][:per_category]
        chosen = [q for row in bases for q in _code_revision(row)]
    else:
        raise BenchError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    if not chosen:
        raise BenchError(f"workload {name}: the question file has no question it can use")
    used = {row["question_id"] for row in bases}
    rest = [Question(r["question_id"], r["category"], r["turns"][0]) for r in rows if r["question_id"] not in used]
    first_turns = [q for q in chosen if not isinstance(q, FollowUp)]
    return Workload(name, chosen, warmup_questions(first_turns, rest, warmup))


def extract_code(answer: str) -> str:
    """The first fenced code block of an answer (an unclosed one runs to the end), or the whole
    answer when it has none."""
    found = _FENCE.search(answer)
    code = found.group(1) if found else answer
    return code.strip() or answer.strip()


def _multi_turn(row: dict) -> list[Question]:
    first, second = row["turns"][0], row["turns"][1]
    turn1 = Question(row["question_id"], "turn-1", first)
    turn2 = FollowUp(f"{row['question_id']}/2", "turn-2", second, source=turn1,
                     build=lambda answer: [{"role": "user", "content": first},
                                           {"role": "assistant", "content": answer},
                                           {"role": "user", "content": second}])
    return [turn1, turn2]


def _code_revision(row: dict) -> list[Question]:
    write = Question(row["question_id"], "code-write", row["turns"][0])
    out: list[Question] = [write]
    for i, change in enumerate(REVISIONS, start=1):
        out.append(FollowUp(f"{row['question_id']}/r{i}", "code-revise", change, source=write,
                            build=lambda answer, change=change: [{"role": "user", "content": revision_prompt(answer, change)}]))
    return out


def revision_prompt(answer: str, change: str) -> str:
    return (f"Here is some code:\n```\n{extract_code(answer)}\n```\n"
            f"Return this code with one change: {change}. Reply with the whole code only.")


def _first_per_category(rows: list[dict], per_category: int) -> list[dict]:
    seen: dict[str, int] = {}
    out = []
    for r in rows:
        if seen.get(r["category"], 0) < per_category:
            seen[r["category"]] = seen.get(r["category"], 0) + 1
            out.append(r)
    return out


def _read_rows(path: str) -> list[dict]:
    """Every question of the file with all its turns (read_questions checks the format first)."""
    read_questions(path)
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            if all(isinstance(t, str) and t.strip() for t in obj["turns"]):
                rows.append(obj)
    return rows
