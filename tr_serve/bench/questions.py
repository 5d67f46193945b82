"""The questions every bench feeds its model: the packaged default file, each question's chat-encoded
prompt, and the warm / measured split of the fleet benches.

Reading and selecting questions is in :mod:`tr_serve.bench.records` (standard library only, shared
with the vLLM peer script); this module adds what needs tr_serve: the package data and the tokenizer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from tr_serve.bench.records import BenchError, Question
from tr_serve.data import SPEC_BENCH_DEV

DEFAULT_QUESTIONS = str(SPEC_BENCH_DEV)  # the packaged Spec-Bench dev questions (tr_serve/data): every bench's default


def encode_questions(tokenizer, questions: Iterable[Question]) -> None:
    """Set the ``prompt_ids`` of every question that has none yet: its first turn as one user message
    through the chat template, as a client's chat request would be encoded."""
    from tr_serve.engine.prompt import encode_prompt

    for q in questions:
        if not q.prompt_ids:
            q.prompt_ids = encode_prompt(tokenizer, [{"role": "user", "content": q.text}])


def short_questions(tokenizer, questions: Iterable[Question], max_prompt_tokens: int) -> list[Question]:
    """The questions whose encoded prompt has at most ``max_prompt_tokens`` tokens, in order (the
    tensor-parallel benches keep their contexts small)."""
    questions = list(questions)
    encode_questions(tokenizer, questions)
    return [q for q in questions if len(q.prompt_ids) <= max_prompt_tokens]


def split_questions(questions: Sequence[Question], per_category: int) -> tuple[list[Question], list[Question]]:
    """Per category (in order of first appearance), the first ``2 * per_category`` questions,
    alternately into the warm half and the measured half."""
    by_cat: "OrderedDict[str, list[Question]]" = OrderedDict()
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    warm, measure = [], []
    for qs in by_cat.values():
        picked = qs[: 2 * per_category]
        warm.extend(picked[0::2])
        measure.extend(picked[1::2])
    if not measure:
        raise BenchError("every category has a single question: nothing is left to measure")
    return warm, measure
