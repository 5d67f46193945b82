"""The concurrency benchmark: schema, identical outputs, every method served every question."""

from __future__ import annotations

import json

from tiny_model import tiny_loaded
from tr_serve.bench.concurrency import markdown, run_concurrency, save


def test_concurrency_bench_schema_and_identity(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "cache"))  # calibration of the tiny model
    loaded = tiny_loaded(tokenizer, seed=3)
    prompts = [[5 + i, 40 + 3 * i, 200 + i, 7] for i in range(5)]
    result = run_concurrency(loaded, prompts, [1, 3], max_new_tokens=12, warmup=prompts[:2])
    assert set(result["concurrency"]) == {"1", "3"}
    for level in result["concurrency"].values():
        methods = level["methods"]
        assert set(methods) == {"baseline", "tr:2.2.2", "tr:auto"}
        for m in methods.values():
            assert m["identical"] is True
            assert m["throughput_tokens_per_s"] > 0 and m["tokens_per_s"] > 0 and m["mat"] >= 1.0
        assert methods["baseline"]["mat"] == 1.0 and methods["baseline"]["mean_tree_nodes"] == 0
        assert methods["tr:2.2.2"]["mean_tree_nodes"] == 80
    png = save(result, tmp_path / "c.json")
    assert png.exists() and json.loads((tmp_path / "c.json").read_text())["concurrency"]
    assert "tr:auto" in markdown(result)


def test_rounds_serve_every_question_once_per_round_and_stay_identical(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "cache"))
    loaded = tiny_loaded(tokenizer, seed=4)
    prompts = [[9 + i, 60 + 2 * i, 300 + i] for i in range(4)]
    done = []
    result = run_concurrency(loaded, prompts, [2], max_new_tokens=8, rounds=3, progress=lambda: done.append(1))
    assert result["rounds"] == 3 and len(done) == 3 * 3 * len(prompts)  # methods x rounds x questions
    for m in result["concurrency"]["2"]["methods"].values():
        assert m["identical"] is True
