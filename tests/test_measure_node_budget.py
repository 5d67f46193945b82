"""scripts/measure_node_budget.py: its warm-up questions are never the measured ones."""

from __future__ import annotations

from collections import Counter

from script_module import load_script


def test_warm_up_and_measured_questions_are_apart_and_cover_every_category(spec_bench_rows):
    script = load_script("measure_node_budget")
    measured, warm = script.questions(per_category=2, warmup=40)
    categories = Counter(r["category"] for r in spec_bench_rows)
    assert Counter(r["category"] for r in measured) == {c: 2 for c in categories}
    assert len(warm) == 40 and len({r["question_id"] for r in warm}) == 40
    assert not {r["question_id"] for r in warm} & {r["question_id"] for r in measured}
    # round robin: the first warm-up questions are one of each category
    assert {r["category"] for r in warm[: len(categories)]} == set(categories)
