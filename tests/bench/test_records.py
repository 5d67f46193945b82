"""Questions read and selected (``tr_serve.bench.records``), as every bench and the vLLM peer do."""

from __future__ import annotations

import pytest

from tr_serve.bench.records import BenchError, Question, read_questions, select_questions, warmup_questions


def test_select_and_warmup_questions():
    qs = [Question(i, cat, f"q{i}") for i, cat in enumerate(["a", "a", "b", "a", "b", "c"])]
    chosen, rest = select_questions(qs, 1)
    assert [q.question_id for q in chosen] == [0, 2, 5]
    assert [q.question_id for q in rest] == [1, 3, 4]
    # unmeasured questions first, round robin over categories, then measured ones
    assert [q.question_id for q in warmup_questions(chosen, rest, 2)] == [1, 4]
    assert [q.question_id for q in warmup_questions(chosen, rest, 4)] == [1, 4, 3, 0]
    assert warmup_questions(chosen, rest, 0) == []
    assert [q.question_id for q in warmup_questions(chosen, [], 1)] == [0]


def test_bad_question_file(tmp_path):
    with pytest.raises(BenchError, match="does not exist"):
        read_questions(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa"}\n')
    with pytest.raises(BenchError, match="missing turns"):
        read_questions(bad)
