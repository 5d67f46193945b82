"""``summarize``: speedups against each framework's own baseline; a method that is not lossless is caught."""

from __future__ import annotations

import pytest

from tr_serve.bench.methods import Method
from tr_serve.bench.records import Run
from tr_serve.bench.summary import summarize


def _runs(tokens: dict, seconds: float, forwards: int | None = None, accepted: int | None = None) -> list[Run]:
    """One Run per question id (category = "qa" for odd ids, "code" for even ones)."""
    return [Run(qid, "qa" if qid % 2 else "code", list(ids), seconds,
                forwards if forwards is not None else len(ids) - 1,
                accepted if accepted is not None else len(ids) - 1)
            for qid, ids in tokens.items()]


def test_summarize_catches_a_method_that_is_not_lossless():
    good = {1: [5, 6, 7, 8, 9, 2], 2: [10, 11, 12, 13]}
    lossy = {1: [5, 6, 7, 8, 9, 2], 2: [10, 11, 99, 13]}  # question 2 leaves the baseline at token 2
    short = {1: [5, 6, 7], 2: [10, 11, 12, 13]}  # question 1 stops early: differs where it ends
    methods = [Method("baseline", "baseline", tree="none", runs=_runs(good, 1.0)),
               Method("tr:lossy", "tr", tree="top4", runs=_runs(lossy, 0.5, forwards=2, accepted=3)),
               Method("tr:short", "tr", tree="top4", runs=_runs(short, 0.5, forwards=1, accepted=2)),
               Method("hf-greedy", "hf", reference="hf-greedy", runs=_runs(good, 2.0)),
               Method("hf-pld", "hf", reference="hf-greedy", lookup=10, runs=_runs(good, 1.0, forwards=2))]
    out = summarize(methods, ["qa", "code"])

    lossy_entry = out["tr:lossy"]
    assert lossy_entry["identical"] is False and lossy_entry["identical_to"] == "baseline"
    assert lossy_entry["mismatches"] == [{"question_id": 2, "category": "code", "position": 2, "reference_len": 4,
                                          "method_len": 4, "reference_token": 12, "method_token": 99}]
    assert [q["identical"] for q in lossy_entry["per_question"]] == [True, False]
    assert out["tr:short"]["identical"] is False
    assert out["tr:short"]["mismatches"] == [{"question_id": 1, "category": "qa", "position": 3, "reference_len": 6,
                                              "method_len": 3, "reference_token": 8, "method_token": None}]
    # the lossless rows, and the baseline itself checked against transformers' greedy decoding
    for name in ("hf-greedy", "hf-pld"):
        assert out[name]["identical"] is True and "mismatches" not in out[name]
    assert out["baseline"]["identical"] is True and out["baseline"]["identical_to"] == "hf-greedy"

    # speedups: engine methods over baseline, hf-pld over hf-greedy (not over the engine's baseline)
    assert out["baseline"]["tokens_per_s"] == pytest.approx(5.0)  # 10 tokens in 2 x 1.0 s
    assert out["tr:lossy"]["speedup"] == pytest.approx(2.0) and out["tr:lossy"]["reference"] == "baseline"
    assert out["hf-greedy"]["speedup"] == 1.0 and out["hf-greedy"]["tokens_per_s"] == pytest.approx(2.5)
    assert out["hf-pld"]["speedup"] == pytest.approx(2.0) and out["hf-pld"]["reference"] == "hf-greedy"
    assert out["hf-pld"]["per_category"]["qa"]["speedup"] == pytest.approx(2.0)
    # MAT: accepted / verification forwards, summed over questions
    assert out["baseline"]["mat"] == pytest.approx(1.0)
    assert out["tr:lossy"]["mat"] == pytest.approx(6 / 4)
    assert out["hf-pld"]["mat"] == pytest.approx(8 / 4)
    assert out["tr:lossy"]["per_category"]["code"]["mat"] == pytest.approx(3 / 2)


def test_summarize_without_hf_rows_leaves_the_baseline_unchecked():
    good = {1: [5, 6, 2]}
    methods = [Method("baseline", "baseline", tree="none", runs=_runs(good, 1.0)),
               Method("pld", "pld", tree="pld", runs=_runs(good, 0.5, forwards=1, accepted=2))]
    out = summarize(methods, ["qa"])
    assert out["baseline"]["identical"] is None and out["baseline"]["identical_to"] is None
    assert out["pld"]["identical"] is True and out["pld"]["speedup"] == pytest.approx(2.0)
    assert out["pld"]["mat"] == pytest.approx(2.0) and out["pld"]["tree"] == "pld"


def test_summarize_refuses_runs_of_other_questions():
    methods = [Method("baseline", "baseline", tree="none", runs=_runs({1: [5, 2]}, 1.0)),
               Method("tr:top4", "tr", tree="top4", runs=_runs({3: [5, 2]}, 1.0))]
    with pytest.raises(ValueError, match="other questions"):
        summarize(methods, ["qa"])
