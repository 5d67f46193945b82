"""``tr-serve bench --concurrency N[,N...]``: N concurrent clients through the async engine.

For each concurrency level, every method serves the same questions (greedy) with N clients that
each take the next question when their last one is done: plain continuous batching (``baseline``),
prompt lookup through the same engine (``pld``), TR with the paper's 80-node tree (``tr:2.2.2``)
and TR with the cost-aware budget (``tr:auto``). Each method is one engine for the whole run, sized
for the highest level (N clients keep at most N of its rows busy), so a TR method keeps its matrix
and its budget's estimates (acceptance, step latency) across levels and rounds, as one server under
changing load would (hot start).

Because a kept matrix has recycled every answer it produced, and greedy answers repeat exactly, a
question is never served twice into it: every level and every round (and each level's warm-up)
gets its own slice of the question pool (:func:`plan_levels`), and the JSON records the question
ids of each. All methods serve the same slice at a given level and round, so their outputs can be
compared token for token. A round of level N serves at least ``--questions-per-client`` x N
questions (default 3), so that N requests stay in flight for most of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tr_serve.engine.async_engine import AsyncEngine
from tr_serve.engine.timing import PhaseTimer
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.tree_spec import is_plain


@dataclass(frozen=True)
class ConcurrencyMethod:
    name: str
    tree: str
    budget: str = "fixed"


DEFAULT_METHODS = (ConcurrencyMethod("baseline", "none"), ConcurrencyMethod("pld", "pld"),
                   ConcurrencyMethod("tr:2.2.2", "2.2.2"), ConcurrencyMethod("tr:auto", "auto"))


def methods_for(trees: Sequence[str] | None = None, pld: bool = True) -> tuple[ConcurrencyMethod, ...]:
    """``baseline``, ``pld`` (unless ``pld`` is False) and ``tr:<spec>`` per tree setting (default:
    ``2.2.2`` and ``auto``)."""
    out = [ConcurrencyMethod("baseline", "none")]
    if pld:
        out.append(ConcurrencyMethod("pld", "pld"))
    out += [ConcurrencyMethod(f"tr:{t.strip()}", t.strip()) for t in (trees or ("2.2.2", "auto"))]
    return tuple(out)


class TooFewQuestionsError(ValueError):
    """The question pool cannot give every level, round and warm-up questions of its own."""


@dataclass
class LevelPlan:
    """What one concurrency level serves: ``rounds[r]`` in round r, ``warmup`` untimed first. Items
    have ``question_id`` and ``prompt_ids`` (``records.Question``)."""

    rounds: list[list[Any]]
    warmup: list[Any] = field(default_factory=list)


def interleave_by_category(questions: Sequence[Any]) -> list[Any]:
    """Round robin over the categories (in order of first appearance), questions in file order:
    every stretch of the result mixes the categories."""
    by_cat: "OrderedDict[str, list]" = OrderedDict()
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    out, depth = [], 0
    while len(out) < len(questions):
        out += [qs[depth] for qs in by_cat.values() if depth < len(qs)]
        depth += 1
    return out


def level_size(level: int, per_run: int, per_client: int) -> int:
    """Questions one round of ``level`` serves: ``per_run``, and at least ``per_client`` per client.

    Why: N clients keep N requests in flight only while questions are left. With fewer questions
    than clients the "level" is one static batch whose wall time is its slowest request (at 16
    clients over 13 questions every method waited on its last row), not N concurrent clients."""
    return max(per_run, per_client * level)


def plan_levels(pool: Sequence[Any], levels: Sequence[int], rounds: int, per_run: int,
                warmup: int = 0, per_client: int = 0) -> dict[int, LevelPlan]:
    """Split ``pool`` so that each (level, round) serves :func:`level_size` questions of its own
    and each level warms up on ``warmup`` more; no question appears twice. The first questions of
    the pool are dealt to the slices so that each holds the categories in proportion to its size
    (a question goes to the open slice with the fewest of its category for its size); warm-ups
    come from the questions after them."""
    if rounds < 1 or per_run < 1 or warmup < 0 or per_client < 0 or not levels:
        raise ValueError(f"need levels, rounds >= 1, per_run >= 1, warmup >= 0, per_client >= 0 (got {list(levels)}, "
                         f"{rounds}, {per_run}, {warmup}, {per_client})")
    if len(set(levels)) != len(levels):
        raise ValueError(f"concurrency levels repeat: {list(levels)}")
    sizes = [level_size(level, per_run, per_client) for level in levels for _ in range(rounds)]
    measured = sum(sizes)
    needed = measured + len(levels) * warmup
    if len(pool) < needed:
        per_level = ", ".join(f"{level}: {sizes[i * rounds]}" for i, level in enumerate(levels))
        raise TooFewQuestionsError(
            f"too few questions: {len(levels)} levels x {rounds} rounds (questions per round by level: {per_level}), "
            f"plus {warmup} warm-up per level, need {needed} distinct questions and the pool has {len(pool)} (a "
            "question served twice would meet a matrix that recycled its own answer); lower --per-category, "
            "--questions-per-client, --rounds, --warmup or the number of levels, or give a larger --questions file")
    ids = [q.question_id for q in pool[:needed]]
    if len(set(ids)) != len(ids):
        raise ValueError("the question pool repeats a question id")
    slices: list[list[Any]] = [[] for _ in sizes]
    counts: list[dict[Any, int]] = [{} for _ in sizes]  # per slice: questions of each category
    for q in pool[:measured]:  # to the open slice with the least of q's category for its size
        cat = q.category
        s = min((i for i in range(len(sizes)) if len(slices[i]) < sizes[i]),
                key=lambda i: (counts[i].get(cat, 0) / sizes[i], len(slices[i]) / sizes[i], i))
        slices[s].append(q)
        counts[s][cat] = counts[s].get(cat, 0) + 1
    spare = list(pool[measured:needed])
    out: dict[int, LevelPlan] = {}
    for li, level in enumerate(levels):
        out[level] = LevelPlan(slices[li * rounds:(li + 1) * rounds], spare[li * warmup:(li + 1) * warmup])
    return out


@dataclass
class LevelResult:
    outputs: list[list[int]] = field(default_factory=list)  # per question of the slice, token ids
    accepted: int = 0
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    per_request_tps: list[float] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)


def _merge(results: list[LevelResult]) -> LevelResult:
    """One result over several rounds: sums (outputs stay per round in ``results``)."""
    merged = LevelResult()
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
    result = LevelResult(outputs=[[] for _ in prompts])
    next_index = iter(range(len(prompts)))
    params = SamplingParams(max_tokens=max_new_tokens)

    async def client() -> None:
        for i in next_index:
            t0 = time.perf_counter()
            final = None
            async for out in engine.generate(prompts[i], params, f"{tag}-{i}"):
                final = out
            dt = time.perf_counter() - t0
            result.outputs[i] = list(final.token_ids)
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


def _check_distinct(schedule: dict[int, LevelPlan]) -> None:
    seen: dict[Any, str] = {}
    for level, plan in schedule.items():
        named = [(f"level {level} warm-up", q) for q in plan.warmup]
        named += [(f"level {level} round {r}", q) for r, qs in enumerate(plan.rounds) for q in qs]
        for where, q in named:
            if q.question_id in seen:
                raise ValueError(f"question {q.question_id!r} is served in {seen[q.question_id]} and again in "
                                 f"{where}: every level, round and warm-up needs questions of its own")
            seen[q.question_id] = where
    if len({len(p.rounds) for p in schedule.values()}) > 1:
        raise ValueError("every level needs the same number of rounds")


def run_concurrency(loaded, schedule: dict[int, LevelPlan], max_new_tokens: int,
                    methods: Sequence[ConcurrencyMethod] = DEFAULT_METHODS, progress=None,
                    cpu_kernels: str = "auto", k: int = 8, time_split: bool = True) -> dict:
    """Serve ``schedule`` (level -> :class:`LevelPlan`, see :func:`plan_levels`) with every method;
    returns ``{"concurrency": {"N": {"methods": {NAME: {...}}, "question_ids": [[...] per round],
    "warmup_question_ids": [...]}}, "rounds": R, ...provenance}``.

    With several rounds every method serves round r's questions in round r, the order of the
    methods reversed every other round (A B C, C B A, ...), so slow drifts of the machine hit all
    methods alike; throughput is total tokens over total wall time, and ``identical`` compares each
    method with the baseline on the same questions in every round. Each method is one engine for
    the whole run (``max_num_seqs`` = the highest level), so a TR method keeps its matrix and its
    budget's estimates across levels and rounds, as a server would; N clients keep at most N rows
    busy. A new step thread per run lets the previous one's OpenMP workers go (see
    engine/openmp.py).
    """
    from tr_serve.bench.provenance import environment, template_record

    _check_distinct(schedule)
    if not methods or not is_plain(methods[0].tree):
        raise ValueError("the first method must be the plain-decoding baseline (tree 'none')")
    rounds = len(next(iter(schedule.values())).rounds)
    rows = max(schedule)
    out: dict = {"concurrency": {}, "rounds": rounds, "max_num_seqs": rows}
    cores = {}
    for m in methods:
        cfg = EngineConfig(model=loaded.model_id, tree=m.tree, budget=m.budget, k=k, max_num_seqs=rows,
                           max_model_len=4096, cpu_kernels=cpu_kernels)
        cores[m.name] = Engine(loaded, cfg, timer=PhaseTimer(loaded.model.device, enabled=time_split))
    kernel_plan = cores[methods[0].name].runner.kernel_plan
    for n, plan in schedule.items():
        runs: dict[str, list[LevelResult]] = {m.name: [] for m in methods}
        for r, questions in enumerate(plan.rounds):
            prompts = [list(q.prompt_ids) for q in questions]
            order = list(methods) if r % 2 == 0 else list(reversed(methods))
            for m in order:
                engine = AsyncEngine(cores[m.name])
                try:
                    if r == 0:
                        if plan.warmup:
                            asyncio.run(_serve_all(engine, [list(q.prompt_ids) for q in plan.warmup], n,
                                                   max_new_tokens, f"warm-{m.name}-{n}"))
                        cores[m.name].timer.reset()  # the level's split of the engine time: its measured runs only
                    runs[m.name].append(asyncio.run(_serve_all(engine, prompts, n, max_new_tokens,
                                                               f"{m.name}-{n}-r{r}", progress)))
                finally:
                    engine.shutdown()
        base_runs = runs[methods[0].name]
        base = _merge(base_runs)
        table = {}
        for m in methods:
            merged = _merge(runs[m.name])
            mismatched = [(ri, plan.rounds[ri][i].question_id) for ri, res in enumerate(runs[m.name])
                          for i, ids in enumerate(res.outputs) if ids != base_runs[ri].outputs[i]]
            table[m.name] = {
                "tree": m.tree,
                "budget": m.budget,
                "throughput_tokens_per_s": merged.tokens / merged.wall_s,
                "tokens_per_s": sum(merged.per_request_tps) / len(merged.per_request_tps),
                "mat": merged.accepted / merged.steps if merged.steps else None,
                "identical": not mismatched,
                "throughput_vs_baseline": (merged.tokens / merged.wall_s) / (base.tokens / base.wall_s),
                # the same ratio in each round alone: how far it moves between rounds is the noise
                # a ranking has to clear (the whole-run ratio hides it)
                "throughput_vs_baseline_per_round": [(res.tokens / res.wall_s) / (b.tokens / b.wall_s)
                                                     for res, b in zip(runs[m.name], base_runs)],
                "mean_tree_nodes": sum(merged.budgets) / max(1, len(merged.budgets)),
                "new_tokens": merged.tokens,
                "verification_steps": merged.steps,
                "accepted": merged.accepted,
                **({"time_split": cores[m.name].timer.split()} if time_split else {}),
            }
            if mismatched:
                table[m.name]["mismatched_questions"] = [{"round": ri, "question_id": q} for ri, q in mismatched]
        out["concurrency"][str(n)] = {
            "methods": table,
            "question_ids": [[q.question_id for q in qs] for qs in plan.rounds],
            "warmup_question_ids": [q.question_id for q in plan.warmup],
        }
    out.update(environment(kernel_plan, cpu_kernels))
    out["templates"] = {m.name: template_record(m.tree, k, m.budget) for m in methods}
    return out


def markdown(result: dict) -> str:
    rows = ["| concurrency | method | throughput tok/s | vs baseline | each round | per-request tok/s | MAT | "
            "mean tree nodes | identical |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for n, level in result["concurrency"].items():
        for name, m in level["methods"].items():
            mat = "n/a" if m["mat"] is None else f"{m['mat']:.2f}"
            rounds = " / ".join(f"{x:.2f}" for x in m.get("throughput_vs_baseline_per_round", []))
            rows.append(f"| {n} | {name} | {m['throughput_tokens_per_s']:.2f} | {m['throughput_vs_baseline']:.2f}x | "
                        f"{rounds} | "
                        f"{m['tokens_per_s']:.2f} | {mat} | {m['mean_tree_nodes']:.1f} | "
                        f"{'yes' if m['identical'] else 'NO'} |")
    split = _split_table(result)
    return "\n".join(rows) + (f"\n\nEngine time by phase:\n\n{split}" if split else "")


def _split_table(result: dict) -> str | None:
    """Per level and method, the share of engine time in each phase (None when not timed)."""
    entries = [(n, name, m["time_split"]) for n, level in result["concurrency"].items()
               for name, m in level["methods"].items() if m.get("time_split")]
    if not entries:
        return None
    phases = sorted({p for _, _, split in entries for p in split})
    rows = ["| concurrency | method | " + " | ".join(phases) + " |", "| ---: | --- |" + " ---: |" * len(phases)]
    for n, name, split in entries:
        rows.append(f"| {n} | {name} | " + " | ".join(f"{100 * split.get(p, 0.0):.1f}%" for p in phases) + " |")
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
        axes[1].bar(xs, [result["concurrency"][n]["methods"][name]["mat"] or 0.0 for n in levels], width, label=name)
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


def execute(args: argparse.Namespace) -> int:
    """``tr-serve bench --concurrency``: uses the bench options (questions, trees, model, device...)
    and ``--rounds``; the tables on stdout, the JSON and its chart written. Bad input raises
    :class:`~tr_serve.cli_args.UsageError` (one line, exit 2)."""
    from tqdm import tqdm

    from tr_serve.bench.config import resolve_device, validate_tree
    from tr_serve.bench.questions import encode_questions
    from tr_serve.bench.records import BenchError, read_questions
    from tr_serve.cli_args import UsageError, check_model_arg
    from tr_serve.model_loader import load_model

    if getattr(args, "workload", "questions") != "questions" or getattr(args, "suffix_index", "default") != "default":
        raise UsageError("--workload and --suffix-index are single-stream options: leave them out with --concurrency")
    try:
        for spec in args.trees or ():
            validate_tree(spec, args.k)
        questions = read_questions(args.questions)
        categories = list(dict.fromkeys(q.category for q in questions))
        per_run = args.per_category * len(categories)
        schedule = plan_levels(interleave_by_category(questions), args.concurrency, args.rounds, per_run,
                               args.warmup, args.questions_per_client)
    except (BenchError, ValueError) as e:
        raise UsageError(str(e)) from None
    check_model_arg(args.model)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    loaded = load_model(args.model, device=device, dtype=args.dtype)
    for plan in schedule.values():
        encode_questions(loaded.tokenizer, plan.warmup + [q for qs in plan.rounds for q in qs])
    methods = methods_for(args.trees, pld=args.pld)
    served = sum(len(qs) for p in schedule.values() for qs in p.rounds)
    bar = tqdm(total=served * len(methods), desc="bench", unit="req", file=sys.stderr)
    try:
        result = run_concurrency(loaded, schedule, args.max_new_tokens, methods, progress=lambda: bar.update(1),
                                 cpu_kernels=args.cpu_kernels, k=args.k, time_split=args.time_split)
    finally:
        bar.close()
    result.update(model=args.model, device=device, questions_file=str(args.questions),
                  questions_per_level_round={str(n): len(p.rounds[0]) for n, p in schedule.items()},
                  questions_per_client=args.questions_per_client, max_new_tokens=args.max_new_tokens)
    png = save(result, Path(args.json_out))
    print(markdown(result))
    print(f"\nwrote {args.json_out} and {png}")
    return 0
