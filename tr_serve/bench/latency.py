"""Forward latency by query-token count: ``tr-serve bench --latency``.

One verify forward of ``q`` query tokens (a tree under its mask, through ``ModelRunner.verify``: the
engine's runner, cache, mask and linear kernels) over a row that holds a ``context``-token prefix,
for every context and token count. Rounds are interleaved (every pair once per round, the order
reversed every other round) and each pair keeps its fastest round, so a busy moment of the machine
shifts one sample, not a whole column. The JSON holds ``{"latency_ms": {"<context>": {"<query
tokens>": ms}}}`` plus ``t(q)/t(1)`` per context, the kernel plan, threads and versions, and the
arithmetic floor (``bench/roofline.py``): each forward's FLOPs and, for float32 on CPU, this CPU's
measured peak and the least time the arithmetic alone takes at it (``floor_ms``), so that a ratio
target can be checked against what the machine allows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tr_serve.bench import roofline

CONTEXTS = (256, 1024)
QUERY_TOKENS = (1, 2, 4, 8, 16, 32, 64, 80)
ROUNDS = 10
DEFAULT_JSON = os.path.join("bench_out", "latency.json")


def tree_inputs(q: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [1, q], depths [q], mask [q, q]) of a binary tree of ``q`` nodes: node 0 is the root,
    node i's parent is (i - 1) // 2; a node sees its ancestors and itself."""
    parent = [-1] + [(i - 1) // 2 for i in range(1, q)]
    depths = torch.zeros(q, dtype=torch.long)
    mask = torch.zeros(q, q, dtype=torch.bool)
    for i in range(q):
        mask[i, i] = True
        if parent[i] >= 0:
            mask[i] |= mask[parent[i]]
            depths[i] = depths[parent[i]] + 1
    g = torch.Generator().manual_seed(seed + q)
    tokens = torch.randint(min(10, vocab - 1), vocab, (1, q), generator=g)
    return tokens, depths, mask


def measure_latency(runner, contexts: Sequence[int], query_tokens: Sequence[int], rounds: int = ROUNDS,
                    clock: Callable[[], float] = time.perf_counter,
                    progress: Callable[[], None] | None = None) -> dict[int, dict[int, float]]:
    """Seconds of one ``runner.verify`` per (context, query tokens): the minimum over ``rounds``
    interleaved rounds, after one untimed warm-up of each pair. Uses rows 0 .. len(contexts) - 1 of
    ``runner`` and frees them afterwards."""
    if runner.cache.num_rows < len(contexts):
        raise ValueError(f"the runner has {runner.cache.num_rows} rows, {len(contexts)} contexts need one each")
    need = max(contexts) + max(query_tokens)
    if need > runner.max_len:
        raise ValueError(f"context {max(contexts)} + {max(query_tokens)} query tokens exceed max_len {runner.max_len}")
    vocab = runner.vocab_size
    high = min(1000, vocab)
    rows = {}
    for i, c in enumerate(contexts):
        row = torch.tensor([i])
        runner.free(i)
        runner.prefill(row, [[(10 + j) % high for j in range(c)]])
        rows[c] = row
    inputs = {q: tree_inputs(q, vocab) for q in query_tokens}
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    pairs = [(c, q) for c in contexts for q in query_tokens]
    best = {pair: float("inf") for pair in pairs}
    try:
        for c, q in pairs:  # warm-up: first use of each shape
            runner.verify(rows[c], *inputs[q])
        for r in range(rounds):
            for c, q in (pairs if r % 2 == 0 else pairs[::-1]):
                sync()
                t0 = clock()
                runner.verify(rows[c], *inputs[q])
                sync()
                best[c, q] = min(best[c, q], clock() - t0)
            if progress is not None:
                progress()
    finally:
        for i in range(len(contexts)):
            runner.free(i)
    return {c: {q: best[c, q] for q in query_tokens} for c in contexts}


def run_latency(loaded, cpu_kernels: str = "auto", contexts: Sequence[int] = CONTEXTS,
                query_tokens: Sequence[int] = QUERY_TOKENS, rounds: int = ROUNDS,
                progress: Callable[[], None] | None = None) -> dict[str, Any]:
    """The result dict for ``loaded`` (a :class:`~tr_serve.model_loader.LoadedModel`), with the runner
    built as the engine builds it: the kernel plan of ``cpu_kernels`` ("auto": measured per token
    count, fp32 on CPU only; "torch": torch's own)."""
    from tr_serve.bench.provenance import environment
    from tr_serve.kernels.kernel_autotune import select_plan
    from tr_serve.runner.model_runner import ModelRunner

    contexts = tuple(sorted(set(int(c) for c in contexts)))
    query_tokens = tuple(sorted(set(int(q) for q in query_tokens)))
    if not contexts or not query_tokens or contexts[0] < 1 or query_tokens[0] < 1:
        raise ValueError("contexts and query token counts must be positive")
    model = loaded.model
    plan = select_plan(model) if cpu_kernels == "auto" else None
    runner = ModelRunner(model, len(contexts), max(contexts) + max(query_tokens) + 1, kernel_plan=plan,
                         tree_attention_enabled=cpu_kernels == "auto")
    seconds = measure_latency(runner, contexts, query_tokens, rounds, progress=progress)
    latency = {str(c): {str(q): round(s * 1000, 3) for q, s in row.items()} for c, row in seconds.items()}
    first = query_tokens[0]
    ratios = {str(c): {str(q): round(s / row[first], 4) for q, s in row.items()} for c, row in seconds.items()}
    flops = ({c: {q: roofline.forward_flops(model.config, c, tree_inputs(q, runner.vocab_size)[2])
                  for q in query_tokens} for c in contexts}
             if roofline.counts(model.config) else None)
    # the float32 peak bounds float32 CPU forwards only (torch's bf16 or GPU kernels have peaks of their own)
    cpu_fp32 = runner.device.type == "cpu" and runner.dtype == torch.float32
    peak = roofline.measure_peak_gflops() if flops and cpu_fp32 else None
    out: dict[str, Any] = {
        "latency_ms": latency,
        f"ratio_to_{first}": ratios,
        "contexts": list(contexts),
        "query_tokens": list(query_tokens),
        "rounds": rounds,
        "statistic": "min over interleaved rounds of one ModelRunner.verify (binary tree mask, one row)",
        "model": loaded.model_id,
        "device": str(runner.device),
        "dtype": str(runner.dtype).replace("torch.", ""),
        **environment(plan, cpu_kernels),
    }
    if flops:
        out["flops"] = {str(c): {str(q): f for q, f in row.items()} for c, row in flops.items()}
        out["achieved_gflops"] = {str(c): {str(q): round(f / seconds[c][q] / 1e9, 3) for q, f in row.items()}
                                  for c, row in flops.items()}
        out["peak_gflops"] = None if peak is None else round(peak, 1)
    if peak is not None:
        floor = {c: {q: f / peak / 1e9 for q, f in row.items()} for c, row in flops.items()}
        out["floor_ms"] = {str(c): {str(q): round(s * 1000, 3) for q, s in row.items()} for c, row in floor.items()}
        # the least t(q)/t(first) the arithmetic allows where it exceeds the weights' stream (above 1)
        out[f"floor_ratio_to_{first}"] = {str(c): {str(q): round(s / seconds[c][first], 4) for q, s in row.items()}
                                          for c, row in floor.items()}
    return out


def markdown(result: dict[str, Any]) -> str:
    contexts = [str(c) for c in result["contexts"]]
    tokens = [str(q) for q in result["query_tokens"]]
    ratio_key = next(k for k in result if k.startswith("ratio_to_"))
    first = ratio_key.removeprefix("ratio_to_")
    floor, achieved = result.get("floor_ms"), result.get("achieved_gflops")
    cols = [f"(ms) | t(q)/t({first})"] + (["GFLOP/s"] if achieved else []) + \
        ([f"floor (ms) | floor/t({first})"] if floor else [])
    head = "| query tokens | " + " | ".join(f"ctx {c} " + " | ".join(cols) for c in contexts) + " |"
    sep = "| --- |" + (" --- |" * (2 + bool(achieved) + 2 * bool(floor))) * len(contexts)
    lines = [head, sep]
    for q in tokens:
        cells = []
        for c in contexts:
            cells += [f"{result['latency_ms'][c][q]:.1f}", f"{result[ratio_key][c][q]:.2f}"]
            if achieved:
                cells.append(f"{achieved[c][q]:.0f}")
            if floor:
                cells += [f"{floor[c][q]:.1f}", f"{result[f'floor_ratio_to_{first}'][c][q]:.2f}"]
        lines.append(f"| {q} | " + " | ".join(cells) + " |")
    plan = result.get("kernel_plan")
    kernels = plan if isinstance(plan, str) else ", ".join(f"{n}:{k}" for n, k in plan["per_token_count"].items())
    padded = plan.get("padded_rows") if isinstance(plan, dict) else None
    pad = "; padded to " + ", ".join(f"{n}->{r}" for n, r in padded.items()) + " rows" if padded else ""
    lines.append("")
    lines.append(f"{result['model']} on {result['device']}, {result['dtype']}, {result['torch_threads']} threads, "
                 f"torch {result['torch']}, transformers {result['transformers']}; min of {result['rounds']} "
                 f"interleaved rounds; kernels (tokens:kernel): {kernels}{pad}")
    if floor:
        lines.append(f"floor: the forward's multiply-adds (linears, LM head, attention) at this CPU's measured float32 "
                     f"peak, {result['peak_gflops']:.0f} GFLOPS with {result['torch_threads']} threads: no kernel runs "
                     f"a forward faster, so t(q)/t({first}) stays at or above floor/t({first}) at this t({first})")
    return "\n".join(lines)


def save(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def execute(args: argparse.Namespace) -> int:
    """``tr-serve bench --latency``: uses the bench options --model, --device, --dtype, --threads,
    --cpu-kernels and --json (default bench_out/latency.json instead of the Spec-Bench file)."""
    from tr_serve.bench.config import DEFAULT_JSON as SPEC_BENCH_JSON
    from tr_serve.bench.config import resolve_device
    from tr_serve.cli_args import check_model_arg
    from tr_serve.model_loader import load_model

    check_model_arg(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    loaded = load_model(args.model, device=device, dtype=args.dtype)
    out = Path(DEFAULT_JSON if args.json_out == SPEC_BENCH_JSON else args.json_out)
    from tqdm import tqdm

    bar = tqdm(total=ROUNDS, desc="latency", unit="round", file=sys.stderr)
    try:
        result = run_latency(loaded, cpu_kernels=args.cpu_kernels, progress=lambda: bar.update(1))
    finally:
        bar.close()
    save(result, out)
    print(markdown(result))
    print(f"\nwrote {out}")
    return 0
