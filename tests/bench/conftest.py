"""A tiny Spec-Bench question file for the bench tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

QUESTIONS = [
    {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?", "And of Italy?"]},
    {"question_id": 2, "category": "writing", "turns": ["Write one sentence about the sea."]},
]


@pytest.fixture
def question_file(tmp_path):
    """``question_file()`` writes both questions (two categories) as JSONL, ``question_file(1)`` the first."""

    def write(count: int = len(QUESTIONS)) -> Path:
        path = tmp_path / "q.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in QUESTIONS[:count]))
        return path

    return write
