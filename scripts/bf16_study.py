"""bfloat16 vs float32 on CPU: speed, losslessness, and how often a verify forward's argmax differs
from a one-token forward's (issue 11, item 4).

    .venv/bin/python scripts/bf16_study.py --per-category 1 --max-new-tokens 64 --threads 1

For each dtype (the embedded SmolLM2-135M loaded through ``tr_serve.model_loader.load_model``):

1. **Decoding** on the packaged Spec-Bench dev questions (the bench's own question loader, chat
   template, one warm-up question): plain greedy decoding through the engine (``baseline``, tree
   ``none``), Token Recycling (``tr:auto``, ``tr:2.2.2``) through the same runner, and transformers'
   ``model.generate(do_sample=False)`` (``hf-greedy``), interleaved question by question as in
   ``tr-serve bench``. Reported: tokens/s, MAT, and whether every output equals plain decoding in
   the same dtype (``identical``) and ``hf-greedy`` in the same dtype (``identical_to_hf``); each
   first divergence with the model's top-2 logit gap there.
2. **Argmax agreement**: every plain-decoded sequence is replayed through the baseline's runner as
   forwards of ``q`` query tokens (q = 1, then each ``--query-tokens``; a causal chunk of the
   sequence, the last chunk padded to q tokens so the GEMMs keep their shape; the cache keeps what
   each forward wrote, as a verify step does). At each position the argmax of the q-token forward is
   compared with the one-token forward's; every disagreement is listed with both forwards' top-2
   gaps. The q = 1 replay must reproduce plain decoding (``replay_matches_plain``).
3. **Batch invariance**: each distinct linear shape of the model (first layer and LM head), rows
   run alone and inside M-row calls; a row whose output changes with M is batch-variant. In float32
   both torch's ``F.linear`` and the runner's kernel plan are checked. The same for the runner's
   attention call on the model's head shapes (q query rows at once vs one at a time).
4. **Forward latency** of 1, 8 and 80 query tokens, the dtypes' runners interleaved round by round
   (``--latency-only`` for just this part).

The decision: bfloat16 may become the CPU default only if every output is identical and no argmax
differs (``bf16_default_ok``). JSON: ``--json`` (default bench_out/bf16_study.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TREES = ("auto", "2.2.2")
DEFAULT_DTYPES = ("float32", "bfloat16")
DEFAULT_QUERY_TOKENS = (8, 80)
INVARIANCE_ROWS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80)
NEAR_TIE = 0.125  # a top-2 gap at or below this is within a step or two of bf16 rounding at logit ~10-30


# ---- 3. linear batch invariance -------------------------------------------------------------------

def _distinct_linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each distinct (out, in) linear shape among the first decoder layer and the
    LM head."""
    seen, out = set(), []
    layers = getattr(getattr(model, "model", model), "layers", None)
    candidates = list(layers[0].named_modules(prefix="layers.0")) if layers is not None else []
    candidates.append(("lm_head", model.get_output_embeddings()))
    for name, mod in candidates:
        if isinstance(mod, torch.nn.Linear) and (mod.out_features, mod.in_features) not in seen:
            seen.add((mod.out_features, mod.in_features))
            out.append((name, mod))
    return out


def batch_variant_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                       row_counts: Sequence[int]) -> dict[int, int]:
    """For each M: how many of the first M rows of ``x`` come out of ``fn(x[:M])`` differently (bit
    for bit) from ``fn`` on that row alone."""
    alone = [fn(x[i : i + 1]) for i in range(max(row_counts))]
    out = {}
    for m in row_counts:
        y = fn(x[:m])
        out[m] = sum(int(not torch.equal(y[i : i + 1], alone[i])) for i in range(m))
    return out


def linear_invariance(model: torch.nn.Module, row_counts: Sequence[int] = INVARIANCE_ROWS,
                      plan=None, seed: int = 0) -> dict[str, Any]:
    """Per distinct linear shape: batch-variant rows per M, with torch's ``F.linear`` and (float32
    only, when ``plan`` is given) the runner's kernel plan."""
    from tr_serve.kernels import cpu_kernels

    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    report: dict[str, Any] = {}
    calls = {}
    if plan is not None:
        for call in cpu_kernels.kernel_calls(model):
            members = call.members if isinstance(call, cpu_kernels.FusedGroup) else (call,)
            for m in members:
                calls[id(m)] = call
    for name, mod in _distinct_linears(model):
        x = torch.randn(max(row_counts), mod.in_features, generator=g).to(dtype)
        weight, bias = mod.weight, mod.bias
        entry = {"shape": [mod.out_features, mod.in_features],
                 "torch": batch_variant_rows(lambda h: F.linear(h, weight, bias), x, row_counts)}
        if plan is not None and id(mod) in calls:
            call = calls[id(mod)]
            entry["plan"] = batch_variant_rows(lambda h: cpu_kernels.run_planned(call, h, plan), x, row_counts)
        report[name] = entry
    report["invariant"] = {k: all(v[k][m] == 0 for v in report.values() for m in v[k])
                           for k in ("torch", "plan") if any(k in v for v in report.values())}
    return report


def attention_invariance(config, dtype: torch.dtype, context: int = 256, query_tokens: Sequence[int] = (8, 80),
                         seed: int = 0) -> dict[str, dict[str, int]]:
    """The runner's attention call (``scaled_dot_product_attention`` with GQA under a 4D additive mask)
    on the model's head shapes: per q, how many of q causal query rows over a ``context`` prefix differ
    bit for bit from the same row run alone, over the same keys (``same_kv``) and over the keys up
    to its own slot, as a one-token forward sees them (``own_kv``)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    g = torch.Generator().manual_seed(seed)
    out = {}
    for q in query_tokens:
        n = context + q
        k, v = (torch.randn(1, kv_heads, n, d, generator=g).to(dtype) for _ in range(2))
        x = torch.randn(1, heads, q, d, generator=g).to(dtype)
        visible = torch.ones(q, n, dtype=torch.bool)
        visible[:, context:] = torch.ones(q, q, dtype=torch.bool).tril()
        mask = torch.zeros(1, 1, q, n, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)

        def sdpa(i, j, kv):
            return F.scaled_dot_product_attention(x[:, :, i:j], k[:, :, :kv], v[:, :, :kv], attn_mask=mask[:, :, i:j, :kv],
                                                  enable_gqa=heads != kv_heads)

        full = sdpa(0, q, n)
        out[str(q)] = {"same_kv": sum(int(not torch.equal(sdpa(i, i + 1, n), full[:, :, i : i + 1])) for i in range(q)),
                       "own_kv": sum(int(not torch.equal(sdpa(i, i + 1, context + i + 1), full[:, :, i : i + 1]))
                                     for i in range(q))}
    return out


# ---- 2. argmax agreement ---------------------------------------------------------------------------

def replay_logits(runner, prompt_ids: Sequence[int], token_ids: Sequence[int], q: int, row: int = 0) -> torch.Tensor:
    """Logits [n - 1, V] at the positions of ``token_ids[:-1]`` (each predicting the next token),
    computed as causal forwards of exactly ``q`` query tokens over ``prompt_ids`` prefilled in
    ``row``; the last chunk is padded to ``q`` with filler tokens after the real ones (a causal mask:
    they change no real position's inputs, only the shapes). The row is freed afterwards."""
    inputs = list(token_ids[:-1])
    if len(prompt_ids) + len(inputs) + q > runner.max_len:
        raise ValueError(f"prompt {len(prompt_ids)} + {len(inputs)} tokens + {q} query tokens exceed the runner's "
                         f"max_len {runner.max_len}")
    rows = torch.tensor([row])
    depths = torch.arange(q)
    mask = torch.ones(q, q, dtype=torch.bool).tril()
    filler = int(token_ids[-1]) if token_ids else 0
    out = []
    runner.free(row)
    try:
        runner.prefill(rows, [list(prompt_ids)])
        for start in range(0, len(inputs), q):
            chunk = inputs[start : start + q]
            tokens = torch.tensor([chunk + [filler] * (q - len(chunk))], dtype=torch.long)
            logits = runner.verify(rows, tokens, depths, mask)[0, : len(chunk)].float().cpu()
            out.append(logits)
            runner.compact(rows, [torch.arange(len(chunk))])
    finally:
        runner.free(row)
    if not out:
        return torch.zeros(0, runner.vocab_size)
    return torch.cat(out)


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    top = torch.topk(logits.float(), 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def compare_argmax(one: torch.Tensor, multi: torch.Tensor, q: int) -> dict[str, Any]:
    """Where the q-token forward's argmax differs from the one-token forward's, position by position
    (``one`` and ``multi`` [n, V], the same positions), with both forwards' top-2 gaps there."""
    a1, aq = one.argmax(-1), multi.argmax(-1)
    g1, gq = top2_gap(one), top2_gap(multi)
    differ = (a1 != aq).nonzero().flatten().tolist()
    equal_rows = int((one == multi).all(-1).sum()) if len(one) else 0
    return {
        "positions": len(one),
        "disagreements": len(differ),
        "bit_identical_logit_rows": equal_rows,
        "max_abs_logit_diff": float((one - multi).abs().max()) if len(one) else 0.0,
        "detail": [{"position": i, "first_chunk": i < q, "one_token_argmax": int(a1[i]), "multi_argmax": int(aq[i]),
                    "one_token_top2_gap": float(g1[i]), "multi_top2_gap": float(gq[i]),
                    "one_token_logit_of_multi_argmax": float(one[i, aq[i]])} for i in differ],
    }


def argmax_study(runner, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
                 query_tokens: Sequence[int], question_ids: Sequence[Any] | None = None) -> dict[str, Any]:
    """Replays every (prompt, plain output) at q = 1 and at each of ``query_tokens``; totals and
    per-question disagreements, plus the one-token forward's near ties (the positions at risk)."""
    question_ids = list(question_ids) if question_ids is not None else list(range(len(prompts)))
    totals = {str(q): {"positions": 0, "disagreements": 0, "bit_identical_logit_rows": 0, "max_abs_logit_diff": 0.0,
                       "detail": []} for q in query_tokens}
    replay_ok, exact_ties, near_ties, positions = True, 0, 0, 0
    gaps: list[float] = []
    for qid, prompt, out in zip(question_ids, prompts, outputs):
        if len(out) < 2:
            continue
        one = replay_logits(runner, prompt, out, 1)
        targets = torch.tensor(list(out[1:]))
        if not torch.equal(one.argmax(-1), targets):
            replay_ok = False
        g = top2_gap(one)
        gaps.extend(g.tolist())
        exact_ties += int((g == 0).sum())
        near_ties += int((g <= NEAR_TIE).sum())
        positions += len(one)
        for q in query_tokens:
            r = compare_argmax(one, replay_logits(runner, prompt, out, q), q)
            t = totals[str(q)]
            for key in ("positions", "disagreements", "bit_identical_logit_rows"):
                t[key] += r[key]
            t["max_abs_logit_diff"] = max(t["max_abs_logit_diff"], r["max_abs_logit_diff"])
            t["detail"].extend({"question_id": qid, **d} for d in r["detail"])
    gaps.sort()
    return {
        "replay_matches_plain": replay_ok,
        "positions": positions,
        "one_token_exact_ties": exact_ties,
        f"one_token_gap_le_{NEAR_TIE}": near_ties,
        "one_token_gap_median": gaps[len(gaps) // 2] if gaps else None,
        "by_query_tokens": totals,
    }


# ---- 1. decoding -------------------------------------------------------------------------------------

def decode_study(loaded, chosen, warm, trees: Sequence[str], max_new_tokens: int, max_model_len: int,
                 hf: bool = True, k: int = 8, dtype_name: str = "auto"):
    """Engine plain decoding, TR per tree and (``hf``) ``generate``, interleaved per question; returns
    (methods, summary) as ``tr-serve bench`` summarises them, plus ``identical_to_hf`` per method."""
    from tr_serve.bench.methods import Method, run_engine, run_hf
    from tr_serve.bench.records import Run
    from tr_serve.bench.summary import logit_gap_at, summarize
    from tr_serve.llm import LLM

    methods = [Method("baseline", "baseline", tree="none")]
    methods += [Method(f"tr:{t}", "tr", tree=t, prompt_seeding=True) for t in trees]
    if hf:
        methods.append(Method("hf-greedy", "hf", reference="hf-greedy"))
    for m in methods:
        if m.engine:
            m.llm = LLM(model=loaded.model_id, tree=m.tree, k=k, loaded=loaded, max_num_seqs=1,
                        max_model_len=max_model_len, prompt_seeding=m.prompt_seeding, device="cpu",
                        dtype=dtype_name)

    def run_one(m, q):
        if not m.engine:
            ids, sec, forwards, finish = run_hf(loaded, q.prompt_ids, max_new_tokens, "cpu")
            return Run(q.question_id, q.category, ids, sec, max(0, forwards - 1), max(0, len(ids) - 1), finish)
        ids, sec, steps, finish = run_engine(m.llm, q.prompt_ids, max_new_tokens, "cpu")
        return Run(q.question_id, q.category, ids, sec, len(steps), sum(steps), finish)

    for q in warm:
        for m in methods:
            run_one(m, q)
    for q in chosen:
        for m in methods:
            m.runs.append(run_one(m, q))
    categories = list(dict.fromkeys(q.category for q in chosen))
    summary = summarize(methods, categories)
    by_name = {m.name: m for m in methods}
    for m in methods:
        entry = summary[m.name]
        ref = by_name[entry["identical_to"]] if entry["identical_to"] else None
        for mm in entry.get("mismatches", []):
            i = next(j for j, q in enumerate(chosen) if q.question_id == mm["question_id"])
            mm.update(logit_gap_at(loaded, chosen[i].prompt_ids, ref.runs[i].token_ids, mm))
        if hf and m.kind == "tr":
            entry["identical_to_hf"] = all(r.token_ids == h.token_ids
                                           for r, h in zip(m.runs, by_name["hf-greedy"].runs))
        entry.pop("per_question", None)
        entry.pop("per_category", None)
    return methods, summary


# ---- 4. forward latency, dtypes interleaved ----------------------------------------------------------

def interleaved_latency(runners: dict[str, Any], context: int = 256, query_tokens: Sequence[int] = (1, 8, 80),
                        rounds: int = 5) -> dict[str, dict[str, float]]:
    """Milliseconds of one ``runner.verify`` of q tree tokens over a ``context``-token prefix (the
    latency bench's binary tree), per dtype: the minimum over ``rounds`` rounds in which every dtype
    and q run in turn (order reversed every other round), so a busy machine hits all alike."""
    from tr_serve.bench.latency import tree_inputs

    rows = torch.tensor([0])
    pairs = [(name, q) for name in runners for q in query_tokens]
    best = {pair: float("inf") for pair in pairs}
    inputs = {q: tree_inputs(q, next(iter(runners.values())).vocab_size) for q in query_tokens}
    for runner in runners.values():
        runner.free(0)
        runner.prefill(rows, [[(10 + j) % 1000 for j in range(context)]])
    try:
        for name, q in pairs:
            runners[name].verify(rows, *inputs[q])  # warm-up
        for r in range(rounds):
            for name, q in (pairs if r % 2 == 0 else pairs[::-1]):
                t0 = time.perf_counter()
                runners[name].verify(rows, *inputs[q])
                best[name, q] = min(best[name, q], time.perf_counter() - t0)
    finally:
        for runner in runners.values():
            runner.free(0)
    return {name: {str(q): round(best[name, q] * 1e3, 2) for q in query_tokens} for name in runners}


# ---- the study ---------------------------------------------------------------------------------------

def _git_head() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run_study(load: Callable[[str], Any], dtypes: Sequence[str] = DEFAULT_DTYPES, trees: Sequence[str] = DEFAULT_TREES,
              per_category: int = 1, max_new_tokens: int = 64, query_tokens: Sequence[int] = DEFAULT_QUERY_TOKENS,
              questions: str | None = None, warmup: int = 1, hf: bool = True, k: int = 8,
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
              encode: Callable[[Any, str], list[int]] | None = None, latency_rounds: int = 5,
              decode: bool = True) -> dict[str, Any]:
    """``load(dtype_name)`` returns a LoadedModel in that dtype; ``encode(tokenizer, text)`` the prompt
    ids of a question (default: the chat template, as the bench). ``decode=False`` measures only the
    interleaved forward latency (``latency_rounds`` rounds; 0 skips it). Returns the JSON-ready result."""
    from tr_serve.bench.questions import DEFAULT_QUESTIONS
    from tr_serve.bench.records import read_questions, select_questions, warmup_questions
    from tr_serve.engine.prompt import encode_prompt

    chosen, rest = select_questions(read_questions(questions or DEFAULT_QUESTIONS), per_category)
    warm = warmup_questions(chosen, rest, warmup)
    result: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "git_head": _git_head(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "questions": len(chosen), "question_ids": [q.question_id for q in chosen],
        "warmup_question_ids": [q.question_id for q in warm],
        "max_new_tokens": max_new_tokens, "trees": list(trees), "query_tokens": [1, *query_tokens],
        "near_tie": NEAR_TIE,
        "dtypes": {},
    }
    baselines, plain_runners = {}, {}
    for name in dtypes:
        t0 = time.perf_counter()
        loaded = load(name)
        if not decode:
            from tr_serve.llm import LLM

            plain_runners[name] = LLM(model=loaded.model_id, tree="none", loaded=loaded, max_num_seqs=1,
                                      device="cpu", dtype=name).engine.runner
            continue
        for q in chosen + warm:
            q.prompt_ids = (encode(loaded.tokenizer, q.text) if encode is not None else
                            encode_prompt(loaded.tokenizer, [{"role": "user", "content": q.text}]))
        longest = max(len(q.prompt_ids) for q in chosen + warm)
        max_model_len = max(2048, longest + max_new_tokens + max(query_tokens, default=1) + 1)
        log(f"[{name}] decoding {len(chosen)} questions: baseline, {', '.join('tr:' + t for t in trees)}"
            f"{', hf-greedy' if hf else ''}")
        methods, summary = decode_study(loaded, chosen, warm, trees, max_new_tokens, max_model_len, hf, k, name)
        base = next(m for m in methods if m.name == "baseline")
        baselines[name] = [r.token_ids for r in base.runs]
        runner = plain_runners[name] = base.llm.engine.runner
        log(f"[{name}] argmax agreement: replays at q = 1, {', '.join(map(str, query_tokens))}")
        agreement = argmax_study(runner, [q.prompt_ids for q in chosen], baselines[name], query_tokens,
                                 [q.question_id for q in chosen])
        log(f"[{name}] linear batch invariance")
        invariance = linear_invariance(loaded.model, plan=runner.kernel_plan)
        outputs_identical = all(e["identical"] is not False and e.get("identical_to_hf", True)
                                for e in summary.values())
        result["dtypes"][name] = {
            "model_dtype": str(runner.dtype).replace("torch.", ""),
            "kernel_plan": None if runner.kernel_plan is None else
            dict(zip(map(str, runner.kernel_plan.points), runner.kernel_plan.kernels)),
            "methods": summary,
            "outputs_identical": outputs_identical,
            "argmax_agreement": agreement,
            "linear_batch_invariance": invariance,
            "attention_batch_variant_rows": attention_invariance(loaded.model.config, runner.dtype,
                                                                 query_tokens=query_tokens),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        for m in methods:
            m.llm = None
        del methods, base, runner, loaded
    if latency_rounds > 0:
        log(f"forward latency, {', '.join(plain_runners)} interleaved, {latency_rounds} rounds")
        result["forward_latency_ms"] = {"context": 256, "rounds": latency_rounds,
                                        "by_dtype": interleaved_latency(plain_runners, rounds=latency_rounds)}
    plain_runners.clear()
    if len(baselines) > 1:
        names = list(baselines)
        a, b = baselines[names[0]], baselines[names[1]]
        from tr_serve.bench.records import first_mismatch

        result["cross_dtype_plain"] = {
            "dtypes": names[:2],
            "identical_questions": sum(x == y for x, y in zip(a, b)),
            "first_divergence": [None if (mm := first_mismatch(x, y)) is None else mm["position"] for x, y in zip(a, b)],
        }
    bf = result["dtypes"].get("bfloat16")
    if bf is not None:
        agree = bf["argmax_agreement"]
        result["bf16_default_ok"] = bool(
            bf["outputs_identical"] and agree["replay_matches_plain"]
            and all(t["disagreements"] == 0 for t in agree["by_query_tokens"].values()))
    return result


def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def report(result: dict[str, Any]) -> str:
    lines = []
    if "forward_latency_ms" in result:
        lat = result["forward_latency_ms"]
        qs = list(next(iter(lat["by_dtype"].values())))
        lines += [f"forward latency, ms (context {lat['context']}, min of {lat['rounds']} interleaved rounds)", "",
                  "| dtype | " + " | ".join(f"q={q}" for q in qs) + " |", "| --- |" + " ---: |" * len(qs)]
        lines += [f"| {n} | " + " | ".join(f"{v[q]:.1f}" for q in qs) + " |" for n, v in lat["by_dtype"].items()]
        lines.append("")
    if not result["dtypes"]:
        return "\n".join(lines)
    lines += ["| dtype | method | MAT | tokens/s | vs plain | identical to plain | identical to generate |",
             "| --- | --- | ---: | ---: | ---: | :---: | :---: |"]
    for name, d in result["dtypes"].items():
        for m, e in d["methods"].items():
            same_plain = "-" if m in ("baseline", "hf-greedy") else ("yes" if e["identical"] else "no")
            same_hf = {"baseline": e["identical"]}.get(m, e.get("identical_to_hf"))
            same_hf = "-" if same_hf is None else ("yes" if same_hf else "no")
            lines.append(f"| {name} | {m} | {_fmt(e['mat'])} | {_fmt(e['tokens_per_s'])} | {_fmt(e['speedup'])}x | "
                         f"{same_plain} | {same_hf} |")
    lines += ["", "| dtype | query tokens | positions | argmax differs | bit-identical logit rows | max abs logit diff |",
              "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, d in result["dtypes"].items():
        a = d["argmax_agreement"]
        for q, t in a["by_query_tokens"].items():
            lines.append(f"| {name} | {q} | {t['positions']} | {t['disagreements']} | {t['bit_identical_logit_rows']} | "
                         f"{t['max_abs_logit_diff']:.4g} |")
    for name, d in result["dtypes"].items():
        a = d["argmax_agreement"]
        lines.append(f"\n{name}: q=1 replay reproduces plain decoding: {a['replay_matches_plain']}; one-token top-2 "
                     f"gap: exact ties {a['one_token_exact_ties']}, <= {result['near_tie']} "
                     f"{a[f'one_token_gap_le_{NEAR_TIE}']} of {a['positions']} positions, median "
                     f"{_fmt(a['one_token_gap_median'], 3)}")
        for q, t in a["by_query_tokens"].items():
            for dd in t["detail"]:
                lines.append(f"  q={q} question {dd['question_id']} pos {dd['position']}: one-token gap "
                             f"{dd['one_token_top2_gap']:.4g}, {q}-token gap {dd['multi_top2_gap']:.4g}")
        inv = d["linear_batch_invariance"]
        variant = {f"{n}/{k}": [m for m, c in v[k].items() if c] for n, v in inv.items() if n != "invariant"
                   for k in ("torch", "plan") if k in v and any(v[k].values())}
        lines.append(f"{name}: linears batch invariant {inv['invariant']}; batch-variant M per linear: {variant or 'none'}")
        if "attention_batch_variant_rows" in d:
            lines.append(f"{name}: attention rows that change inside a q-row call: {d['attention_batch_variant_rows']}")
        for m, e in d["methods"].items():
            for mm in e.get("mismatches", []):
                lines.append(f"  {m} leaves {e['identical_to']} at question {mm['question_id']} pos {mm['position']}: "
                             f"top-2 gap {_fmt(mm.get('top2_logit_gap'), 4)}")
    if "cross_dtype_plain" in result:
        c = result["cross_dtype_plain"]
        lines.append(f"\nplain decoding {c['dtypes'][0]} vs {c['dtypes'][1]}: {c['identical_questions']} of "
                     f"{len(c['first_divergence'])} questions identical; first divergence {c['first_divergence']}")
    if "bf16_default_ok" in result:
        lines.append(f"bfloat16 can be the CPU default (every output identical, no argmax differs): "
                     f"{result['bf16_default_ok']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default=",".join(DEFAULT_DTYPES))
    ap.add_argument("--trees", default=",".join(DEFAULT_TREES))
    ap.add_argument("--questions", default=None, help="Spec-Bench JSONL (default: the packaged dev questions)")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--query-tokens", default=",".join(map(str, DEFAULT_QUERY_TOKENS)))
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="skip model.generate")
    ap.add_argument("--latency-rounds", type=int, default=5, help="interleaved forward-latency rounds (0: none)")
    ap.add_argument("--latency-only", action="store_true", help="only the interleaved forward latency")
    ap.add_argument("--json", default=os.path.join("bench_out", "bf16_study.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from tr_serve.model_loader import load_model, parse_dtype

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        parse_dtype(d, "cpu")
    result = run_study(lambda d: load_model(args.model, device="cpu", dtype=d), dtypes,
                       [t.strip() for t in args.trees.split(",") if t.strip()], args.per_category,
                       args.max_new_tokens, [int(q) for q in args.query_tokens.split(",") if q.strip()],
                       args.questions, args.warmup, not args.no_hf, latency_rounds=args.latency_rounds,
                       decode=not args.latency_only)
    result["command"] = "scripts/bf16_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
