"""``tr-serve bench --concurrency N[,N...]``: N concurrent clients through the async engine.

For each concurrency level, every method serves the same questions (greedy) with N clients that
each take the next question when their last one is done: plain continuous batching
(``baseline``), TR with the fixed 80-node tree (``tr:2.2.2``) and TR with the cost-aware budget
(``tr:auto``). Each TR method keeps its matrix across levels, as a server would (hot start).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from tr_serve.engine.async_engine import AsyncEngine
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.matrix import AdjacencyMatrix


@dataclass(frozen=True)
class ConcurrencyMethod:
    name: str
    tree: str
    budget: str = "fixed"


DEFAULT_METHODS = (ConcurrencyMethod("baseline", "none"), ConcurrencyMethod("tr:2.2.2", "2.2.2"),
                   ConcurrencyMethod("tr:auto", "2.2.2", "auto"))


@dataclass
class LevelResult:
    outputs: dict[int, list[int]] = field(default_factory=dict)  # question index -> token ids
    accepted: int = 0
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    per_request_tps: list[float] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    round_outputs: list[dict[int, list[int]]] = field(default_factory=list)  # set by _merge


def _merge(results: list[LevelResult]) -> LevelResult:
    """One result over several rounds: sums, with the first round's outputs and every round's kept."""
    merged = LevelResult(outputs=results[0].outputs, round_outputs=[r.outputs for r in results])
    for r in results:
        merged.accepted += r.accepted
        merged.steps += r.steps
        merged.tokens += r.tokens
        merged.wall_s += r.wall_s
        merged.per_request_tps += r.per_request_tps
        merged.budgets += r.budgets
    return merged


async def _serve_all(engine: AsyncEngine, prompts: list[list[int]], concurrency: int, max_new_tokens: int,
                     tag: str, on_done=None) -> LevelResult:
    result = LevelResult()
    next_index = iter(range(len(prompts)))
    params = SamplingParams(max_tokens=max_new_tokens)

    async def client() -> None:
        for i in next_index:
            t0 = time.perf_counter()
            final = None
            async for out in engine.generate(prompts[i], params, f"{tag}-{i}"):
                final = out
            dt = time.perf_counter() - t0
            result.outputs[i] = final.token_ids
            result.accepted += sum(final.stats.accepted_per_step)
            result.steps += len(final.stats.accepted_per_step)
            result.tokens += len(final.token_ids)
            result.per_request_tps.append(len(final.token_ids) / dt)
            result.budgets += final.stats.tree_nodes_per_step
            if on_done:
                on_done()

    t0 = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    result.wall_s = time.perf_counter() - t0
    return result


def run_concurrency(loaded, prompts: list[list[int]], levels: list[int], max_new_tokens: int,
                    methods=DEFAULT_METHODS, warmup: list[list[int]] | None = None, progress=None,
                    cpu_kernels: str = "auto", rounds: int = 1) -> dict:
    """Returns ``{"concurrency": {"N": {"methods": {NAME: {...}}}}}``.

    With ``rounds`` > 1 every method serves all prompts once per round, the order of the methods
    reversed every other round (A B C, C B A, ...), so slow drifts of the machine hit all methods
    alike; throughput is total tokens over total wall time, and ``identical`` holds for every round.
    Each method keeps its engine (matrix, acceptance and latency estimates) across rounds; a new
    step thread per run lets the previous one's OpenMP workers go (see engine/openmp.py).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    vocab = loaded.model.config.vocab_size
    matrices = {m.name: AdjacencyMatrix(vocab, 8) for m in methods}
    out: dict = {"concurrency": {}, "rounds": rounds}
    for n in levels:
        cores = {}
        for m in methods:
            cfg = EngineConfig(model=loaded.model_id, tree=m.tree, budget=m.budget, max_num_seqs=n,
                               max_model_len=4096, cpu_kernels=cpu_kernels)
            cores[m.name] = Engine(loaded, cfg, matrix=matrices[m.name])
        runs: dict[str, list[LevelResult]] = {m.name: [] for m in methods}
        for r in range(rounds):
            order = list(methods) if r % 2 == 0 else list(reversed(methods))
            for m in order:
                engine = AsyncEngine(cores[m.name])
                try:
                    if warmup and r == 0:
                        asyncio.run(_serve_all(engine, warmup, n, max_new_tokens, f"warm-{m.name}-{n}"))
                    runs[m.name].append(asyncio.run(_serve_all(engine, prompts, n, max_new_tokens,
                                                               f"{m.name}-{n}-r{r}", progress)))
                finally:
                    engine.shutdown()
        level = {name: _merge(results) for name, results in runs.items()}
        base = level[methods[0].name]
        table = {}
        for name, r in level.items():
            table[name] = {
                "throughput_tokens_per_s": r.tokens / r.wall_s,
                "tokens_per_s": sum(r.per_request_tps) / len(r.per_request_tps),
                "mat": r.accepted / max(1, r.steps),
                "identical": all(out_r[i] == base.outputs[i] for out_r in r.round_outputs for i in base.outputs),
                "throughput_vs_baseline": (r.tokens / r.wall_s) / (base.tokens / base.wall_s),
                "mean_tree_nodes": sum(r.budgets) / max(1, len(r.budgets)),
            }
        out["concurrency"][str(n)] = {"methods": table}
    return out


def markdown(result: dict) -> str:
    rows = ["| concurrency | method | throughput tok/s | vs baseline | per-request tok/s | MAT | mean tree nodes | identical |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for n, level in result["concurrency"].items():
        for name, m in level["methods"].items():
            rows.append(f"| {n} | {name} | {m['throughput_tokens_per_s']:.2f} | {m['throughput_vs_baseline']:.2f}x | "
                        f"{m['tokens_per_s']:.2f} | {m['mat']:.2f} | {m['mean_tree_nodes']:.1f} | "
                        f"{'yes' if m['identical'] else 'NO'} |")
    return "\n".join(rows)


def write_chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(result["concurrency"])
    names = list(next(iter(result["concurrency"].values()))["methods"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + j * width for i in range(len(levels))]
        axes[0].bar(xs, [result["concurrency"][n]["methods"][name]["throughput_tokens_per_s"] for n in levels],
                    width, label=name)
        axes[1].bar(xs, [result["concurrency"][n]["methods"][name]["mat"] for n in levels], width, label=name)
    for ax, title in zip(axes, ("throughput (tokens/s)", "MAT")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(levels))], [f"N={n}" for n in levels])
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def save(result: dict, json_path: Path) -> Path:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    png = json_path.with_suffix(".png")
    write_chart(result, png)
    return png
