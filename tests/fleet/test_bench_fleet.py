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


def _out(tokens: list[int], accepted: list[int]):
    from types import SimpleNamespace

    return SimpleNamespace(token_ids=tokens, stats=SimpleNamespace(accepted_per_step=accepted,
                                                                  mat=sum(accepted) / len(accepted)))


def test_the_target_rises_with_the_suffix_corpus_and_identical_means_every_replica_equals_plain():
    runs = {"plain": [_out([1, 2, 3, 4], [1] * 4)], "cold": [_out([1, 2, 3, 4], [2, 2])],
            "fleet_warm": [_out([1, 2, 3, 4], [3, 1])], "local_warm": [_out([1, 2, 3, 4], [4])]}
    sync = {"token_path_overhead": 0.001, "adopt_ms_max": 1.0}
    matrix_only = fleet._mat_figures(runs, sync)
    assert matrix_only["fleet_over_cold"] == 1.0 and matrix_only["targets"]["fleet_over_cold_min"] == 1.05
    runs["fleet_warm"] = [_out([1, 2, 3, 4], [4])]
    with_suffix = fleet._mat_figures(runs, sync, {"fleet_documents": 3})
    assert with_suffix["fleet_over_cold"] == 2.0 and with_suffix["targets"]["fleet_over_cold_min"] == 1.15
    assert with_suffix["identical"] and with_suffix["targets"]["met"] and with_suffix["suffix_index"]
    runs["local_warm"] = [_out([1, 2, 3, 5], [4])]
    assert not fleet._mat_figures(runs, sync, {})["identical"]


def test_the_default_tree_shares_the_suffix_index_and_trees_without_a_matrix_are_refused(tmp_path, capsys):
    from tr_serve.cli import build_parser

    assert build_parser().parse_args(["bench-fleet"]).tree == "auto"
    assert fleet.main(["--json", str(tmp_path / "o.json"), "--tree", "pld"]) == 2
    assert "drafts from the matrix" in capsys.readouterr().err
    assert fleet.main(["--json", str(tmp_path / "o.json"), "--tree", "nonsense"]) == 2
    assert "unknown tree" in capsys.readouterr().err
