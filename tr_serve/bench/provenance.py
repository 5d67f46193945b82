"""What a benchmark JSON records about how it was measured: the linear kernels the runner used, the
torch thread count and versions, and a hash of every Token Recycling template, so two results can be
compared knowing whether they ran the same code paths on the same trees."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence


def kernel_plan_record(plan) -> dict[str, Any] | str:
    """``"torch"`` when the runner uses torch's own ``F.linear`` (no plan: ``cpu_kernels="torch"``,
    a GPU, or a non-fp32 model); else the kernel the plan runs at each measured token count (a count
    between two points takes the next point's kernel), the one above the last point and, for a plan
    that pads calls to more rows (``KernelPlan.rows``), the row count of each padded point; and, where
    the panel GEMM runs, whether its 13-16-row calls take the narrow row blocks and, per count, whether
    it prefetches the weights into L2."""
    if plan is None:
        return "torch"
    points = [int(n) for n in plan.points]
    out = {"per_token_count": {str(n): plan.kernel_for(n) for n in points},
           "above": plan.kernel_for(points[-1] + 1) if points else "torch"}
    if "panel" in out["per_token_count"].values():  # the panel GEMM's settings the plan measured
        out["panel_wide_narrow"] = bool(getattr(plan, "panel_wide_narrow", True))
        l2 = getattr(plan, "panel_prefetch_l2", None)
        out["panel_prefetch_l2"] = {str(n): bool(on) for n, on in zip(points, l2)} if l2 is not None else None
    rows = getattr(plan, "rows", None)
    if rows is not None:
        padded = {str(n): int(r) for n, r in zip(points, rows) if int(r) != n}
        if padded:
            out["padded_rows"] = padded
    return out


def template_sha256(paths: Sequence[Sequence[int]]) -> str:
    """sha256 of ``json.dumps`` of the template's list of paths (each path a list of child ranks),
    in template order: the same tree in the same order gives the same hash on every machine."""
    return hashlib.sha256(json.dumps([[int(r) for r in p] for p in paths]).encode()).hexdigest()


def template_record(spec: str, k: int, budget: str = "fixed") -> dict[str, Any] | None:
    """The matrix template behind an engine ``tree`` setting (``auto`` and ``<t>+ctx`` included):
    its name, node count and :func:`template_sha256`; None when the setting drafts from no template
    (``none``, ``pld``)."""
    from tr_serve.tr.tree import load_template
    from tr_serve.tr.tree_spec import parse_tree_spec

    parsed = parse_tree_spec(spec, budget)
    if parsed.template is None:
        return None
    name, paths = load_template(parsed.template, k)
    return {"template": name, "nodes": len(paths), "sha256": template_sha256(paths)}


def environment(kernel_plan, cpu_kernels: str) -> dict[str, Any]:
    """Versions, threads and the engine's kernel plan (``Engine.runner.kernel_plan``)."""
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_kernels": cpu_kernels,
        # the engine methods' linears; transformers' generate (hf-*) always runs torch's own
        "kernel_plan": kernel_plan_record(kernel_plan),
    }
