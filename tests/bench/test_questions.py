"""The warm / measured split of the fleet benches (``tr_serve.bench.questions``)."""

from __future__ import annotations

import pytest

from tr_serve.bench.questions import split_questions
from tr_serve.bench.records import BenchError, Question


def test_split_alternates_within_each_category():
    qs = [Question(i, cat, f"q{i}") for i, cat in enumerate("aaabbc")]
    warm, measure = split_questions(qs, per_category=1)
    assert [q.question_id for q in warm] == [0, 3, 5]
    assert [q.question_id for q in measure] == [1, 4]
    warm, measure = split_questions(qs, per_category=2)
    assert [q.question_id for q in warm] == [0, 2, 3, 5] and [q.question_id for q in measure] == [1, 4]
    with pytest.raises(BenchError, match="nothing is left to measure"):
        split_questions([Question(1, "a", "x")], 1)
