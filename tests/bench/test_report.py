"""Markdown tables and the chart of a bench result."""

from __future__ import annotations

from tr_serve.bench.report import markdown_tables, write_chart


def test_report_on_a_synthetic_result(tmp_path):
    cat = {"qa": {"mat": 1.0, "speedup": 1.0}}
    result = {"model": "m", "device": "cpu", "questions": 1, "max_new_tokens": 8, "categories": ["qa"],
              "torch": "2.x", "transformers": "4.y", "torch_threads": 2,
              "kernel_plan": {"per_token_count": {"1": "mkl_nt", "8": "onednn"}, "above": "torch"},
              "methods": {"baseline": {"mat": 1.0, "tokens_per_s": 10.0, "speedup": 1.0, "identical": None,
                                       "reference": "baseline", "per_category": cat},
                          "tr:top4": {"mat": 2.5, "tokens_per_s": 20.0, "speedup": 2.0, "identical": True,
                                      "identical_to": "baseline", "reference": "baseline",
                                      "per_category": {"qa": {"mat": 2.5, "speedup": 2.0}},
                                      "time_split": {"forward": 0.9, "propose": 0.1}},
                          "hf-pld": {"mat": 1.5, "tokens_per_s": 6.0, "speedup": 1.2, "identical": False,
                                     "identical_to": "baseline", "reference": "hf-greedy",
                                     "per_category": {"qa": {"mat": 1.5, "speedup": 1.2}},
                                     "mismatches": [{"question_id": 7, "category": "qa", "position": 3,
                                                     "reference_token": 11, "method_token": 12,
                                                     "top2_logit_gap": 0.25}]}}}
    text = markdown_tables(result)
    assert "| baseline | 1.00 | 10.00 | 1.00x | baseline | n/a |" in text
    assert "| tr:top4 | 2.50 | 20.00 | 2.00x | baseline | yes |" in text
    assert "| hf-pld | 1.50 | 6.00 | 1.20x | hf-greedy | NO |" in text
    assert "| qa | 1.00 / 1.00x | 2.50 / 2.00x | 1.50 / 1.20x |" in text
    assert "engine kernels (tokens:kernel): 1:mkl_nt, 8:onednn, above:torch" in text
    assert ("NOT IDENTICAL hf-pld: question 7 (qa) differs from baseline at token 3: baseline 11 vs 12, "
            "top-2 logit gap 0.2500") in text
    png = write_chart(result, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
