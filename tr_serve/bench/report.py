"""Render a ``tr-serve bench`` result: Markdown tables and a PNG bar chart."""

from __future__ import annotations

from pathlib import Path


def _fmt(v, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _identical(m: dict) -> str:
    """yes / NO against the method it was checked with; n/a when nothing was compared."""
    if m.get("identical") is None:
        return "n/a"
    return ("yes" if m["identical"] else "NO") + (f" (vs {m['identical_to']})" if m.get("identical_to") not in
                                                   (None, "baseline") else "")


def summary_table(result: dict) -> str:
    rows = ["| method | MAT | tokens/s | speedup | over | identical |", "| --- | ---: | ---: | ---: | --- | :---: |"]
    for name, m in result["methods"].items():
        rows.append(f"| {name} | {_fmt(m['mat'])} | {_fmt(m['tokens_per_s'])} | {_fmt(m['speedup'])}x "
                    f"| {m.get('reference', 'baseline')} | {_identical(m)} |")
    return "\n".join(rows)


def category_table(result: dict) -> str:
    """One row per category, one column per method: ``MAT / speedup``."""
    methods = result["methods"]
    names = list(methods)
    cats = result.get("categories") or list(next(iter(methods.values()))["per_category"])
    rows = ["| category | " + " | ".join(f"{n} MAT / speedup" for n in names) + " |",
            "| --- |" + " ---: |" * len(names)]
    for cat in cats:
        cells = []
        for n in names:
            c = methods[n]["per_category"].get(cat)
            cells.append("-" if c is None else f"{_fmt(c['mat'])} / {_fmt(c['speedup'])}x")
        rows.append(f"| {cat} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def time_split_table(result: dict) -> str | None:
    splits = {n: m["time_split"] for n, m in result["methods"].items() if m.get("time_split")}
    if not splits:
        return None
    phases = sorted({p for s in splits.values() for p in s})
    rows = ["| method | " + " | ".join(phases) + " |", "| --- |" + " ---: |" * len(phases)]
    for n, s in splits.items():
        rows.append(f"| {n} | " + " | ".join(f"{100 * s.get(p, 0.0):.1f}%" for p in phases) + " |")
    return "\n".join(rows)


def kernels_line(result: dict) -> str | None:
    """torch / transformers versions, threads and the engine's linear kernel per token count."""
    if "torch" not in result:
        return None
    plan = result.get("kernel_plan")
    if isinstance(plan, dict):
        counts = plan.get("per_token_count", {})
        kernels = ", ".join(f"{n}:{k}" for n, k in counts.items()) + f", above:{plan.get('above')}"
    else:
        kernels = str(plan)
    return (f"torch {result['torch']}, transformers {result.get('transformers')}, {result.get('torch_threads')} "
            f"threads; engine kernels (tokens:kernel): {kernels}; hf-* run torch's own")


def markdown_tables(result: dict) -> str:
    head = (f"Spec-Bench: {result.get('model')} on {result.get('device')}, {result.get('questions')} questions, "
            f"max_new_tokens={result.get('max_new_tokens')}")
    parts = [head]
    kernels = kernels_line(result)
    if kernels:
        parts.append(kernels)
    parts += ["", summary_table(result), "", "Per category (MAT / speedup):", "", category_table(result)]
    split = time_split_table(result)
    if split:
        parts += ["", "Engine step time by phase:", "", split]
    bad = {n: m["mismatches"] for n, m in result["methods"].items() if m.get("mismatches")}
    for name, mismatches in bad.items():
        parts.append("")
        for mm in mismatches:
            ref = result["methods"][name].get("identical_to") or "baseline"
            parts.append(f"NOT IDENTICAL {name}: question {mm['question_id']} ({mm['category']}) differs from {ref} "
                         f"at token {mm.get('position')}: {ref} {mm.get('reference_token')} vs "
                         f"{mm.get('method_token')}, top-2 logit gap {_fmt(mm.get('top2_logit_gap'), 4)}")
    return "\n".join(parts)


def _chart_identical(m: dict) -> str:
    if m.get("identical") is None:
        return "reference"
    return "identical" if m["identical"] else "NOT identical"


def write_chart(result: dict, path: str | Path) -> Path:
    """Two panels (MAT per category, speedup per category); one bar group per method, one bar per
    category inside each group."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    methods = result["methods"]
    names = list(methods)
    cats = result.get("categories") or list(next(iter(methods.values()))["per_category"])
    n_cat = max(1, len(cats))
    width = 0.8 / n_cat
    cmap = plt.get_cmap("tab20" if n_cat > 10 else "tab10")
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.6 * len(names) + 0.25 * n_cat * len(names) / 2), 8.5),
                             sharex=True)
    for ax, key, title in ((axes[0], "mat", "MAT (accepted tokens per verification forward)"),
                           (axes[1], "speedup", "speedup over its framework's plain greedy decoding "
                                                "(tokens/s ratio; hf-* over hf-greedy)")):
        for ci, cat in enumerate(cats):
            xs = [mi - 0.4 + width * (ci + 0.5) for mi in range(len(names))]
            ys = [methods[n]["per_category"].get(cat, {}).get(key) or 0.0 for n in names]
            ax.bar(xs, ys, width=width, color=cmap(ci % cmap.N), label=cat)
        overall = [methods[n][key] or 0.0 for n in names]
        ax.scatter(range(len(names)), overall, marker="_", s=2400 / max(1, len(names)) ** 0.5, color="black",
                   zorder=3, label="all questions")
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title(title)
        ax.set_ylabel(key)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels([f"{n}\n{_chart_identical(methods[n])}" for n in names])
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize="small", frameon=False, markerscale=0.3)
    fig.suptitle(f"Spec-Bench: {result.get('model')} on {result.get('device')}, {result.get('questions')} questions, "
                 f"max_new_tokens={result.get('max_new_tokens')}")
    fig.tight_layout(rect=(0, 0, 0.84, 0.96))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
