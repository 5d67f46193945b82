"""``tr-serve bench --latency`` on the tiny random model: the tree inputs, the min over interleaved
rounds, the JSON shape and the table."""

from __future__ import annotations

import json

import pytest
import torch

from tr_serve.bench import latency
from tr_serve.runner.model_runner import ModelRunner


def test_tree_inputs_form_a_binary_tree():
    tokens, depths, mask = latency.tree_inputs(6, vocab=50)
    assert tokens.shape == (1, 6) and int(tokens.min()) >= 10 and int(tokens.max()) < 50
    assert depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                                   [1, 1, 0, 1, 0, 0], [1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 0, 1]]
    one = latency.tree_inputs(1, vocab=50)
    assert one[1].tolist() == [0] and one[2].tolist() == [[True]]


def test_measure_keeps_the_fastest_of_interleaved_rounds(tokenizer):
    from tests.tiny_model import tiny_loaded

    runner = ModelRunner(tiny_loaded(tokenizer).model, 2, 64)
    order = []
    real_verify = runner.verify

    def verify(rows, tokens, depths, mask):
        row = int(rows[0])
        assert runner.length(row) == (8, 16)[row]  # the row holds its context
        order.append((row, tokens.shape[1]))
        return real_verify(rows, tokens, depths, mask)

    runner.verify = verify
    clock_calls, timed = [], {}

    def fake_clock():  # start stamps read 0; an end stamp returns the pair's duration in this round
        clock_calls.append(1)
        if len(clock_calls) % 2 == 1:
            return 0.0
        pair = order[-1]
        timed[pair] = timed.get(pair, 0) + 1
        if pair == (1, 2) and timed[pair] == 1:
            return 100.0  # a busy moment in round 0
        return 5.0 + timed[pair]  # otherwise each round 1 tick slower than the last

    seconds = latency.measure_latency(runner, (8, 16), (1, 2), rounds=3, clock=fake_clock)
    pairs = [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert order[:4] == pairs  # untimed warm-up of every pair
    assert order[4:8] == pairs and order[8:12] == pairs[::-1] and order[12:16] == pairs  # interleaved rounds
    assert len(order) == 16 and all(n == 3 for n in timed.values())
    assert seconds == {8: {1: 6.0, 2: 6.0}, 16: {1: 6.0, 2: 7.0}}  # min per pair; the 100 is dropped
    assert runner.length(0) == runner.length(1) == 0  # rows freed


def test_measure_rejects_too_few_rows_or_too_short_rows(tokenizer):
    from tests.tiny_model import tiny_loaded

    runner = ModelRunner(tiny_loaded(tokenizer).model, 1, 32)
    with pytest.raises(ValueError, match="rows"):
        latency.measure_latency(runner, (8, 16), (1,), rounds=1)
    with pytest.raises(ValueError, match="max_len"):
        latency.measure_latency(runner, (30,), (4,), rounds=1)


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
def test_result_json_shape_and_table(tokenizer, tmp_path, monkeypatch, cpu_kernels):
    from tests.tiny_model import tiny_loaded

    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "cache"))
    loaded = tiny_loaded(tokenizer, seed=4)
    result = latency.run_latency(loaded, cpu_kernels=cpu_kernels, contexts=(32, 16), query_tokens=(4, 1, 2), rounds=2)
    path = tmp_path / "out" / "latency.json"
    latency.save(result, path)
    data = json.loads(path.read_text())
    assert set(data["latency_ms"]) == {"16", "32"}
    for ctx in ("16", "32"):
        assert list(data["latency_ms"][ctx]) == ["1", "2", "4"]
        assert all(isinstance(v, float) and v > 0 for v in data["latency_ms"][ctx].values())
        assert data["ratio_to_1"][ctx]["1"] == 1.0
    assert data["contexts"] == [16, 32] and data["query_tokens"] == [1, 2, 4] and data["rounds"] == 2
    assert data["torch"] == torch.__version__ and data["torch_threads"] == torch.get_num_threads()
    assert data["cpu_kernels"] == cpu_kernels and data["model"] == "tiny-random-llama"
    if cpu_kernels == "torch":
        assert data["kernel_plan"] == "torch"
    else:
        assert set(data["kernel_plan"]["per_token_count"]) >= {"1", "2", "4"}
    for ctx in ("16", "32"):  # the arithmetic of each forward, and what it ran at
        for q in ("1", "2", "4"):
            assert data["achieved_gflops"][ctx][q] == pytest.approx(
                data["flops"][ctx][q] / data["latency_ms"][ctx][q] / 1e6, rel=0.01, abs=0.002)
        assert data["flops"][ctx]["1"] < data["flops"][ctx]["2"] < data["flops"][ctx]["4"]
    assert data["flops"]["16"]["4"] < data["flops"]["32"]["4"]  # a longer prefix: more keys to attend
    peak = data["peak_gflops"]  # a float32 CPU model: its floor at the measured peak
    if peak is not None:
        assert data["floor_ms"]["32"]["4"] == pytest.approx(data["flops"]["32"]["4"] / peak / 1e6, rel=0.01, abs=1e-3)
        assert data["floor_ratio_to_1"]["32"]["4"] == pytest.approx(
            data["floor_ms"]["32"]["4"] / data["latency_ms"]["32"]["1"], rel=0.01, abs=2e-3)
    table = latency.markdown(data)
    floor_cols = " | floor (ms) | floor/t(1)" if peak is not None else ""
    assert table.splitlines()[0].startswith(
        f"| query tokens | ctx 16 (ms) | t(q)/t(1) | GFLOP/s{floor_cols} | ctx 32 (ms)")
    assert ("GFLOPS with" in table) == (peak is not None)
    assert len([line for line in table.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")
                or line.startswith("| 4 ")]) == 3
    assert f"{data['torch_threads']} threads" in table


def test_bench_latency_flag_dispatches(monkeypatch):
    from tr_serve import cli

    seen = []
    monkeypatch.setattr(latency, "execute", lambda args: seen.append(args) or 0)
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--latency", "--threads", "2", "--json", "x.json"])
    assert args.func(args) == 0
    assert seen and seen[0].latency and seen[0].threads == 2 and seen[0].json_out == "x.json"
    assert parser.parse_args(["bench"]).latency is False


def test_table_names_padded_counts():
    result = {"contexts": [256], "query_tokens": [1, 2], "latency_ms": {"256": {"1": 30.0, "2": 31.5}},
              "ratio_to_1": {"256": {"1": 1.0, "2": 1.05}}, "rounds": 3, "model": "m", "device": "cpu",
              "dtype": "float32", "torch_threads": 2, "torch": "2.x", "transformers": "5.x",
              "kernel_plan": {"per_token_count": {"1": "mkl_nt", "2": "onednn"}, "above": "torch",
                              "padded_rows": {"2": 4}}}
    table = latency.markdown(result).splitlines()
    assert table[2] == "| 1 | 30.0 | 1.00 |" and table[3] == "| 2 | 31.5 | 1.05 |"
    assert table[-1].endswith("kernels (tokens:kernel): 1:mkl_nt, 2:onednn; padded to 2->4 rows")
