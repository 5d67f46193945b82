"""``scripts/gpu_check.py``'s tensor-parallel section on gloo: the TP runner's greedy tokens equal
the local runner's, and the bytes per verification step are measured both ways (the engine sees
one runner contract: the same return, whichever runner)."""

from __future__ import annotations

import json

from script_module import load_script


def test_tp_section_matches_the_local_runner_and_counts_bytes(ray_tp, tmp_path):
    gpu_check = load_script("gpu_check")
    out = tmp_path / "tp.json"
    assert gpu_check.main(["--tiny", "--device", "cpu", "--tp", "2", "--sections", "tp", "--trees", "top4",
                           "--json", str(out)]) == 0
    sec = json.loads(out.read_text())["sections"]["tp"]
    assert sec["status"] == "passed" and sec["world_size"] == 2 and sec["tree"] == "top4"
    assert sec["tp_vs_local"]["differing"] == 0 and sec["tp_vs_local"]["outputs"] == sec["rows"] == 32
    assert sec["tp"]["verify_calls"] == sec["local"]["verify_calls"] > 0
    assert sec["tp"]["bytes_per_verify"] == sec["local"]["bytes_per_verify"] > 0
    transfer = sec["transfer"]
    assert transfer["messages_per_forward"] == 4  # one call and one reply per rank
    assert transfer["bytes_back_per_forward"] > 0 and transfer["bytes_out_per_forward"] > 0
