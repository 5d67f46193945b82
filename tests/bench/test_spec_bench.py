"""``tr-serve bench`` (in process, real embedded model, tiny question file) and ``tr-serve generate``;
``summarize`` catching a method that is not lossless; the packaged questions; what a JSON records."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tr_serve.bench import spec_bench
from tr_serve.bench.provenance import kernel_plan_record, template_record, template_sha256
from tr_serve.bench.report import markdown_tables, write_chart
from tr_serve.bench.spec_bench import (BenchConfig, BenchError, Method, Question, Run, read_questions,
                                       select_questions, summarize, warmup_questions)
from tr_serve.data import SPEC_BENCH_DEV
from tr_serve.runner.cpu_kernels import KernelPlan
from tr_serve.tr.tree import load_template

QUESTIONS = [
    {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?", "And of Italy?"]},
    {"question_id": 2, "category": "writing", "turns": ["Write one sentence about the sea."]},
]


def _write_questions(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("tr-serve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tr_serve.cli"]


# ---- pure helpers (no model) -------------------------------------------------------------------

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


def test_bench_bad_arguments_exit_2(tmp_path, capsys):
    q = _write_questions(tmp_path / "q.jsonl", QUESTIONS)
    assert spec_bench.main(["--questions", str(q), "--tree", "nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown tree 'nonexistent'" in err and "\n" not in err
    with pytest.raises(SystemExit) as exc:
        spec_bench.main(["--max-new-tokens", "0"])
    assert exc.value.code == 2


def test_report_on_a_synthetic_result(tmp_path):
    cat = {"qa": {"mat": 1.0, "speedup": 1.0}}
    result = {"model": "m", "device": "cpu", "questions": 1, "max_new_tokens": 8, "categories": ["qa"],
              "torch": "2.x", "transformers": "4.y", "torch_threads": 2,
              "kernel_plan": {"per_token_count": {"1": "mkl_nt", "8": "onednn"}, "above": "torch"},
              "methods": {"baseline": {"mat": 1.0, "tokens_per_s": 10.0, "speedup": 1.0, "identical": None,
                                       "reference": "baseline", "per_category": cat},
                          "tr:top4": {"mat": 2.5, "tokens_per_s": 20.0, "speedup": 2.0, "identical": True,
                                      "identical_to": "baseline", "reference": "baseline",
                                      "per_category": {"qa": {"mat": 2.5, "speedup": 2.0}},
                                      "time_split": {"forward": 0.9, "propose": 0.1}},
                          "hf-pld": {"mat": 1.5, "tokens_per_s": 6.0, "speedup": 1.2, "identical": False,
                                     "identical_to": "baseline", "reference": "hf-greedy",
                                     "per_category": {"qa": {"mat": 1.5, "speedup": 1.2}},
                                     "mismatches": [{"question_id": 7, "category": "qa", "position": 3,
                                                     "reference_token": 11, "method_token": 12,
                                                     "top2_logit_gap": 0.25}]}}}
    text = markdown_tables(result)
    assert "| baseline | 1.00 | 10.00 | 1.00x | baseline | n/a |" in text
    assert "| tr:top4 | 2.50 | 20.00 | 2.00x | baseline | yes |" in text
    assert "| hf-pld | 1.50 | 6.00 | 1.20x | hf-greedy | NO |" in text
    assert "| qa | 1.00 / 1.00x | 2.50 / 2.00x | 1.50 / 1.20x |" in text
    assert "engine kernels (tokens:kernel): 1:mkl_nt, 8:onednn, above:torch" in text
    assert ("NOT IDENTICAL hf-pld: question 7 (qa) differs from baseline at token 3: baseline 11 vs 12, "
            "top-2 logit gap 0.2500") in text
    png = write_chart(result, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- summarize: speedups against each framework's own baseline; a lossy method is caught ---------

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


# ---- tree settings, packaged questions, provenance ----------------------------------------------

@pytest.mark.parametrize("spec", ["2.2.2", "top8+ctx", "2.2.2+ctx", "auto", "chain4"])
def test_tree_settings_the_engine_accepts_are_accepted(spec):
    BenchConfig(trees=(spec,)).validate()


@pytest.mark.parametrize("spec, message", [
    ("none", "plain decoding, which the baseline method already measures"),
    ("off", "plain decoding"),
    ("pld", "measured as the method 'pld'"),
    ("+ctx", "'\\+ctx' follows a template name"),
    ("auto+ctx", "'\\+ctx' follows a template name"),
    ("nonexistent+ctx", "unknown tree 'nonexistent'"),
])
def test_tree_settings_refused(spec, message):
    with pytest.raises(BenchError, match=message):
        BenchConfig(trees=(spec,)).validate()


def test_a_tree_given_twice_is_refused():
    with pytest.raises(BenchError, match="given twice"):
        BenchConfig(trees=("top4", " top4")).validate()


def test_packaged_questions_are_the_default():
    args = spec_bench.config_from_args(_parser().parse_args([]))
    assert Path(args.questions) == SPEC_BENCH_DEV and SPEC_BENCH_DEV.is_file()
    assert SPEC_BENCH_DEV.parent.name == "data" and SPEC_BENCH_DEV.parent.parent.name == "tr_serve"
    questions = read_questions(args.questions)
    assert len(questions) == 240 and len({q.question_id for q in questions}) == 240
    assert len({q.category for q in questions}) == 13
    assert args.pld and args.hf and args.trees == ("2.2.2",)


def _parser():
    import argparse

    p = argparse.ArgumentParser()
    spec_bench.add_arguments(p)
    return p


def test_no_pld_and_no_hf_flags_drop_their_rows():
    def names(argv):
        return [m.name for m in spec_bench.build_methods(spec_bench.config_from_args(_parser().parse_args(argv)))]

    assert names(["--tree", "auto", "--tree", "top8+ctx"]) == [
        "baseline", "tr:auto", "tr:top8+ctx", "pld", "hf-greedy", "hf-pld"]
    assert names(["--no-pld"]) == ["baseline", "tr:2.2.2", "hf-greedy", "hf-pld"]
    assert names(["--no-hf"]) == ["baseline", "tr:2.2.2", "pld"]
    assert names(["--no-hf", "--no-pld", "--prompt-seeding", "both"]) == ["baseline", "tr:2.2.2", "tr:2.2.2-noseed"]


def test_provenance_records():
    assert kernel_plan_record(None) == "torch"
    plan = KernelPlan((1, 4, 16), ("mkl_nt", "onednn", "torch"))
    assert kernel_plan_record(plan) == {"per_token_count": {"1": "mkl_nt", "4": "onednn", "16": "torch"},
                                        "above": "torch"}
    padding = KernelPlan((1, 4, 16), ("mkl_nt", "onednn", "torch"))
    object.__setattr__(padding, "rows", (2, 4, 16))  # a plan that runs 1-token calls on 2 rows
    assert kernel_plan_record(padding)["padded_rows"] == {"1": 2}
    assert template_sha256([(0,), (0, 0)]) == hashlib.sha256(b"[[0], [0, 0]]").hexdigest()
    assert template_sha256([(0,), (1,)]) != template_sha256([(1,), (0,)])  # the order is part of the tree
    _, paper = load_template("2.2.2", 8)
    assert template_record("2.2.2", 8) == {"template": "2.2.2", "nodes": 80, "sha256": template_sha256(paper)}
    assert template_record("auto", 8) == template_record("2.2.2", 8)  # auto runs the default template
    assert template_record("top8+ctx", 8)["nodes"] == 8
    assert template_record("pld", 8) is None and template_record("none", 8) is None


# ---- the real thing ----------------------------------------------------------------------------

def test_bench_in_process(loaded, tmp_path):
    q = _write_questions(tmp_path / "q.jsonl", QUESTIONS)
    out = tmp_path / "out" / "bench.json"
    cfg = BenchConfig(questions=str(q), per_category=1, max_new_tokens=8, trees=("top4",), warmup=0,
                      json_out=str(out))
    result = spec_bench.run_bench(cfg, loaded=loaded, progress=False)
    assert json.loads(out.read_text()) == result
    text = markdown_tables(result)
    assert "| method | MAT | tokens/s | speedup | over | identical |" in text

    assert result["questions"] == 2 and result["max_new_tokens"] == 8
    assert result["question_ids"] == [1, 2] and result["categories"] == ["qa", "writing"]
    # how it was measured
    import transformers

    assert result["torch"] == torch.__version__ and result["transformers"] == transformers.__version__
    assert result["torch_threads"] == torch.get_num_threads()
    from tr_serve.runner.cpu_kernels import select_plan

    assert result["cpu_kernels"] == "auto" and result["kernel_plan"] == kernel_plan_record(select_plan(loaded.model))
    _, top4 = load_template("top4", 8)
    methods = result["methods"]
    assert methods["tr:top4"]["template"] == {"template": "top4", "nodes": 4, "sha256": template_sha256(top4)}

    assert list(methods) == ["baseline", "tr:top4", "pld", "hf-greedy", "hf-pld"]
    for name, m in methods.items():
        assert m["identical"] is True, (name, m.get("mismatches"))
        assert m["tokens_per_s"] > 0 and set(m["per_category"]) == {"qa", "writing"}
        # MAT is the method's own count: engine stats (accepted per step) or forward passes, less the
        # prefill's token, which is one per question: so accepted = new tokens - questions
        assert m["accepted"] == m["new_tokens"] - 2, name
        assert m["mat"] == pytest.approx(m["accepted"] / m["verification_forwards"], abs=1e-6), name
        assert m["verification_forwards"] == sum(q["verification_forwards"] for q in m["per_question"])
        ref = methods[m["reference"]]
        assert m["speedup"] == pytest.approx(m["tokens_per_s"] / ref["tokens_per_s"], rel=1e-5), name
    # plain decoding, in the engine and in transformers: one token per forward, measured
    assert methods["baseline"]["mat"] == 1.0 and methods["hf-greedy"]["mat"] == 1.0
    assert methods["baseline"]["verification_forwards"] == methods["baseline"]["new_tokens"] - 2
    assert methods["baseline"]["identical_to"] == "hf-greedy"  # the engine's greedy equals transformers'
    assert [m["reference"] for m in methods.values()] == ["baseline"] * 3 + ["hf-greedy"] * 2
    assert methods["hf-pld"]["prompt_lookup_num_tokens"] == spec_bench.HF_PLD_NUM_TOKENS
    assert methods["pld"]["tree"] == "pld" and "template" not in methods["pld"]
    # the tree drafted 4 nodes a step: a verification forward can keep at most 5 tokens
    assert all(q["accepted"] <= 5 * q["verification_forwards"] for q in methods["tr:top4"]["per_question"])
    assert set(methods["tr:top4"]["time_split"]) >= {"forward", "propose", "accept"}
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_main_writes_tables(tmp_path, capsys):
    q = _write_questions(tmp_path / "q.jsonl", QUESTIONS[:1])
    out = tmp_path / "b.json"
    rc = spec_bench.main(["--questions", str(q), "--per-category", "1", "--max-new-tokens", "4", "--tree", "top4",
                          "--warmup", "0", "--no-hf", "--no-pld", "--json", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| baseline | 1.00 |" in stdout and "| tr:top4 |" in stdout and "pld" not in stdout
    assert list(json.loads(out.read_text())["methods"]) == ["baseline", "tr:top4"]


def test_cli_generate_bad_tree_exits_2():
    proc = subprocess.run(_cli() + ["generate", "--prompt", "hi", "--tree", "nonexistent"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1 and "unknown tree 'nonexistent'" in err


def test_cli_generate_prints_text_and_mat():
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(_cli() + ["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
                                    "--tree", "top4"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    text, _, stats = proc.stdout.partition("\n--- ")
    assert text.strip(), proc.stdout
    assert "MAT:" in stats and "verification steps:" in stats and "tokens/s:" in stats
    assert "tokens:             " in stats
