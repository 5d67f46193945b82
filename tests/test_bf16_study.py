"""``scripts/bf16_study.py`` on a tiny random model (seconds, CPU): the argmax comparison, the
batch-invariance check, and a whole study in float32 and bfloat16 whose report is consistent."""

from __future__ import annotations

import json

import pytest
import torch

from script_module import load_script
from tests.tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig


@pytest.fixture(scope="module")
def study():
    return load_script("bf16_study")


def test_engine_config_validates_dtype():
    assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"
    assert EngineConfig().dtype == "auto"  # the default is unchanged: float32 on CPU
    EngineConfig(dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        EngineConfig(dtype="bf8")


def test_compare_argmax_lists_each_disagreement_with_its_gaps(study):
    one = torch.tensor([[3.0, 1.0, 0.0], [2.0, 2.0, 0.0], [0.0, 1.0, 5.0]])
    multi = one.clone()
    multi[1, 1] = 2.0625  # a tie broken the other way
    r = study.compare_argmax(one, multi, q=2)
    assert r["positions"] == 3 and r["disagreements"] == 1 and r["bit_identical_logit_rows"] == 2
    d = r["detail"][0]
    assert (d["position"], d["first_chunk"], d["one_token_argmax"], d["multi_argmax"]) == (1, True, 0, 1)
    assert d["one_token_top2_gap"] == 0.0 and d["multi_top2_gap"] == pytest.approx(0.0625)
    assert r["max_abs_logit_diff"] == pytest.approx(0.0625)


def test_batch_variant_rows(study):
    x = torch.randn(8, 4)
    assert study.batch_variant_rows(lambda h: h * 2, x, (2, 8)) == {2: 0, 8: 0}
    assert study.batch_variant_rows(lambda h: h + h.shape[0], x, (2, 8)) == {2: 2, 8: 8}


def test_tiny_study_in_both_dtypes(study, tokenizer, tmp_path):
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in
                             enumerate([("a", "one two three one two three"), ("b", "the cat sat on the mat"),
                                        ("a", "warm up text")])))

    def load(dtype):
        loaded = tiny_loaded(tokenizer)
        loaded.model.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
        return loaded

    def encode(tok, text):  # ids the tiny vocabulary holds
        return [10 + i % 500 for i in tok(text)["input_ids"]]

    result = study.run_study(load, ("float32", "bfloat16"), ("top4",), per_category=1, max_new_tokens=12,
                             query_tokens=(4, 16), questions=str(qfile), warmup=1, encode=encode,
                             log=lambda s: None, latency_rounds=1)
    json.dumps(result)
    lat = result["forward_latency_ms"]["by_dtype"]
    assert list(lat) == ["float32", "bfloat16"] and all(list(v) == ["1", "8", "80"] for v in lat.values())
    assert all(ms > 0 for v in lat.values() for ms in v.values())
    assert result["question_ids"] == [0, 1] and result["warmup_question_ids"] == [2]
    for name, d in result["dtypes"].items():
        assert d["model_dtype"] == name
        assert set(d["methods"]) == {"baseline", "tr:top4", "hf-greedy"}
        a = d["argmax_agreement"]
        assert a["replay_matches_plain"]  # the q = 1 replay is plain decoding again
        assert list(a["by_query_tokens"]) == ["4", "16"]
        for t in a["by_query_tokens"].values():
            assert t["positions"] == a["positions"] == 2 * 11
            assert t["disagreements"] == len(t["detail"])
        assert list(d["attention_batch_variant_rows"]) == ["4", "16"]
        inv = d["linear_batch_invariance"]
        assert set(inv["invariant"]) == ({"torch", "plan"} if d["kernel_plan"] else {"torch"})
    fp32 = result["dtypes"]["float32"]
    assert fp32["outputs_identical"] and fp32["methods"]["tr:top4"]["identical"]
    bf = result["dtypes"]["bfloat16"]
    assert result["bf16_default_ok"] == (bf["outputs_identical"] and all(
        t["disagreements"] == 0 for t in bf["argmax_agreement"]["by_query_tokens"].values()))
    assert "bfloat16 can be the CPU default" in study.report(result)

    only = study.run_study(load, ("float32", "bfloat16"), questions=str(qfile), decode=False, latency_rounds=1,
                           log=lambda s: None)
    assert only["dtypes"] == {} and set(only["forward_latency_ms"]["by_dtype"]) == {"float32", "bfloat16"}
    assert "forward latency" in study.report(only)
