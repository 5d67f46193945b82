"""Tensor parallel vs single process on Spec-Bench dev questions: same greedy tokens? step time?

    tr-serve bench-tp --tp 3 --questions 8 --max-tokens 32 --tree top4

Runs the same requests (chat-encoded first turns, all submitted at once) through ``Engine`` over
its local ``ModelRunner`` in this process and through the same ``Engine`` over a ``TPModelRunner``
on a local Ray instance, and prints the per-question token agreement (with the top-2 logit gap of
the unsharded model at the first difference, if any), the mean wall-clock seconds per engine step
of each, the phase split of the TP engine's steps (``forward`` = the round trip to the workers), and
what the TP runner exchanged with its workers per step (Ray messages, pickled call bytes out,
token-id bytes back). Every process uses ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from tr_serve.bench.local_ray import local_ray
from tr_serve.bench.questions import DEFAULT_QUESTIONS, short_questions
from tr_serve.bench.records import Question, first_mismatch, read_questions
from tr_serve.cli_args import add_command, positive_int, quiet_transformers, run_standalone

MAX_PROMPT_TOKENS = 400  # short questions only: the TP workers' contexts stay small


def dev_questions(tokenizer, count: int) -> list[Question]:
    """The first ``count`` packaged dev questions whose chat-encoded prompt is short enough."""
    return short_questions(tokenizer, read_questions(DEFAULT_QUESTIONS), MAX_PROMPT_TOKENS)[:count]


def run_engine(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[float]]:
    """Greedy outputs (in prompt order) and the wall-clock seconds of every step."""
    from tr_serve.sampling_params import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=f"q{i}")
           for i, p in enumerate(prompts)]
    done: dict[str, list[int]] = {}
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        for o in outs:
            if o.finished:
                done[o.request_id] = list(o.token_ids)
    return [done[i] for i in ids], times


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tr_serve.engine.config import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--tp", type=positive_int, default=3, help="tensor-parallel workers (default: 3)")
    p.add_argument("--questions", type=positive_int, default=8, help="dev questions (default: 8)")
    p.add_argument("--max-tokens", type=positive_int, default=32, help="new tokens per question (default: 32)")
    p.add_argument("--tree", default="top4", help="tree setting (default: top4)")
    p.add_argument("--max-num-seqs", type=positive_int, default=4, help="engine rows (default: 4)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per process (default: 1)")
    p.add_argument("--json", default=None, help="write the results here")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``tr-serve bench-tp``: register on the CLI's subparsers (sets ``func=run``)."""
    return add_command(subparsers, "bench-tp", help="tensor parallel vs single process: same tokens, step time",
                       description=__doc__.splitlines()[0], add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone("tr-serve bench-tp", __doc__.splitlines()[0], add_arguments, run, argv)


def run(args: argparse.Namespace) -> int:
    """Run both engines on the same requests, print the comparison, write ``--json``."""
    quiet_transformers()
    result = measure(args)
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def measure(args: argparse.Namespace) -> dict:
    """The same greedy requests through ``Engine`` over the local runner and over a ``TPModelRunner``:
    per-question agreement, step times, the TP phase split and what crossed to the workers."""
    torch.set_num_threads(args.threads)

    from tr_serve.bench.summary import logit_gap_at
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine
    from tr_serve.engine.timing import PhaseTimer
    from tr_serve.model_loader import load_model
    from tr_serve.tp.runner import tp_engine

    config = EngineConfig(model=args.model, tree=args.tree, max_num_seqs=args.max_num_seqs, max_model_len=1024)
    loaded = load_model(args.model)
    questions = dev_questions(loaded.tokenizer, args.questions)
    prompts = [q.prompt_ids for q in questions]
    ref, ref_times = run_engine(Engine(loaded, config), prompts, args.max_tokens)
    with local_ray(args.tp + 1):
        timer = PhaseTimer("cpu")
        tp = tp_engine(args.model, config, args.tp, timer=timer, cpu_threads=args.threads, measure_bytes=True)
        try:
            timer.reset()
            start = dataclasses.replace(tp.runner.transfer)
            got, tp_times = run_engine(tp, prompts, args.max_tokens)
            transfer = tp.runner.transfer
        finally:
            tp.runner.shutdown()
    rows = []
    for q, a, b in zip(questions, ref, got):
        mismatch = first_mismatch(a, b)
        i = None if mismatch is None else mismatch["position"]
        gap = None if mismatch is None else logit_gap_at(loaded, q.prompt_ids, a, mismatch)["top2_logit_gap"]
        rows.append({"question_id": q.question_id, "tokens": len(a), "identical": i is None, "first_difference": i,
                     "top2_gap": gap})
    return {
        "tp": args.tp, "tree": args.tree, "questions": len(rows), "max_tokens": args.max_tokens,
        "identical": sum(r["identical"] for r in rows), "tokens_compared": sum(r["tokens"] for r in rows),
        "steps_tp1": len(ref_times), "steps_tp": len(tp_times),
        "mean_step_s_tp1": sum(ref_times) / len(ref_times), "mean_step_s_tp": sum(tp_times) / len(tp_times),
        "threads_per_process": args.threads,
        "phase_ms_per_step_tp": {k: 1e3 * v / len(tp_times) for k, v in timer.seconds.items()},
        "forwards_per_step_tp": (transfer.forwards - start.forwards) / len(tp_times),
        "ray_messages_per_step_tp": (transfer.messages - start.messages) / len(tp_times),
        "bytes_out_per_step_tp": (transfer.bytes_out - start.bytes_out) / len(tp_times),
        "bytes_back_per_step_tp": (transfer.bytes_back - start.bytes_back) / len(tp_times),
        "rows": rows,
    }


def format_result(result: dict) -> str:
    """One line per question (identical, or where it differs and the top-2 logit gap there), then
    the step times and the per-step traffic of the TP engine."""
    tp = result["tp"]
    lines = [f"q{r['question_id']}: {r['tokens']} tokens, " + ("identical" if r["identical"] else
                                                              f"differs at {r['first_difference']} "
                                                              f"(top-2 gap {r['top2_gap']:.2e})")
             for r in result["rows"]]
    lines.append(f"{result['identical']}/{result['questions']} identical ({result['tokens_compared']} tokens); "
                 f"mean step: tp1 {result['mean_step_s_tp1'] * 1e3:.1f} ms over {result['steps_tp1']} steps, "
                 f"tp{tp} {result['mean_step_s_tp'] * 1e3:.1f} ms over {result['steps_tp']} steps")
    lines.append(f"tp{tp} per step: {result['ray_messages_per_step_tp']:.1f} Ray messages, "
                 f"{result['bytes_out_per_step_tp'] / 1e3:.1f} kB out, "
                 f"{result['bytes_back_per_step_tp'] / 1e6:.2f} MB back; "
                 + ", ".join(f"{k} {v:.1f} ms" for k, v in result["phase_ms_per_step_tp"].items()))
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
