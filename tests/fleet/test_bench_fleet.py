"""``tr-serve bench-fleet``: command line (the run itself is too slow for CI; the question split is in
tests/bench/test_questions.py)."""

from __future__ import annotations

import pytest

from tr_serve.bench import fleet


def test_parser_registers_on_the_cli_subparsers():
    from tr_serve.cli import build_parser

    parser = build_parser()  # the CLI registers bench-fleet itself
    args = parser.parse_args(["bench-fleet", "--questions", "q.jsonl", "--json", "out.json", "--per-category", "2",
                              "--max-new-tokens", "16", "--tree", "top8"])
    assert args.func is fleet.run
    assert (args.questions, args.json_out, args.per_category, args.max_new_tokens, args.tree) == \
        ("q.jsonl", "out.json", 2, 16, "top8")
    assert args.sync_interval_s == 2.0 and args.snapshot_dir is None


def test_bad_arguments_exit_2_with_one_line(capsys, tmp_path):
    assert fleet.main(["--json", str(tmp_path / "out.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--json must name a .json file" in err
    assert fleet.main(["--json", str(tmp_path / "o.json"), "--questions", str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert fleet.main(["--json", str(tmp_path / "o.json"), "--tree", "none"]) == 2
    with pytest.raises(SystemExit) as e:
        fleet.main(["--per-category", "0"])
    assert e.value.code == 2
