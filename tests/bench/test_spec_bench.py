"""``tr-serve bench`` (in process, real embedded model, tiny question file) and ``tr-serve generate``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tr_serve.bench import spec_bench
from tr_serve.bench.report import markdown_tables, write_chart
from tr_serve.bench.spec_bench import BenchError, Question, read_questions, select_questions, warmup_questions

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
              "methods": {"baseline": {"mat": 1.0, "tokens_per_s": 10.0, "speedup": 1.0, "identical": True,
                                       "per_category": cat},
                          "tr:top4": {"mat": 2.5, "tokens_per_s": 20.0, "speedup": 2.0, "identical": True,
                                      "per_category": {"qa": {"mat": 2.5, "speedup": 2.0}},
                                      "time_split": {"forward": 0.9, "propose": 0.1}}}}
    text = markdown_tables(result)
    assert "| tr:top4 | 2.50 | 20.00 | 2.00x | yes |" in text
    assert "| qa | 1.00 / 1.00x | 2.50 / 2.00x |" in text
    png = write_chart(result, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the real thing ----------------------------------------------------------------------------

def test_bench_in_process(tmp_path, capsys):
    q = _write_questions(tmp_path / "q.jsonl", QUESTIONS)
    out = tmp_path / "out" / "bench.json"
    rc = spec_bench.main(["--questions", str(q), "--per-category", "1", "--max-new-tokens", "8",
                          "--tree", "top4", "--warmup", "0", "--json", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| method | MAT | tokens/s | speedup | identical |" in stdout
    assert "| baseline | 1.00 |" in stdout

    result = json.loads(out.read_text())
    assert isinstance(result["model"], str) and isinstance(result["device"], str)
    assert result["questions"] == 2 and result["max_new_tokens"] == 8
    methods = result["methods"]
    assert list(methods) == ["baseline", "tr:top4", "pld"]
    for name, m in methods.items():
        for key in ("mat", "tokens_per_s", "speedup"):
            assert isinstance(m[key], float), (name, key)
        assert m["tokens_per_s"] > 0
        assert m["identical"] is True, (name, m.get("mismatches"))
        assert set(m["per_category"]) == {"qa", "writing"}
        for c in m["per_category"].values():
            assert isinstance(c["mat"], float) and isinstance(c["speedup"], float)
        assert m["mat"] >= 1.0
    assert methods["baseline"]["speedup"] == 1.0 and methods["baseline"]["mat"] == 1.0
    assert all(c["speedup"] == 1.0 for c in methods["baseline"]["per_category"].values())
    assert set(methods["tr:top4"]["time_split"]) >= {"forward", "propose", "accept"}
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
