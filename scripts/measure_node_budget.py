"""MAT of ``tr:auto``'s ranking at a fixed number of verified nodes, with and without the
cross-request suffix index: what better first nodes are worth, machine noise aside.

Every variant is an engine of its own (``tree: auto``; ``--nodes 8`` makes every row verify the 8
drafted nodes its estimates rank best, ``TreeBudget.fixed_nodes``; ``0`` is the cost-aware budget
itself). The warm-up questions (the questions of each category after the ones the bench measures)
fill each engine's matrix and suffix index; the measured ones (the bench's: the first
``--per-category`` of each category) are never among them. Questions are interleaved: each question
runs through every variant before the next one. Every output is checked against the first
variant's (all are plain decoding's).

    .venv/bin/python scripts/measure_node_budget.py --nodes 1 2 4 8 16 0 --suffix on off --warmup 40
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict

import torch

from tr_serve.data import SPEC_BENCH_DEV
from tr_serve.engine.prompt import encode_prompt
from tr_serve.llm import LLM
from tr_serve.model_loader import load_model
from tr_serve.sampling_params import SamplingParams


def questions(per_category: int, warmup: int) -> tuple[list[dict], list[dict]]:
    """(measured, warm-up): the first ``per_category`` of each category, and ``warmup`` of the
    others, round robin over the categories."""
    by_cat: OrderedDict[str, list[dict]] = OrderedDict()
    for line in SPEC_BENCH_DEV.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_cat.setdefault(row["category"], []).append(row)
    measured = [r for qs in by_cat.values() for r in qs[:per_category]]
    rest = [qs[per_category:] for qs in by_cat.values()]
    warm: list[dict] = []
    depth = 0
    while len(warm) < warmup and any(depth < len(qs) for qs in rest):
        warm += [qs[depth] for qs in rest if depth < len(qs)]
        depth += 1
    return measured, warm[:warmup]


def prompt_ids(tokenizer, row: dict) -> list[int]:
    """A question's first turn as one user message through the chat template (as the bench encodes it)."""
    return encode_prompt(tokenizer, [{"role": "user", "content": row["turns"][0]}])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 0],
                    help="verified nodes per row and step; 0: the cost-aware budget (default: 1 2 4 8 16 0)")
    ap.add_argument("--suffix", nargs="+", choices=("on", "off"), default=["on", "off"])
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pair-table", action="store_true", help="engines with the pair table (EngineConfig.pair_table)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    measured, warm = questions(args.per_category, args.warmup)
    loaded = load_model("smollm2-135m-instruct")
    prompts = {row["question_id"]: prompt_ids(loaded.tokenizer, row) for row in warm + measured}
    # as tr-serve bench sizes its engines: each one's KV cache holds one row of this many tokens
    max_model_len = max(2048, max(map(len, prompts.values())) + args.max_new_tokens + 1)
    variants: list[tuple[str, LLM]] = []
    for suffix in args.suffix:
        for nodes in args.nodes:
            llm = LLM(tree="auto", loaded=loaded, max_num_seqs=1, max_model_len=max_model_len, suffix_index=suffix == "on",
                      pair_table=args.pair_table or None)
            if nodes:
                llm.engine.speculator.drafter.budget.fixed_nodes = nodes
            variants.append((f"{'auto' if not nodes else f'{nodes} nodes'}, suffix {suffix}", llm))
    params = SamplingParams(max_tokens=args.max_new_tokens)
    stats = {name: [0, 0, 0, 0.0, 0] for name, _ in variants}  # accepted, steps, nodes, seconds, new tokens
    for phase, rows in (("warm-up", warm), ("measured", measured)):
        for i, row in enumerate(rows):
            ids = prompts[row["question_id"]]
            want = None
            for name, llm in variants:
                t0 = time.perf_counter()
                out = llm.generate([ids], params)[0]
                seconds = time.perf_counter() - t0
                want = out.token_ids if want is None else want
                if out.token_ids != want:
                    raise SystemExit(f"{name} differs from {variants[0][0]} on q{row['question_id']}")
                if phase == "measured":
                    s = stats[name]
                    s[0] += sum(out.stats.accepted_per_step)
                    s[1] += len(out.stats.accepted_per_step)
                    s[2] += sum(out.stats.tree_nodes_per_step)
                    s[3] += seconds
                    s[4] += len(out.token_ids)
            print(f"{phase} {i + 1}/{len(rows)} q{row['question_id']} {row['category']}", flush=True)
    print(f"\n{len(measured)} measured questions after {len(warm)} warm-up ones, {args.max_new_tokens} tokens\n")
    print("| variant | MAT | nodes per step | tokens/s |\n| --- | ---: | ---: | ---: |")
    result = {}
    for name, (accepted, steps, nodes, seconds, tokens) in stats.items():
        result[name] = {"mat": accepted / steps, "nodes_per_step": nodes / steps, "tokens_per_s": tokens / seconds}
        print(f"| {name} | {accepted / steps:.3f} | {nodes / steps:.2f} | {tokens / seconds:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"measured": [r["question_id"] for r in measured], "warmup": [r["question_id"] for r in warm],
                       "max_new_tokens": args.max_new_tokens, "variants": result}, f, indent=2)


if __name__ == "__main__":
    main()
