"""``tr-serve bench``'s command line (``tr_serve.bench.spec_bench``): arguments, the packaged questions
as the default, the methods the flags select, and a run through ``main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tr_serve.bench import spec_bench
from tr_serve.bench.methods import build_methods
from tr_serve.bench.records import read_questions
from tr_serve.data import SPEC_BENCH_DEV


def test_bench_bad_arguments_exit_2(capsys, question_file):
    q = question_file()
    assert spec_bench.main(["--questions", str(q), "--tree", "nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown tree 'nonexistent'" in err and "\n" not in err
    with pytest.raises(SystemExit) as exc:
        spec_bench.main(["--max-new-tokens", "0"])
    assert exc.value.code == 2


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
        return [m.name for m in build_methods(spec_bench.config_from_args(_parser().parse_args(argv)))]

    assert names(["--tree", "auto", "--tree", "top8+ctx"]) == [
        "baseline", "tr:auto", "tr:top8+ctx", "pld", "hf-greedy", "hf-pld"]
    assert names(["--no-pld"]) == ["baseline", "tr:2.2.2", "hf-greedy", "hf-pld"]
    assert names(["--no-hf"]) == ["baseline", "tr:2.2.2", "pld"]
    assert names(["--no-hf", "--no-pld", "--prompt-seeding", "both"]) == ["baseline", "tr:2.2.2", "tr:2.2.2-noseed"]


def test_bench_main_writes_tables(tmp_path, capsys, question_file):
    q = question_file(1)
    out = tmp_path / "b.json"
    rc = spec_bench.main(["--questions", str(q), "--per-category", "1", "--max-new-tokens", "4", "--tree", "top4",
                          "--warmup", "0", "--no-hf", "--no-pld", "--json", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| baseline | 1.00 |" in stdout and "| tr:top4 |" in stdout and "pld" not in stdout
    assert list(json.loads(out.read_text())["methods"]) == ["baseline", "tr:top4"]
