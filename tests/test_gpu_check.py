"""``scripts/gpu_check.py --tiny --device cpu``: every section runs and reports consistently, the
exit status says whether it passed (a broken tree mask, a refused attention kernel and a section
that raises each fail it), the JSON is written after every section, and the check runs under the
pinned transformers and under 5.17 (the GPU image's), each in a fresh process."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from script_module import SCRIPTS, load_script

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# `make setup` installs transformers 5.17 there (the Makefile's GPU_IMAGE_TRANSFORMERS_DIR); `make test` says
# where (a relative path is the repository's)
GPU_IMAGE_TRANSFORMERS = PROJECT_ROOT / os.environ.get("TR_SERVE_GPU_IMAGE_TRANSFORMERS", ".venv/transformers-5.17")
GPU_IMAGE_VERSION = "5.17.0"
SUBPROCESS_TIMEOUT_S = 120  # the check itself takes seconds; this only stops a hung run


@pytest.fixture(scope="module")
def gpu_check():
    return load_script("gpu_check")


def _sections(result: dict) -> dict:
    return result["sections"]


def test_tiny_cpu_run_passes_and_reports_every_section(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--tiny", "--device", "cpu", "--trees", "top4,2.2.2", "--mat", "top4=1.6",
                           "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0 and result["passed"] and result["failures"] == []
    assert result["env"]["runner_forward"].startswith("compact")  # the path GPUs take
    sections = _sections(result)
    assert [s["status"] for s in sections.values()] == ["passed", "passed", "passed", "passed", "skipped"]
    assert all(c["passed"] for s in sections.values() for c in s.get("checks", []) if c["gating"])

    latency = sections["latency"]
    assert list(latency["by_context"]) == ["64", "256"]
    for ctx, table in latency["by_context"].items():
        assert [int(q) for q in table] == list(gpu_check.QUERY_TOKENS) and all(ms > 0 for ms in table.values())
        sizes = latency["bytes_returned"][ctx]
        assert all(sizes[str(q)] > 0 for q in gpu_check.QUERY_TOKENS)
        assert latency["kernels"][ctx] and "math" not in latency["kernels"][ctx]

    engine = sections["engine"]
    assert "--mat" in engine["mat_source"] and engine["kernels"] and "math" not in engine["kernels"]
    assert list(engine["levels"]) == ["1", "8", "32"]
    for rows, level in engine["levels"].items():
        assert sorted(level) == sorted(f"{m} {mode}" for m in ("plain", "tr:top4", "tr:2.2.2")
                                       for mode in ("greedy", "sampled"))
        for mode in ("greedy", "sampled"):
            plain = level[f"plain {mode}"]
            assert plain["step_ms"] > 0 and plain["bytes_per_verify"] > 0 and plain["kernels"]
            for name, mat in (("tr:top4", 1.6), ("tr:2.2.2", gpu_check.EARLIER_CPU_MAT["2.2.2"])):
                entry = level[f"{name} {mode}"]
                assert entry["mat_dev"] == mat
                assert entry["speedup_projected"] == pytest.approx(mat * plain["step_ms"] / entry["step_ms"], rel=1e-2)
                assert entry["bytes_per_verify"] > plain["bytes_per_verify"]  # a tree returns more than one node
                assert entry["vs_plain"]["outputs"] == int(rows)
        assert level["tr:2.2.2 greedy"]["tree_nodes"] == 80
    assert "table_speedup" in engine["levels"]["1"]["tr:top4 greedy"]
    assert "peak_gpu_memory_gb" not in engine  # CPU: nothing to report

    lossless = sections["losslessness"]["by_dtype"]
    assert list(lossless) == ["float32"] and lossless["float32"]["gating"]
    report = lossless["float32"]
    n = sections["losslessness"]["prompts"] * sections["losslessness"]["new_tokens"]
    assert report["plain_vs_generate"]["differing"] == 0 and report["plain_vs_generate"]["tokens_compared"] == n
    for tree in ("top4", "2.2.2"):
        for key in ("greedy_vs_plain", "sampled_vs_plain"):
            assert report["trees"][tree][key] == {"differing": 0, "outputs": 4, "first_positions": [],
                                                  "tokens_compared": n}
    assert sections["tp"]["reason"].startswith("no --tp")
    audit = result["step_audit"]  # the compiled step, counted on the stand-in device
    assert audit == {"graph_breaks": 0, "recompiles_after_warmup": 0, "h2d_copies_per_step": 1,
                     "d2h_copies_per_step": 1, "new_shapes_after_warmup": audit["new_shapes_after_warmup"]}
    assert sections["step_audit"]["steps"] > 0 and sections["step_audit"]["shapes_warmed"] > 0


def test_a_broken_tree_mask_fails_the_check(gpu_check, tmp_path, monkeypatch):
    """Tree nodes that see every node (siblings, descendants): TR's tokens part from plain
    decoding's, greedy and sampled, and the run fails; plain decoding itself still equals generate."""
    from tr_serve.runner.decoder_runner import DecoderRunner

    verify = DecoderRunner.verify_step

    def sees_everything(self, rows, tokens, depths, tree_mask, lengths, sampling):
        return verify(self, rows, tokens, depths, torch.ones_like(tree_mask), lengths, sampling)

    monkeypatch.setattr(DecoderRunner, "verify_step", sees_everything)
    out = tmp_path / "broken.json"
    assert gpu_check.main(["--tiny", "--device", "cpu", "--sections", "losslessness", "--trees", "top4",
                           "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    checks = {c["name"]: c for c in _sections(result)["losslessness"]["checks"]}
    assert checks["float32: plain decoding == generate (greedy)"]["passed"]
    assert not checks["float32: tr:top4 == plain (greedy)"]["passed"]
    assert not checks["float32: tr:top4 == plain (sampled, same seeds)"]["passed"]
    assert _sections(result)["losslessness"]["status"] == "failed" and not result["passed"]
    assert any("tr:top4 == plain (greedy)" in f for f in result["failures"])
    gaps = checks["float32: tr:top4 == plain (greedy)"]["detail"]["top2_gaps"]
    assert gaps and all(g >= 0 for g in gaps)  # the diagnosis: the reference's margin where they part


def test_a_refused_attention_kernel_is_reported_and_fails(gpu_check, tmp_path, monkeypatch):
    """Only a kernel this device lacks is allowed (as when a GPU would fall back to math): the
    guarded sections raise, say so, and the run fails; lifting the guard lets them run."""
    monkeypatch.setattr(gpu_check, "FUSED_SDPA", ("CUDNN_ATTENTION",))
    out = tmp_path / "guarded.json"
    args = ["--tiny", "--device", "cpu", "--sections", "latency,engine", "--trees", "top4", "--json", str(out)]
    assert gpu_check.main(args) == 1
    sections = _sections(json.loads(out.read_text()))
    for name in ("latency", "engine"):
        assert sections[name]["status"] == "error" and sections[name]["math_fallback_refused"]
    assert gpu_check.main(args + ["--allow-math-attention"]) == 0


def test_json_is_written_after_every_section(gpu_check, tmp_path, monkeypatch):
    """A section that dies leaves the earlier sections' results on disk, and its error."""
    out = tmp_path / "partial.json"
    seen = {}

    def dies(rep, sec, *args):
        seen["on_disk"] = json.loads(out.read_text())  # what a kill at this point would leave
        raise MemoryError("out of memory in the middle of the section")

    monkeypatch.setattr(gpu_check, "losslessness_section", dies)
    assert gpu_check.main(["--tiny", "--device", "cpu", "--sections", "latency,losslessness", "--trees", "top4",
                           "--json", str(out)]) == 1
    before = _sections(seen["on_disk"])
    assert before["latency"]["status"] == "passed" and before["latency"]["by_context"]
    assert before["losslessness"]["status"] == "running"
    after = json.loads(out.read_text())
    assert _sections(after)["losslessness"]["status"] == "error"
    assert "out of memory" in _sections(after)["losslessness"]["error"] and not after["passed"]


def test_a_run_out_of_time_fails(gpu_check, tmp_path):
    out = tmp_path / "late.json"
    assert gpu_check.main(["--tiny", "--device", "cpu", "--sections", "latency", "--time-budget-s", "0",
                           "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert _sections(result)["latency"]["status"] == "out of time" and "time budget" in result["failures"][0]


def test_returned_bytes_sum_the_tensors_of_any_return_type(gpu_check):
    @dataclasses.dataclass
    class Output:  # the shape the runner's return is moving to: id tensors in a small dataclass
        tokens: torch.Tensor
        top_k: torch.Tensor
        sampled: torch.Tensor | None = None

    out = Output(torch.zeros(32, 81, dtype=torch.int32), torch.zeros(32, 81, 8, dtype=torch.int32))
    assert gpu_check.returned_bytes(out) == 32 * 81 * 4 * 9
    logits = torch.zeros(2, 3, 5)
    assert gpu_check.returned_bytes(logits) == 2 * 3 * 5 * 4
    assert gpu_check.returned_bytes((logits, [logits.half()], None)) == 120 + 60


def test_mat_from_a_bench_json(gpu_check, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"methods": {"baseline": {"mat": 1.0}, "tr:top4": {"mat": 1.9},
                                             "tr:2.2.2": {"mat": 2.7}}}))
    mats, source = gpu_check.read_mat(gpu_check.parse_args(["--bench-json", str(bench)]))
    assert mats["top4"] == 1.9 and mats["2.2.2"] == 2.7 and str(bench) in source
    bench.write_text(json.dumps({"methods": {"baseline": {"mat": 1.0}}}))
    with pytest.raises(SystemExit, match="no tr:<tree>"):
        gpu_check.read_mat(gpu_check.parse_args(["--bench-json", str(bench)]))


# ---- under both transformers versions, each in a fresh process -------------------------------------
def _installed_version(name: str, folder: Path) -> str | None:
    """The version of ``name`` a process with ``folder`` first on its path imports."""
    for dist in importlib.metadata.distributions(name=name, path=[str(folder)]):
        return dist.version
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _unsatisfied(folder: Path) -> list[str]:
    """The requirements of the distributions in ``folder`` that neither ``folder`` nor this
    environment satisfies (markers evaluated here; extras left out)."""
    bad = []
    for dist in importlib.metadata.distributions(path=[str(folder)]):
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            found = _installed_version(req.name, folder)
            if found is None or not req.specifier.contains(found, prereleases=True):
                bad.append(f"{dist.metadata['Name']} needs {req}, found {found}")
    return bad


@pytest.mark.parametrize("which", ["pinned", "gpu-image"])
def test_the_check_passes_under_both_transformers_versions(which, tmp_path):
    paths = [str(PROJECT_ROOT)]
    if which == "gpu-image":
        if not (GPU_IMAGE_TRANSFORMERS / "transformers").is_dir():
            pytest.fail(f"transformers {GPU_IMAGE_VERSION} is not installed at {GPU_IMAGE_TRANSFORMERS}: "
                        "run `make setup` (its GPU_IMAGE_TRANSFORMERS install)")
        assert _unsatisfied(GPU_IMAGE_TRANSFORMERS) == []
        paths.insert(0, str(GPU_IMAGE_TRANSFORMERS))
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths + inherited))
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--tiny", "--device", "cpu",
                           "--trees", "top4,2.2.2", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"]
    tf = result["env"]
    if which == "gpu-image":
        assert tf["transformers"] == GPU_IMAGE_VERSION
        assert Path(tf["transformers_path"]).resolve().is_relative_to(GPU_IMAGE_TRANSFORMERS.resolve())
        assert tf["cache_keyword"] == "past_key_values"
    else:
        assert tf["transformers"] == importlib.metadata.version("transformers")
        assert Requirement(next(r for r in importlib.metadata.requires("tr_serve") if r.startswith("transformers"))
                           ).specifier.contains(tf["transformers"])
        assert tf["cache_keyword"] == "cache"
