"""Order the 2.2.2 template's nodes by acceptance measured on dev questions; writes
``tr_serve/data/tree-order-2.2.2.json``, whose prefixes are the ``topN`` trees.

Every step verifies the whole 80-node tree (fixed budget), so every node whose parent's path was
accepted is observed; a node's path rate is the fraction of steps in which its whole path equals
the model's greedy choices. The questions are the ones the benchmark does not measure (from the
third question of each category on), so the order is not fitted to the benchmark's questions.

    .venv/bin/python scripts/measure_tree_order.py --per-category 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections import OrderedDict

import torch

from tr_serve.data import PAPER_TREE_2_2_2_ORDER, SPEC_BENCH_DEV
from tr_serve.engine.prompt import encode_prompt
from tr_serve.llm import LLM
from tr_serve.model_loader import load_model
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.acceptance_stats import AcceptanceStats
from tr_serve.tr.tree import DEFAULT_TREE, order_by_rates

SKIP_PER_CATEGORY = 2  # the benchmark measures the first questions of each category


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(PAPER_TREE_2_2_2_ORDER))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    by_cat: OrderedDict[str, list[dict]] = OrderedDict()
    for line in SPEC_BENCH_DEV.read_text().splitlines():
        row = json.loads(line)
        by_cat.setdefault(row["category"], []).append(row)
    rows = [r for qs in by_cat.values() for r in qs[SKIP_PER_CATEGORY : SKIP_PER_CATEGORY + args.per_category]]

    loaded = load_model("smollm2-135m-instruct")
    llm = LLM(tree="2.2.2", loaded=loaded, max_num_seqs=1)
    drafter = llm.engine.speculator.drafter
    stats = AcceptanceStats(drafter.template, decay=1.0, prior_weight=0.0)
    drafter.acceptance = stats  # observed on every step from now on
    params = SamplingParams(max_tokens=args.max_new_tokens)
    for i, row in enumerate(rows):
        ids = encode_prompt(loaded.tokenizer, [{"role": "user", "content": row["turns"][0]}])
        out = llm.generate([ids], params)[0]
        print(f"{i + 1}/{len(rows)} q{row['question_id']} {row['category']}: MAT {out.stats.mat:.2f}", flush=True)
    rates = stats.rates.tolist()
    order = order_by_rates(DEFAULT_TREE, rates)
    index = {p: i for i, p in enumerate(DEFAULT_TREE)}
    result = {
        "what": "the 2.2.2 template's paths by descending measured path-acceptance rate; topN = the first N",
        "command": "python scripts/measure_tree_order.py "
                   f"--per-category {args.per_category} --max-new-tokens {args.max_new_tokens} --threads {args.threads}",
        "date": datetime.date.today().isoformat(),
        "model": loaded.model_id,
        "question_ids": [r["question_id"] for r in rows],
        "verification_steps": int(stats.trials[0]),
        "order": [list(p) for p in order],
        "path_rates": [round(rates[index[p]], 5) for p in order],
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}; expected accepted drafts per step of top8: {sum(sorted(rates, reverse=True)[:8]):.3f}, "
          f"of all 80: {sum(rates):.3f}")


if __name__ == "__main__":
    main()
