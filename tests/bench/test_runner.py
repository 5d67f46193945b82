"""``run_bench`` in process on the real embedded model and a tiny question file: what the JSON holds."""

from __future__ import annotations

import json

import pytest
import torch

from tr_serve.bench.config import BenchConfig
from tr_serve.bench.methods import HF_PLD_NUM_TOKENS
from tr_serve.bench.provenance import kernel_plan_record, template_sha256
from tr_serve.bench.report import markdown_tables
from tr_serve.bench.runner import run_bench
from tr_serve.tr.tree import load_template


def test_bench_in_process(loaded, tmp_path, question_file):
    q = question_file()
    out = tmp_path / "out" / "bench.json"
    cfg = BenchConfig(questions=str(q), per_category=1, max_new_tokens=8, trees=("top4",), warmup=0,
                      json_out=str(out))
    result = run_bench(cfg, loaded=loaded, progress=False)
    assert json.loads(out.read_text()) == result
    text = markdown_tables(result)
    assert "| method | MAT | tokens/s | speedup | over | identical |" in text

    assert result["questions"] == 2 and result["max_new_tokens"] == 8
    assert result["question_ids"] == [1, 2] and result["categories"] == ["qa", "writing"]
    # how it was measured
    import transformers

    assert result["torch"] == torch.__version__ and result["transformers"] == transformers.__version__
    assert result["torch_threads"] == torch.get_num_threads()
    from tr_serve.kernels.kernel_autotune import select_plan

    assert result["cpu_kernels"] == "auto" and result["kernel_plan"] == kernel_plan_record(select_plan(loaded.model))
    _, top4 = load_template("top4", 8)
    methods = result["methods"]
    assert methods["tr:top4"]["template"] == {"template": "top4", "nodes": 4, "sha256": template_sha256(top4)}

    assert list(methods) == ["baseline", "tr:top4", "pld", "hf-greedy", "hf-pld"]
    for name, m in methods.items():
        assert m["identical"] is True, (name, m.get("mismatches"))
        assert m["tokens_per_s"] > 0 and set(m["per_category"]) == {"qa", "writing"}
        # MAT is the method's own count: engine stats (accepted per step) or forward passes, less the
        # prefill's token, which is one per question: so accepted = new tokens - questions
        assert m["accepted"] == m["new_tokens"] - 2, name
        assert m["mat"] == pytest.approx(m["accepted"] / m["verification_forwards"], abs=1e-6), name
        assert m["verification_forwards"] == sum(q["verification_forwards"] for q in m["per_question"])
        ref = methods[m["reference"]]
        assert m["speedup"] == pytest.approx(m["tokens_per_s"] / ref["tokens_per_s"], rel=1e-5), name
    # plain decoding, in the engine and in transformers: one token per forward, measured
    assert methods["baseline"]["mat"] == 1.0 and methods["hf-greedy"]["mat"] == 1.0
    assert methods["baseline"]["verification_forwards"] == methods["baseline"]["new_tokens"] - 2
    assert methods["baseline"]["identical_to"] == "hf-greedy"  # the engine's greedy equals transformers'
    assert [m["reference"] for m in methods.values()] == ["baseline"] * 3 + ["hf-greedy"] * 2
    assert methods["hf-pld"]["prompt_lookup_num_tokens"] == HF_PLD_NUM_TOKENS
    assert methods["pld"]["tree"] == "pld" and "template" not in methods["pld"]
    # the tree drafted 4 nodes a step: a verification forward can keep at most 5 tokens
    assert all(q["accepted"] <= 5 * q["verification_forwards"] for q in methods["tr:top4"]["per_question"])
    assert set(methods["tr:top4"]["time_split"]) >= {"forward", "propose", "accept"}
    png = out.with_suffix(".png")
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
