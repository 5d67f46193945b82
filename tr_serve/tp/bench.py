"""Tensor parallel vs single process on Spec-Bench dev questions: same greedy tokens? step time?

    python -m tr_serve.tp.bench --tp 3 --questions 8 --max-tokens 32 --tree top4

Runs the same requests (chat-encoded first turns, all submitted at once) through ``Engine`` over
its local ``ModelRunner`` in this process and through the same ``Engine`` over a ``TPModelRunner``
on a local Ray instance, and prints the per-question token agreement (with the top-2 logit gap of
the unsharded model at the first difference, if any), the mean wall-clock seconds per engine step
of each, the phase split of the TP engine's steps (``forward`` = the round trip to the workers), and
what the TP runner exchanged with its workers per step (Ray messages, pickled call bytes out,
logits bytes back). Every process uses ``--threads`` torch threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from tr_serve.data import SPEC_BENCH_DEV as DEV  # packaged Spec-Bench dev questions


def dev_prompts(tokenizer, count: int, path: Path = DEV, max_prompt_tokens: int = 400) -> list[tuple[int, list[int]]]:
    """(question_id, chat-encoded first turn) for the first ``count`` short-enough questions."""
    from tr_serve.llm import encode_prompt

    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        ids = encode_prompt(tokenizer, [{"role": "user", "content": row["turns"][0]}])
        if len(ids) <= max_prompt_tokens:
            out.append((row["question_id"], ids))
        if len(out) == count:
            break
    return out


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


def top2_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """top-1 minus top-2 logit of the unsharded model after ``prompt + prefix``."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tree", default="top4")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    torch.set_num_threads(args.threads)

    import ray

    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine
    from tr_serve.engine.timing import PhaseTimer
    from tr_serve.model_loader import load_model
    from tr_serve.tp.runner import tp_engine

    config = EngineConfig(model=args.model, tree=args.tree, max_num_seqs=args.max_num_seqs, max_model_len=1024)
    loaded = load_model(args.model)
    questions = dev_prompts(loaded.tokenizer, args.questions)
    prompts = [p for _, p in questions]
    ref, ref_times = run_engine(Engine(loaded, config), prompts, args.max_tokens)
    ray.init(address="local", num_cpus=args.tp + 1, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        timer = PhaseTimer("cpu")
        tp = tp_engine(args.model, config, args.tp, timer=timer, cpu_threads=args.threads, measure_bytes=True)
        try:
            timer.reset()
            start = dataclasses.replace(tp.runner.transfer)
            got, tp_times = run_engine(tp, prompts, args.max_tokens)
            transfer = tp.runner.transfer
        finally:
            tp.runner.shutdown()
    finally:
        ray.shutdown()
    rows = []
    for (qid, prompt), a, b in zip(questions, ref, got):
        i = first_difference(a, b)
        gap = None if i is None else top2_gap(loaded.model, prompt, a[:i])
        rows.append({"question_id": qid, "tokens": len(a), "identical": i is None, "first_difference": i,
                     "top2_gap": gap})
    result = {
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
    for r in rows:
        print(f"q{r['question_id']}: {r['tokens']} tokens, "
              + ("identical" if r["identical"] else f"differs at {r['first_difference']} (top-2 gap {r['top2_gap']:.2e})"))
    print(f"{result['identical']}/{result['questions']} identical ({result['tokens_compared']} tokens); "
          f"mean step: tp1 {result['mean_step_s_tp1'] * 1e3:.1f} ms over {result['steps_tp1']} steps, "
          f"tp{args.tp} {result['mean_step_s_tp'] * 1e3:.1f} ms over {result['steps_tp']} steps")
    print(f"tp{args.tp} per step: {result['ray_messages_per_step_tp']:.1f} Ray messages, "
          f"{result['bytes_out_per_step_tp'] / 1e3:.1f} kB out, {result['bytes_back_per_step_tp'] / 1e6:.2f} MB back; "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in result["phase_ms_per_step_tp"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
