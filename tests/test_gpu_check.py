"""``scripts/gpu_check.py --tiny --device cpu``: every part runs and reports, and the report is
consistent (all query tokens and contexts, the three concurrency levels, the projection from the
MAT it says it used, and no TR / plain / generate difference in float32)."""

from __future__ import annotations

import json

import pytest

from script_module import load_script


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def test_tiny_cpu_run_reports_every_part(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.json"
    result = gpu_check.main(["--tiny", "--device", "cpu", "--trees", "top4,2.2.2", "--mat", "top4=1.6",
                             "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    by_context = result["latency_ms"]["by_context"]
    assert list(by_context) == ["64", "256"]
    for table in by_context.values():
        assert [int(q) for q in table] == list(gpu_check.QUERY_TOKENS) and all(ms > 0 for ms in table.values())

    tr = result["tr_vs_plain"]
    assert "--mat" in tr["mat_source"]
    assert list(tr["levels"]) == ["1", "8", "32"]
    for level in tr["levels"].values():
        plain = level["plain"]["step_ms"]
        assert plain > 0
        for name, mat in (("tr:top4", 1.6), ("tr:2.2.2", gpu_check.README_MAT["2.2.2"])):
            entry = level[name]
            assert entry["mat_dev"] == mat
            assert entry["speedup_projected"] == pytest.approx(mat * plain / entry["step_ms"], rel=1e-2)
    assert tr["levels"]["1"]["tr:2.2.2"]["tree_nodes"] == 80
    assert "table_speedup" in tr["levels"]["1"]["tr:top4"]

    lossless = result["losslessness"]
    n = lossless["prompts"] * lossless["new_tokens"]
    assert lossless["plain_vs_generate"]["differing"] == 0 and lossless["plain_vs_generate"]["tokens_compared"] == n
    for tree in ("top4", "2.2.2"):
        assert lossless["trees"][tree]["tr_vs_plain"] == {"differing": 0, "rate": 0.0, "first_positions": [],
                                                         "tokens_compared": n, "mean_first_position": None}


def test_mat_from_a_bench_json(gpu_check, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"methods": {"baseline": {"mat": 1.0}, "tr:top4": {"mat": 1.9},
                                             "tr:2.2.2": {"mat": 2.7}}}))
    mats, source = gpu_check.read_mat(gpu_check.parse_args(["--bench-json", str(bench)]))
    assert mats["top4"] == 1.9 and mats["2.2.2"] == 2.7 and str(bench) in source
    bench.write_text(json.dumps({"methods": {"baseline": {"mat": 1.0}}}))
    with pytest.raises(SystemExit, match="no tr:<tree>"):
        gpu_check.read_mat(gpu_check.parse_args(["--bench-json", str(bench)]))
