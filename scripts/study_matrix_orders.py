"""Offline study: which template nodes to verify, and what a matrix row should hold, on greedy traces.

What it answers: at 1, 2, 4, 8 and 16 verified nodes, how much a per-row choice of nodes (best
first by fitted rates of each node given its parent row's streak, or given the probability the
model gave the candidate when the row was written) or rows that aggregate the model's probabilities
over every sighting of a token (instead of the last sighting's top-k, the paper's rule) would raise
MAT over the static order the cost-aware budget uses. Templates alone (the 80-node ``2.2.2``), no
context or suffix branch.

How: plain greedy outputs of the measured questions after the warm-up ones
(``measure_node_budget.questions``, the same split), and the model's top-k ids and probabilities
at every position (one forward over each prompt and output). The study then replays decoding step
by step, as the engine does: a step's tree is rooted at the token after the previous step's
accepted run, so MAT is tokens per step. (An average over every position instead over-weights
the easy stretches a step jumps across: 1.83 at 8 nodes, where this replay reads 1.60 and the
engine, recycling along the path as this study does, measured 1.59.) Rows are recycled along the
accepted path only (the traces hold no logits for rejected nodes); the engine recycles every node. Rates and orders are fitted on the measured
questions themselves, so the per-row orders' gains are upper bounds.

    .venv/bin/python scripts/study_matrix_orders.py --traces /tmp/matrix_traces.pkl
"""

from __future__ import annotations

import argparse
import heapq
import pickle
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tr_serve.llm import LLM
from tr_serve.model_loader import load_model
from tr_serve.runner.matrix_prior import first_token_logits
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.tree import DEFAULT_TREE

K = 8
NODE_COUNTS = (1, 2, 4, 8, 16)
Node = tuple[int, ...]  # a template node: the ranks from the root
PATHS: list[Node] = [tuple(p) for p in DEFAULT_TREE]
AGGREGATE = (0.6, 0.5)  # decay of older sightings' scores, power of the probabilities summed


@dataclass
class Trace:
    prompt_len: int
    tokens: np.ndarray  # [n] prompt then output
    top_ids: np.ndarray  # [n, K] the model's top-k after each position
    top_probs: np.ndarray  # [n, K] their probabilities
    measured: bool


def make_traces(warmup: int, per_category: int, max_new_tokens: int) -> tuple[list[Trace], np.ndarray, np.ndarray]:
    """The warm-up and measured traces, and the prior's rows with their probabilities."""
    from measure_node_budget import prompt_ids, questions  # beside this file; imported when traces are made

    measured, warm = questions(per_category, warmup)
    loaded = load_model("smollm2-135m-instruct")
    model, tok = loaded.model, loaded.tokenizer
    vocab = model.config.vocab_size
    prior_ids = np.zeros((vocab, K), np.int32)
    prior_probs = np.zeros((vocab, K), np.float32)
    for start, logits in first_token_logits(model, vocab, tok.bos_token_id):
        probs, ids = logits.softmax(-1).topk(K, dim=-1)
        prior_ids[start:start + len(ids)] = ids.numpy()
        prior_probs[start:start + len(ids)] = probs.numpy()
    llm = LLM(tree="none", loaded=loaded, max_num_seqs=1, max_model_len=2048)
    traces = []
    for row in warm + measured:
        ids = prompt_ids(tok, row)
        out = llm.generate([ids], SamplingParams(max_tokens=max_new_tokens))[0].token_ids
        seq = list(ids) + list(out)
        with torch.inference_mode():
            probs, top = model(torch.tensor([seq])).logits[0].float().softmax(-1).topk(K, dim=-1)
        traces.append(Trace(len(ids), np.asarray(seq), top.numpy().astype(np.int32), probs.numpy(), row in measured))
    return traces, prior_ids, prior_probs


class Rows:
    """The matrix as the study replays it: each token's K candidates, their probabilities when
    written, the streak of unchanged first candidates; with ``aggregate`` (decay, power) a row
    holds the K best of scores summed over sightings instead of the last sighting's top-k."""

    def __init__(self, prior: tuple[np.ndarray, np.ndarray], aggregate: tuple[float, float] | None = None):
        self.prior = prior  # (ids, probs) [vocab, K], read only: an aggregate's first scores
        self.ids, self.probs = prior[0].copy(), prior[1].copy()
        self.aggregate = aggregate
        self.streak = np.zeros(len(self.ids), np.int64)
        self.scores: dict[int, dict[int, float]] = {}

    def recycle(self, token: int, ids: np.ndarray, probs: np.ndarray) -> None:
        self.streak[token] = self.streak[token] + 1 if self.ids[token, 0] == ids[0] else 0
        if self.aggregate is None:
            self.ids[token], self.probs[token] = ids, probs
            return
        decay, power = self.aggregate
        score = self.scores.get(token)
        if score is None:
            score = self.scores[token] = {int(c): float(p) ** power for c, p in zip(*(a[token] for a in self.prior))}
        for c in score:
            score[c] *= decay
        for c, p in zip(ids.tolist(), probs.tolist()):
            score[c] = score.get(c, 0.0) + p ** power
        best = sorted(score, key=score.__getitem__, reverse=True)
        for c in best[4 * K:]:
            del score[c]
        self.ids[token] = best[:K]


Choose = Callable[[Rows, int], list[Node]]  # (rows, root) -> the nodes verified, parents first
Observe = Callable[[Rows, dict[Node, tuple[bool, int]]], None]


def replay(traces: list[Trace], prior: tuple[np.ndarray, np.ndarray], choose: Choose,
           aggregate: tuple[float, float] | None = None, observe: Observe | None = None) -> float:
    """MAT of ``choose`` over the measured traces, decoded step by step; ``observe`` sees every
    step's nodes as {node: (on the accepted path, its parent's token)}."""
    rows = Rows(prior, aggregate)
    steps = tokens = 0
    for trace in traces:
        t, end = trace.prompt_len - 1, len(trace.tokens) - 1
        while t < end:
            accepted = 0
            if trace.measured:
                root, truth = int(trace.tokens[t]), trace.tokens[t + 1:t + 1 + 16]
                drafted: dict[Node, int] = {(): root}
                outcome: dict[Node, tuple[bool, int]] = {}
                for node in sorted(choose(rows, root), key=len):
                    parent = drafted[node[:-1]]
                    drafted[node] = int(rows.ids[parent, node[-1]])
                    right = len(truth) >= len(node) and drafted[node] == truth[len(node) - 1]
                    outcome[node] = (right and (len(node) == 1 or outcome[node[:-1]][0]), parent)
                if observe is not None:
                    observe(rows, outcome)
                # the last step emits only what is left of the output (the engine stops there)
                accepted = min(max((len(n) for n, (ok, _) in outcome.items() if ok), default=0), end - t - 1)
                steps, tokens = steps + 1, tokens + accepted + 1
            for j in range(t, min(t + accepted + 1, end)):
                rows.recycle(int(trace.tokens[j]), trace.top_ids[j], trace.top_probs[j])
            t += accepted + 1
    return tokens / steps


def static_order(traces, prior, aggregate=None) -> list[Node]:
    """The template's nodes by path-acceptance rate over every step (the budget's order)."""
    hits: dict[Node, int] = defaultdict(int)

    def observe(rows, outcome):
        for node, (ok, _) in outcome.items():
            hits[node] += ok

    replay(traces, prior, lambda rows, root: PATHS, aggregate, observe)
    return sorted(PATHS, key=lambda n: (-hits[n], len(n)))


Feature = Callable[[Rows, int, Node], tuple]  # (rows, parent token, node) -> a rate's cell


def fitted_rates(traces, prior, feature: Feature) -> dict[tuple, float]:
    """P(node right | its parent right) per ``feature`` cell, from every template node of every step."""
    tried: dict[tuple, int] = defaultdict(int)
    right: dict[tuple, int] = defaultdict(int)

    def observe(rows, outcome):
        for node, (ok, parent) in outcome.items():
            if len(node) == 1 or outcome[node[:-1]][0]:
                cell = feature(rows, parent, node)
                tried[cell] += 1
                right[cell] += ok

    replay(traces, prior, lambda rows, root: PATHS, None, observe)
    return {cell: (right[cell] + 0.5) / (tried[cell] + 1) for cell in tried}


def per_row_order(rates: dict[tuple, float], feature: Feature, nodes: int) -> Choose:
    """Each row's ``nodes`` best template nodes, best first by the product of fitted rates."""
    children: dict[Node, list[Node]] = defaultdict(list)
    for node in PATHS:
        children[node[:-1]].append(node)

    def choose(rows, root):
        drafted = {(): root}
        heap = [(-rates.get(feature(rows, root, c), 0.0), c) for c in children[()]]
        heapq.heapify(heap)
        picked = []
        while heap and len(picked) < nodes:
            score, node = heapq.heappop(heap)
            picked.append(node)
            drafted[node] = int(rows.ids[drafted[node[:-1]], node[-1]])
            for c in children[node]:
                heapq.heappush(heap, (score * rates.get(feature(rows, drafted[node], c), 0.0), c))
        return picked

    return choose


def streak_cell(rows: Rows, parent: int, node: Node) -> tuple:
    s = int(rows.streak[parent])
    return node[-1], 0 if s == 0 else 1 if s == 1 else 2 if s < 4 else 3, min(len(node), 3)


def probability_cell(rows: Rows, parent: int, node: Node) -> tuple:
    return node[-1], min(11, int(float(rows.probs[parent, node[-1]]) * 12)), min(len(node), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--traces", type=Path, default=None, help="keep the traces here; read them if present")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.traces is not None and args.traces.exists():
        traces, *prior = pickle.loads(args.traces.read_bytes())
    else:
        traces, *prior = make_traces(args.warmup, args.per_category, args.max_new_tokens)
        if args.traces is not None:
            args.traces.write_bytes(pickle.dumps((traces, *prior)))
    prior = tuple(prior)
    order = static_order(traces, prior)
    aggregated = static_order(traces, prior, AGGREGATE)
    streak_rates = fitted_rates(traces, prior, streak_cell)
    probability_rates = fitted_rates(traces, prior, probability_cell)
    variants: dict[str, Callable[[int], float]] = {
        "static order (the budget's)": lambda n: replay(traces, prior, lambda rows, root: order[:n]),
        "per row, by the parent row's streak": lambda n: replay(traces, prior, per_row_order(streak_rates, streak_cell, n)),
        "per row, by the candidate's stored probability":
            lambda n: replay(traces, prior, per_row_order(probability_rates, probability_cell, n)),
        f"rows aggregated over sightings (decay {AGGREGATE[0]}, power {AGGREGATE[1]}), static order":
            lambda n: replay(traces, prior, lambda rows, root: aggregated[:n], AGGREGATE),
    }
    measured = sum(t.measured for t in traces)
    print(f"{measured} measured questions after {len(traces) - measured} warm-up ones, template alone\n")
    print("| variant | " + " | ".join(f"MAT at {n}" for n in NODE_COUNTS) + " |")
    print("| --- |" + " ---: |" * len(NODE_COUNTS))
    for name, mat in variants.items():
        print(f"| {name} | " + " | ".join(f"{mat(n):.3f}" for n in NODE_COUNTS) + " |", flush=True)


if __name__ == "__main__":
    main()
