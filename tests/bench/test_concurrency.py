"""The concurrency benchmark: every level and round serves questions of its own (a kept matrix never
meets a question twice), the JSON records which, outputs identical to the baseline, engine counts."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_model import tiny_loaded
from tr_serve.bench import concurrency
from tr_serve.bench.concurrency import (DEFAULT_METHODS, ConcurrencyMethod, LevelPlan, TooFewQuestionsError,
                                        interleave_by_category, markdown, methods_for, plan_levels,
                                        run_concurrency, save)
from tr_serve.bench.provenance import kernel_plan_record, template_record
from tr_serve.bench.records import Question
from tr_serve.engine.engine import Engine


def _questions(n: int, categories=("a", "b", "c"), length: int = 4) -> list[Question]:
    """Distinct token prompts below the tiny model's vocabulary."""
    return [Question(i, categories[i % len(categories)], f"q{i}",
                     [5 + i, 40 + 3 * i, 200 + (7 * i) % 300, 7][:length]) for i in range(n)]


# ---- the question plan (no model) ---------------------------------------------------------------

def test_interleave_by_category_mixes_categories_in_file_order():
    qs = [Question(i, cat, "") for i, cat in enumerate("aaabbc")]
    assert [q.question_id for q in interleave_by_category(qs)] == [0, 3, 5, 1, 4, 2]


def test_every_level_round_and_warmup_gets_questions_of_its_own():
    pool = interleave_by_category([Question(i, "abc"[i // 10], "") for i in range(30)])  # 10 per category
    plan = plan_levels(pool, [1, 4], rounds=2, per_run=6, warmup=1)
    served = [q.question_id for p in plan.values() for qs in p.rounds + [p.warmup] for q in qs]
    assert len(served) == 2 * 2 * 6 + 2 and len(set(served)) == len(served)
    assert [len(qs) for qs in plan[1].rounds + plan[4].rounds] == [6, 6, 6, 6]
    assert [len(p.warmup) for p in plan.values()] == [1, 1]
    # striped over an interleaved pool: every slice gets the same mix of categories
    for p in plan.values():
        for qs in p.rounds:
            assert sorted(q.category for q in qs) == ["a", "a", "b", "b", "c", "c"]
    # the warm-ups come after every measured question
    measured = {q.question_id for p in plan.values() for qs in p.rounds for q in qs}
    assert {q.question_id for q in pool[:24]} == measured


def test_a_level_serves_at_least_per_client_questions_per_client():
    # 16 clients on 13 questions would be one static batch: with per_client=2 level 16 serves 32
    pool = interleave_by_category([Question(i, "abcd"[i % 4], "") for i in range(200)])
    plan = plan_levels(pool, [1, 4, 16], rounds=2, per_run=8, warmup=1, per_client=2)
    assert [len(qs) for level in (1, 4, 16) for qs in plan[level].rounds] == [8, 8, 8, 8, 32, 32]
    served = [q.question_id for p in plan.values() for qs in p.rounds + [p.warmup] for q in qs]
    assert len(served) == 8 * 4 + 64 + 3 and len(set(served)) == len(served)
    for qs in plan[16].rounds:  # round robin over an interleaved pool: a mix of every category
        assert sorted(q.category for q in qs) == sorted("abcd" * 8)
    with pytest.raises(TooFewQuestionsError, match="1: 8, 4: 12, 16: 48"):
        plan_levels(pool[:100], [1, 4, 16], rounds=2, per_run=8, per_client=3)


def test_too_few_questions_is_an_error_that_says_what_is_needed():
    pool = [Question(i, "a", "") for i in range(10)]
    with pytest.raises(TooFewQuestionsError, match="need 15 distinct questions and the pool has 10"):
        plan_levels(pool, [1, 4, 8], rounds=2, per_run=2, warmup=1)
    with pytest.raises(ValueError, match="repeat"):
        plan_levels(pool, [4, 4], rounds=1, per_run=2)
    plan_levels(pool, [1, 4, 8], rounds=1, per_run=3, warmup=0)  # 9 of 10: fits


def test_a_schedule_that_replays_a_question_is_refused_before_any_engine_runs():
    q = _questions(3)
    replay = {1: LevelPlan([[q[0], q[1]]]), 4: LevelPlan([[q[2], q[0]]])}
    with pytest.raises(ValueError, match="question 0 is served in level 1 round 0 and again in level 4 round 0"):
        run_concurrency(None, replay, max_new_tokens=4)
    warm_replay = {1: LevelPlan([[q[0]]], warmup=[q[0]])}
    with pytest.raises(ValueError, match="again"):
        run_concurrency(None, warm_replay, max_new_tokens=4)


def test_methods():
    assert [m.name for m in DEFAULT_METHODS] == ["baseline", "pld", "tr:2.2.2", "tr:auto"]
    assert methods_for() == DEFAULT_METHODS
    assert [(m.name, m.tree) for m in methods_for(["top8+ctx"], pld=False)] == [("baseline", "none"),
                                                                               ("tr:top8+ctx", "top8+ctx")]


# ---- the real engine on a tiny model ------------------------------------------------------------

def test_concurrency_bench_serves_distinct_questions_identically(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "cache"))  # calibration of the tiny model
    loaded = tiny_loaded(tokenizer, seed=3)
    engines = []

    class RecordedEngine(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(concurrency, "Engine", RecordedEngine)
    schedule = plan_levels(_questions(12), [1, 3], rounds=1, per_run=5, warmup=1)
    result = run_concurrency(loaded, schedule, max_new_tokens=12)
    assert set(result["concurrency"]) == {"1", "3"}
    # one engine per method for the whole run, sized for the highest level, as one server under
    # changing load (tr:auto's budget goes on learning through both levels, as its matrix does)
    assert [e.config.tree for e in engines] == ["none", "pld", "2.2.2", "auto"]
    assert {e.config.max_num_seqs for e in engines} == {3} and result["max_num_seqs"] == 3
    ids = []
    for n, level in result["concurrency"].items():
        plan = schedule[int(n)]
        assert level["question_ids"] == [[q.question_id for q in plan.rounds[0]]]
        assert level["warmup_question_ids"] == [q.question_id for q in plan.warmup]
        ids += level["question_ids"][0] + level["warmup_question_ids"]
        methods = level["methods"]
        assert list(methods) == ["baseline", "pld", "tr:2.2.2", "tr:auto"]
        for name, m in methods.items():
            assert m["identical"] is True and "mismatched_questions" not in m, name
            # every request's first token comes from its prefill, every other one from a verification step
            assert m["accepted"] == m["new_tokens"] - 5, name
            assert m["mat"] == pytest.approx(m["accepted"] / m["verification_steps"]), name
        base = methods["baseline"]
        assert base["mat"] == 1.0 and base["verification_steps"] == base["new_tokens"] - 5
        assert base["mean_tree_nodes"] == 0 and base["throughput_vs_baseline"] == 1.0
        assert methods["tr:2.2.2"]["mean_tree_nodes"] == 80
        assert methods["tr:auto"]["tree"] == "auto"
    assert len(ids) == len(set(ids)) == 12
    # how it was measured
    assert result["torch"] == torch.__version__ and result["torch_threads"] == torch.get_num_threads()
    from tr_serve.kernels.kernel_autotune import select_plan

    assert result["kernel_plan"] == kernel_plan_record(select_plan(loaded.model))
    assert result["templates"] == {"baseline": None, "pld": None, "tr:2.2.2": template_record("2.2.2", 8),
                                   "tr:auto": template_record("auto", 8)}
    png = save(result, tmp_path / "c.json")
    assert png.exists() and json.loads((tmp_path / "c.json").read_text())["concurrency"]
    assert "| 3 | tr:auto |" in markdown(result)


def test_rounds_serve_their_own_questions_and_stay_identical(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "cache"))
    loaded = tiny_loaded(tokenizer, seed=4)
    schedule = plan_levels(_questions(12, length=3), [2], rounds=3, per_run=4)
    done = []
    methods = (ConcurrencyMethod("baseline", "none"), ConcurrencyMethod("tr:top4", "top4"))
    result = run_concurrency(loaded, schedule, max_new_tokens=8, methods=methods, progress=lambda: done.append(1))
    assert result["rounds"] == 3 and len(done) == 3 * 2 * 4  # rounds x methods x questions
    rounds = result["concurrency"]["2"]["question_ids"]
    assert len(rounds) == 3 and len({q for r in rounds for q in r}) == 12
    for name, m in result["concurrency"]["2"]["methods"].items():
        assert m["identical"] is True
        assert m["accepted"] == m["new_tokens"] - 12
        per_round = m["throughput_vs_baseline_per_round"]  # each round's own ratio, beside the whole run's
        assert len(per_round) == 3 and min(per_round) <= m["throughput_vs_baseline"] <= max(per_round), name
        if name == "baseline":
            assert per_round == [1.0, 1.0, 1.0]
    table = markdown(result)
    ratios = " / ".join(f"{x:.2f}" for x in result["concurrency"]["2"]["methods"]["tr:top4"]["throughput_vs_baseline_per_round"])
    assert f"| {ratios} |" in table and "| 1.00 / 1.00 / 1.00 |" in table


def test_cli_refuses_too_few_questions_before_loading_a_model(tmp_path, capsys):
    from tr_serve.cli import main

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "ab"[i % 2], "turns": [f"q{i}"]}) + "\n"
                            for i in range(6)))
    # 2 levels x 2 rounds x (1 per category x 2 categories) + 1 warm-up per level = 10 > 6
    rc = main(["bench", "--concurrency", "1,4", "--rounds", "2", "--per-category", "1", "--questions", str(path),
               "--model", "./no-such-model"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "too few questions" in err and "need 32 distinct questions and the pool has 6" in err
    rc = main(["bench", "--concurrency", "1", "--tree", "pld", "--questions", str(path)])
    assert rc == 2 and "measured as the method 'pld'" in capsys.readouterr().err


def test_cli_refuses_the_single_stream_workload_and_suffix_options(capsys):
    from tr_serve.cli import main

    for extra in (["--workload", "multi-turn"], ["--suffix-index", "both", "--tree", "auto"]):
        rc = main(["bench", "--concurrency", "1", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and "single-stream options" in err, extra
