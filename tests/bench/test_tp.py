"""``tr-serve bench-tp`` and ``bench-tp-fleet``: command line and report (the runs need a local Ray
with tensor-parallel workers: too slow for CI; tests/tp covers the TP engine itself)."""

from __future__ import annotations

import pytest

from tr_serve.bench import tp, tp_fleet


def test_both_register_on_the_cli():
    from tr_serve.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench-tp", "--tp", "3", "--questions", "2", "--max-tokens", "8", "--tree", "top4"])
    assert args.func is tp.run
    assert (args.tp, args.questions, args.max_tokens, args.tree, args.max_num_seqs, args.threads, args.json) == \
        (3, 2, 8, "top4", 4, 1, None)
    args = parser.parse_args(["bench-tp-fleet", "--tree", "2.2.2", "--sequential"])
    assert args.func is tp_fleet.run
    assert (args.config, args.per_category, args.max_tokens, args.tree, args.sequential) == \
        ("configs/smollm2-cpu-tp.yaml", 1, 48, "2.2.2", True)
    assert args.max_prompt_tokens == 400 and args.sync_interval_s == 1.0 and args.num_cpus is None


def test_bad_arguments_exit_2():
    for main, argv in ((tp.main, ["--tp", "0"]), (tp_fleet.main, ["--sync-interval-s", "0"])):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_report_lines():
    result = {"tp": 3, "questions": 2, "identical": 1, "tokens_compared": 16, "steps_tp1": 8, "steps_tp": 8,
              "mean_step_s_tp1": 0.1282, "mean_step_s_tp": 0.4221, "ray_messages_per_step_tp": 6.0,
              "bytes_out_per_step_tp": 2048.0, "bytes_back_per_step_tp": 5.21e6,
              "phase_ms_per_step_tp": {"forward": 417.4, "accept": 1.0},
              "rows": [{"question_id": 81, "tokens": 8, "identical": True, "first_difference": None, "top2_gap": None},
                       {"question_id": 83, "tokens": 8, "identical": False, "first_difference": 5,
                        "top2_gap": 1.5e-6}]}
    assert tp.format_result(result).splitlines() == [
        "q81: 8 tokens, identical",
        "q83: 8 tokens, differs at 5 (top-2 gap 1.50e-06)",
        "1/2 identical (16 tokens); mean step: tp1 128.2 ms over 8 steps, tp3 422.1 ms over 8 steps",
        "tp3 per step: 6.0 Ray messages, 2.0 kB out, 5.21 MB back; forward 417.4 ms, accept 1.0 ms",
    ]
