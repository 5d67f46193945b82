"""From the runs of every method to the ``methods`` entries of the bench JSON, and what each figure
means (``DEFINITIONS``, written into the JSON).

* ``mat``: tokens per verification forward, the prefill forward and its first token excluded. Engine
  methods: sum / count of ``RequestOutput.stats.accepted_per_step``; hf-*: (new tokens - 1) /
  (forward passes - 1).
* ``tokens_per_s``: total new tokens / total wall time of that method (``time.perf_counter``).
* ``speedup``: ``tokens_per_s`` / ``tokens_per_s`` of the method's own framework's plain greedy
  decoding in the same run (``reference``): ``baseline`` for engine methods, ``hf-greedy`` for
  hf-*. Per category: the ratio of per-category tokens/s.
* ``identical``: every output token list equals the baseline's for the same question (EOS
  included when generation stopped at EOS); the baseline's own is checked against ``hf-greedy``
  (null when the hf rows are skipped).
"""

from __future__ import annotations

from typing import Any

from tr_serve.bench.methods import Method
from tr_serve.bench.records import check_same_questions, method_entry

DEFINITIONS = {
    "mat": "tokens per verification forward, the prefill forward and its first token excluded: engine methods "
           "sum(stats.accepted_per_step) / verification steps; hf-* (new_tokens-1)/(forwards-1)",
    "tokens_per_s": "total new tokens / total perf_counter seconds of the method",
    "speedup": "tokens_per_s / tokens_per_s of 'reference' in the same run: baseline for engine methods, "
               "hf-greedy for hf-*",
    "identical": "every output token id list equals that of 'identical_to' for the same question: the baseline "
                 "for every method, hf-greedy for the baseline itself (null without the hf rows)",
    "template_sha256": "sha256 of json.dumps(list of paths) of the method's matrix template, in template order",
    "kernel_plan": "the engine methods' linear kernel per token count (the runner's KernelPlan; counts between two "
                   "points take the next point's kernel), or 'torch' for torch's own F.linear",
}


def summarize(methods: list[Method], categories: list[str]) -> dict:
    """Per method: MAT, tokens/s, speedup over its reference, ``identical`` (with a ``mismatches``
    entry per differing question: where it first differs), per category and per question."""
    by_name = {m.name: m for m in methods}
    base = by_name["baseline"]
    check_same_questions({m.name: m.runs for m in methods}, "baseline")
    out: dict[str, dict] = {}
    for m in methods:
        ref = by_name[m.reference]
        # the baseline is the reference of every other method's tokens; its own are checked against
        # transformers' greedy decoding when that ran
        check_against = by_name.get("hf-greedy") if m is base else base
        entry: dict[str, Any] = {"kind": m.kind, "reference": ref.name,
                                 "identical_to": check_against.name if check_against else None}
        if m.kind in ("tr", "pld"):
            entry["tree"] = m.tree
        if m.kind == "tr":
            entry["prompt_seeding"] = m.llm.engine.speculator.seeds_prompts if m.llm is not None else m.prompt_seeding
            entry["matrix_prior"] = m.matrix_prior
        if m.kind == "hf":
            entry["prompt_lookup_num_tokens"] = m.lookup or None
        entry.update(method_entry(m.runs, None if ref is m else ref.runs,
                                  check_against.runs if check_against else None, categories))
        out[m.name] = entry
    return out


def logit_gap_at(loaded, prompt_ids: list[int], reference: list[int], mismatch: dict) -> dict:
    """The model's top-2 logits where a method left the reference (a plain Hugging Face forward over
    prompt + common prefix): a near tie says rounding, a wide gap says a real error."""
    import torch

    pos = mismatch["position"]
    model = loaded.model
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids) + list(reference[:pos])], device=model.device)
        logits = model(ids).logits[0, -1].float()
    top = torch.topk(logits, 2)
    info = {"top2_tokens": top.indices.tolist(), "top2_logit_gap": float(top.values[0] - top.values[1])}
    for key in ("reference_token", "method_token"):
        if mismatch.get(key) is not None:
            info[key.replace("token", "logit")] = float(logits[mismatch[key]])
    return info
