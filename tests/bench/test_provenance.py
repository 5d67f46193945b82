"""What a bench JSON records about how it was measured: kernel plan, template hashes."""

from __future__ import annotations

import hashlib

from tr_serve.bench.provenance import kernel_plan_record, template_record, template_sha256
from tr_serve.kernels.cpu_kernels import KernelPlan
from tr_serve.tr.tree import load_template


def test_provenance_records():
    assert kernel_plan_record(None) == "torch"
    plan = KernelPlan((1, 4, 16), ("mkl_nt", "onednn", "torch"))
    assert kernel_plan_record(plan) == {"per_token_count": {"1": "mkl_nt", "4": "onednn", "16": "torch"},
                                        "above": "torch"}
    padding = KernelPlan((1, 4, 16), ("mkl_nt", "onednn", "torch"))
    object.__setattr__(padding, "rows", (2, 4, 16))  # a plan that runs 1-token calls on 2 rows
    assert kernel_plan_record(padding)["padded_rows"] == {"1": 2}
    assert "panel_wide_narrow" not in kernel_plan_record(plan)
    panel = KernelPlan((1, 16), ("panel", "panel"), panel_wide_narrow=False, panel_prefetch_l2=(True, False))
    assert kernel_plan_record(panel) == {"per_token_count": {"1": "panel", "16": "panel"}, "above": "torch",
                                         "panel_wide_narrow": False, "panel_prefetch_l2": {"1": True, "16": False}}
    assert template_sha256([(0,), (0, 0)]) == hashlib.sha256(b"[[0], [0, 0]]").hexdigest()
    assert template_sha256([(0,), (1,)]) != template_sha256([(1,), (0,)])  # the order is part of the tree
    _, paper = load_template("2.2.2", 8)
    assert template_record("2.2.2", 8) == {"template": "2.2.2", "nodes": 80, "sha256": template_sha256(paper)}
    assert template_record("auto", 8) == template_record("2.2.2", 8)  # auto runs the default template
    assert template_record("top8+ctx", 8)["nodes"] == 8
    assert template_record("pld", 8) is None and template_record("none", 8) is None
