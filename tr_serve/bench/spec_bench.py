"""Spec-Bench style benchmark: plain greedy decoding vs Token Recycling trees vs prompt lookup decoding.

The model is loaded once. Every method gets its own engine (so each Token Recycling method keeps
its own adjacency matrix for the whole run: hot start), and the questions are interleaved: for each
question every method runs in turn, so machine noise hits all methods alike.

Definitions (written into the JSON under ``definitions``):

* ``mat``: mean accepted tokens per verification forward, prefill excluded. For the engine it is
  (new tokens - 1) / verification steps (the first token comes from the prefill forward); for PLD
  it is (new tokens - 1) / (forward passes - 1). Plain decoding is 1.0.
* ``tokens_per_s``: total new tokens / total wall time of that method (``time.perf_counter``).
* ``speedup``: ``tokens_per_s`` / baseline ``tokens_per_s`` of the same run (per category: the
  ratio of per-category tokens/s).
* ``identical``: every output token list equals the baseline's for the same question (EOS
  included when generation stopped at EOS).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tr_serve.data import SPEC_BENCH_DEV
from tr_serve.engine.config import CPU_KERNEL_MODES

DEFAULT_QUESTIONS = str(SPEC_BENCH_DEV)  # the packaged Spec-Bench dev questions (tr_serve/data)
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_JSON = os.path.join("bench_out", "bench.json")
PLD_NUM_TOKENS = 10
SEEDING_MODES = ("off", "on", "both")


class BenchError(ValueError):
    """Bad benchmark input (arguments, question file, tree, model): reported as one line, exit 2."""


@dataclass
class BenchConfig:
    questions: str = DEFAULT_QUESTIONS
    per_category: int = 2
    max_new_tokens: int = 128
    trees: tuple[str, ...] = ("2.2.2",)
    model: str = DEFAULT_MODEL
    json_out: str = DEFAULT_JSON
    prompt_seeding: str = "on"
    pld: bool = True
    warmup: int = 1
    device: str = "auto"
    dtype: str = "auto"
    k: int = 8
    time_split: bool = True
    threads: int | None = None  # torch CPU threads; None keeps torch's default
    cpu_kernels: str = "auto"  # EngineConfig.cpu_kernels for the baseline and every TR method

    def validate(self) -> None:
        if not isinstance(self.per_category, int) or self.per_category < 1:
            raise BenchError(f"--per-category must be a positive integer, got {self.per_category!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise BenchError(f"--max-new-tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise BenchError(f"--warmup must be a non-negative integer, got {self.warmup!r}")
        if self.threads is not None and self.threads < 1:
            raise BenchError(f"--threads must be a positive integer, got {self.threads!r}")
        if self.k < 1:
            raise BenchError(f"--k must be a positive integer, got {self.k!r}")
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise BenchError(f"--cpu-kernels must be 'auto' or 'torch', got {self.cpu_kernels!r}")
        if self.prompt_seeding not in SEEDING_MODES:
            raise BenchError(f"--prompt-seeding must be one of {', '.join(SEEDING_MODES)}, got {self.prompt_seeding!r}")
        if not self.trees:
            raise BenchError("give at least one --tree")
        from tr_serve.tr.tree import TreeTemplateError, load_template

        seen = set()
        for spec in self.trees:
            if spec.strip().lower() in ("none", "off", ""):
                raise BenchError(f"--tree {spec!r} is plain decoding, which the baseline method already measures")
            if spec in seen:
                raise BenchError(f"--tree {spec!r} is given twice")
            seen.add(spec)
            try:
                load_template(spec, self.k)
            except TreeTemplateError as e:
                raise BenchError(str(e)) from None
        from tr_serve.model_loader import parse_dtype

        try:
            parse_dtype(self.dtype, "cpu")
        except ValueError as e:
            raise BenchError(str(e)) from None
        m = self.model
        if (m.startswith(("/", "./", "../", "~")) or m.endswith(".gguf")) and not os.path.exists(os.path.expanduser(m)):
            raise BenchError(f"model path {m} does not exist")
        if not str(self.json_out).endswith(".json"):
            raise BenchError(f"--json must name a .json file, got {self.json_out!r}")


# ---- questions ---------------------------------------------------------------------------------

@dataclass
class Question:
    question_id: Any
    category: str
    text: str
    prompt_ids: list[int] = field(default_factory=list)


def read_questions(path: str | os.PathLike) -> list[Question]:
    """All questions of a Spec-Bench JSONL file, first turn only, in file order."""
    p = Path(path)
    if not p.is_file():
        raise BenchError(f"question file {p} does not exist (give one with --questions)")
    out: list[Question] = []
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BenchError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise BenchError(f"{p}:{lineno}: each line must be a JSON object")
            missing = [k for k in ("question_id", "category", "turns") if k not in obj]
            if missing:
                raise BenchError(f"{p}:{lineno}: missing {', '.join(missing)}")
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
                raise BenchError(f"{p}:{lineno}: 'turns' must be a non-empty list of strings")
            out.append(Question(obj["question_id"], str(obj["category"]), turns[0]))
    if not out:
        raise BenchError(f"question file {p} has no questions")
    return out


def select_questions(questions: Sequence[Question], per_category: int) -> tuple[list[Question], list[Question]]:
    """The first ``per_category`` questions of each category (categories in order of first
    appearance, questions in file order), and the questions left over."""
    by_cat: "OrderedDict[str, list[Question]]" = OrderedDict()
    for q in questions:
        by_cat.setdefault(q.category, []).append(q)
    chosen = [q for qs in by_cat.values() for q in qs[:per_category]]
    picked = {id(q) for q in chosen}
    rest = [q for q in questions if id(q) not in picked]
    return chosen, rest


def warmup_questions(chosen: Sequence[Question], rest: Sequence[Question], n: int) -> list[Question]:
    """Warm-up questions: unmeasured ones first (one per category, round robin, so the TR matrices
    are warmed on varied text), falling back to measured ones when the file has too few."""
    if n <= 0:
        return []
    by_cat: "OrderedDict[str, list[Question]]" = OrderedDict()
    for q in rest:
        by_cat.setdefault(q.category, []).append(q)
    ordered: list[Question] = []
    depth = 0
    while len(ordered) < len(rest):
        for qs in by_cat.values():
            if depth < len(qs):
                ordered.append(qs[depth])
        depth += 1
    pool = ordered + list(chosen)
    return [pool[i % len(pool)] for i in range(n)]


# ---- methods -----------------------------------------------------------------------------------

@dataclass
class Run:
    """One method on one question."""

    question_id: Any
    category: str
    token_ids: list[int]
    seconds: float
    forwards: int  # verification forwards, prefill excluded
    finish: str = ""
    engine_accepted: int | None = None  # sum(stats.accepted_per_step), engine methods only

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def accepted(self) -> int:
        """Tokens emitted by verification forwards (the prefill forward's first token excluded)."""
        return max(0, self.new_tokens - 1)


@dataclass
class Method:
    name: str
    kind: str  # "baseline", "tr" or "pld"
    tree: str | None = None
    prompt_seeding: bool = False
    llm: Any = None
    runs: list[Run] = field(default_factory=list)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run_engine(llm, prompt_ids: list[int], max_new_tokens: int, device: str) -> tuple[list[int], float, int, str, int]:
    """Greedy generation through the engine; returns (token ids, seconds, verification steps, finish,
    sum of ``stats.accepted_per_step``)."""
    from tr_serve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens)
    _sync(device)
    t0 = time.perf_counter()
    out = llm.generate([list(prompt_ids)], params)[0]
    _sync(device)
    seconds = time.perf_counter() - t0
    reason = getattr(out.finish_reason, "value", out.finish_reason)
    steps = list(out.stats.accepted_per_step)
    return list(out.token_ids), seconds, len(steps), str(reason), sum(steps)


class ForwardCounter:
    """Counts forward passes of a module while active (a forward hook, removed on exit)."""

    def __init__(self, module):
        self.module = module
        self.count = 0
        self._handle = None

    def _hook(self, *_args):
        self.count += 1

    def __enter__(self) -> "ForwardCounter":
        self.count = 0
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._handle = None


def run_pld(loaded, prompt_ids: list[int], max_new_tokens: int, device: str) -> tuple[list[int], float, int, str]:
    """Hugging Face prompt lookup decoding; returns (new token ids, seconds, forwards, finish).

    ``forwards`` counts every forward pass of the model, the prefill included."""
    import torch

    model = loaded.model
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    eos = list(loaded.eos_token_ids)
    with ForwardCounter(model) as counter, torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            prompt_lookup_num_tokens=PLD_NUM_TOKENS,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
        )
        new = out[0, len(prompt_ids):].tolist()
        _sync(device)
        seconds = time.perf_counter() - t0
    finish = "stop" if new and new[-1] in eos else "length"
    return new, seconds, counter.count, finish


# ---- the run -----------------------------------------------------------------------------------

def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {device}: CUDA is not available on this machine")
    return device


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} torch threads)"


def build_methods(cfg: BenchConfig) -> list[Method]:
    methods = [Method("baseline", "baseline", tree="none")]
    for spec in cfg.trees:
        # tr:<tree> runs as the engine does by default (prompt seeding on)
        if cfg.prompt_seeding in ("on", "both"):
            methods.append(Method(f"tr:{spec}", "tr", tree=spec, prompt_seeding=True))
        if cfg.prompt_seeding == "off":
            methods.append(Method(f"tr:{spec}", "tr", tree=spec, prompt_seeding=False))
        if cfg.prompt_seeding == "both":
            methods.append(Method(f"tr:{spec}-noseed", "tr", tree=spec, prompt_seeding=False))
    if cfg.pld:
        methods.append(Method("pld", "pld"))
    return methods


def _ratio(num: float, den: float, empty: float) -> float:
    return num / den if den else empty


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatch_info(loaded, prompt_ids: list[int], base: list[int], other: list[int]) -> dict:
    """Where ``other`` leaves the baseline, and how close the model's top-2 logits are there
    (a plain Hugging Face forward over prompt + common prefix)."""
    import torch

    pos = _first_difference(base, other)
    info: dict[str, Any] = {"position": pos, "baseline_len": len(base), "method_len": len(other)}
    if pos is None:
        return info
    info["baseline_token"] = base[pos] if pos < len(base) else None
    info["method_token"] = other[pos] if pos < len(other) else None
    model = loaded.model
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids) + list(base[:pos])], device=model.device)
        logits = model(ids).logits[0, -1].float()
    top = torch.topk(logits, 2)
    info["top2_tokens"] = top.indices.tolist()
    info["top2_logit_gap"] = float(top.values[0] - top.values[1])
    for key in ("baseline_token", "method_token"):
        if info[key] is not None:
            info[key.replace("token", "logit")] = float(logits[info[key]])
    return info


def summarize(methods: list[Method], categories: list[str]) -> dict:
    base = methods[0]
    assert base.kind == "baseline"

    def totals(runs: list[Run]) -> tuple[int, float, int, int]:
        return (sum(r.new_tokens for r in runs), sum(r.seconds for r in runs),
                sum(r.accepted for r in runs), sum(r.forwards for r in runs))

    base_tok, base_sec, _, _ = totals(base.runs)
    base_tps = _ratio(base_tok, base_sec, 0.0)
    base_cat = {}
    for cat in categories:
        t, s, _, _ = totals([r for r in base.runs if r.category == cat])
        base_cat[cat] = _ratio(t, s, 0.0)
    out: dict[str, dict] = {}
    for m in methods:
        tok, sec, acc, fwd = totals(m.runs)
        tps = _ratio(tok, sec, 0.0)
        entry: dict[str, Any] = {
            "mat": 1.0 if m.kind == "baseline" else _ratio(acc, fwd, 1.0),
            "tokens_per_s": tps,
            "speedup": 1.0 if m.kind == "baseline" else _ratio(tps, base_tps, 0.0),
            "identical": True,
            "per_category": {},
            "kind": m.kind,
            "new_tokens": tok,
            "seconds": sec,
            "verification_forwards": fwd,
        }
        if m.kind == "tr":
            # the engine's own count: tokens emitted per step, including any a stop point cut off
            entry["mat_accepted_per_step"] = _ratio(sum(r.engine_accepted or 0 for r in m.runs), fwd, 1.0)
        if m.tree and m.kind != "baseline":
            entry["tree"] = m.tree
            entry["prompt_seeding"] = m.prompt_seeding
        for cat in categories:
            runs = [r for r in m.runs if r.category == cat]
            t, s, a, f = totals(runs)
            cat_tps = _ratio(t, s, 0.0)
            entry["per_category"][cat] = {
                "mat": 1.0 if m.kind == "baseline" else _ratio(a, f, 1.0),
                "speedup": 1.0 if m.kind == "baseline" else _ratio(cat_tps, base_cat[cat], 0.0),
                "tokens_per_s": cat_tps,
                "new_tokens": t,
            }
        per_q = []
        for r, b in zip(m.runs, base.runs):
            same = r.token_ids == b.token_ids
            entry["identical"] &= same
            per_q.append({"question_id": r.question_id, "category": r.category, "new_tokens": r.new_tokens,
                          "verification_forwards": r.forwards, "seconds": round(r.seconds, 6),
                          "finish": r.finish, "identical": same})
        entry["per_question"] = per_q
        out[m.name] = entry
    return out


def _round(obj, digits: int = 6):
    if isinstance(obj, float):
        return round(obj, digits) if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _round(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round(v, digits) for v in obj]
    return obj


def run_bench(cfg: BenchConfig, loaded=None, progress: bool = True) -> dict:
    """Run the benchmark, write the JSON (and the PNG chart beside it) and return the result."""
    cfg.validate()
    chosen, rest = select_questions(read_questions(cfg.questions), cfg.per_category)
    warm = warmup_questions(chosen, rest, cfg.warmup)
    device = resolve_device(cfg.device)

    import torch
    from tqdm import tqdm

    from tr_serve.engine.timing import PhaseTimer
    from tr_serve.llm import LLM, encode_prompt
    from tr_serve.model_loader import load_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)

    if loaded is None:
        try:
            loaded = load_model(cfg.model, device=device, dtype=cfg.dtype)
        except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
            raise BenchError(f"cannot load model {cfg.model!r}: {e}".splitlines()[0]) from None
    device = str(next(loaded.model.parameters()).device.type)
    for q in chosen + warm:
        if not q.prompt_ids:
            q.prompt_ids = encode_prompt(loaded.tokenizer, [{"role": "user", "content": q.text}])
    longest = max(len(q.prompt_ids) for q in chosen + warm)
    max_pos = getattr(loaded.model.config, "max_position_embeddings", None) or 1 << 30
    max_model_len = max(2048, longest + cfg.max_new_tokens + 1)
    if max_model_len > max_pos:
        raise BenchError(f"the longest prompt has {longest} tokens; with --max-new-tokens {cfg.max_new_tokens} "
                         f"it exceeds the model's context of {max_pos} tokens")

    methods = build_methods(cfg)
    for m in methods:
        if m.kind == "pld":
            continue
        m.llm = LLM(model=cfg.model, tree=m.tree, k=cfg.k, loaded=loaded, max_num_seqs=1,
                    max_model_len=max_model_len, prompt_seeding=m.prompt_seeding, device=device,
                    cpu_kernels=cfg.cpu_kernels)
        if cfg.time_split:
            m.llm.engine.timer = PhaseTimer(device, enabled=True)

    def run_one(m: Method, q: Question) -> Run:
        if m.kind == "pld":
            ids, sec, forwards, finish = run_pld(loaded, q.prompt_ids, cfg.max_new_tokens, device)
            return Run(q.question_id, q.category, ids, sec, max(0, forwards - 1), finish)  # minus the prefill
        ids, sec, steps, finish, accepted = run_engine(m.llm, q.prompt_ids, cfg.max_new_tokens, device)
        return Run(q.question_id, q.category, ids, sec, steps, finish, accepted)

    total = (len(warm) + len(chosen)) * len(methods)
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    try:
        for i, q in enumerate(warm):
            for m in methods:
                bar.set_postfix_str(f"warm-up {i + 1}/{len(warm)} {m.name}", refresh=False)
                run_one(m, q)
                bar.update(1)
        for m in methods:
            if m.llm is not None:
                m.llm.engine.timer.reset()
        for i, q in enumerate(chosen):
            for m in methods:
                bar.set_postfix_str(f"q{q.question_id} {q.category} {m.name}", refresh=False)
                m.runs.append(run_one(m, q))
                bar.update(1)
    finally:
        bar.close()

    categories = list(OrderedDict.fromkeys(q.category for q in chosen))
    summary = summarize(methods, categories)
    for m in methods:
        entry = summary[m.name]
        if m.llm is not None and cfg.time_split:
            entry["time_split"] = m.llm.engine.timer.split()
        if not entry["identical"]:
            entry["mismatches"] = [
                {"question_id": q.question_id, "category": q.category,
                 **mismatch_info(loaded, q.prompt_ids, b.token_ids, r.token_ids)}
                for q, r, b in zip(chosen, m.runs, methods[0].runs) if r.token_ids != b.token_ids
            ]

    result = {
        "model": cfg.model,
        "device": device,
        "device_name": _device_name(device),
        "dtype": str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
        "questions": len(chosen),
        "question_ids": [q.question_id for q in chosen],
        "categories": categories,
        "warmup_question_ids": [q.question_id for q in warm],
        "max_new_tokens": cfg.max_new_tokens,
        "per_category": cfg.per_category,
        "prompt_seeding": cfg.prompt_seeding,
        "k": cfg.k,
        "pld_num_tokens": PLD_NUM_TOKENS if cfg.pld else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "definitions": {
            "mat": "accepted tokens per verification forward, prefill forward and its first token excluded: "
                   "engine (new_tokens-1)/verification_steps; pld (new_tokens-1)/(forwards-1); baseline 1.0",
            "tokens_per_s": "total new tokens / total perf_counter seconds of the method",
            "speedup": "tokens_per_s / baseline tokens_per_s in the same run",
            "identical": "every output token id list equals the baseline's for the same question",
        },
        "methods": summary,
    }
    result = _round(result)
    out = Path(cfg.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    from tr_serve.bench.report import write_chart

    write_chart(result, out.with_suffix(".png"))
    return result


# ---- command line ------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, metavar="PATH",
                   help="Spec-Bench JSONL (question_id, category, turns); the first turn is the user message "
                        "(default: the Spec-Bench dev questions packaged in tr_serve/data)")
    p.add_argument("--per-category", type=_positive_int, default=2, metavar="N",
                   help="first N questions of each category (default: 2)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N", help="default: 128")
    p.add_argument("--tree", action="append", dest="trees", metavar="NAME|PATH",
                   help="Token Recycling tree template, repeatable (default: 2.2.2)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    p.add_argument("--json", dest="json_out", default=DEFAULT_JSON, metavar="OUT",
                   help=f"result JSON; the chart is written beside it as .png (default: {DEFAULT_JSON})")
    p.add_argument("--prompt-seeding", choices=SEEDING_MODES, default="on",
                   help="seed the TR matrix from the prompt, as the engine does by default; 'both' adds a "
                        "method tr:<tree>-noseed per tree (default: on)")
    p.add_argument("--cpu-kernels", choices=CPU_KERNEL_MODES, default="auto",
                   help="linear kernels of the baseline and TR methods on CPU: the fastest measured per token "
                        "count, or torch's own (default: auto)")
    p.add_argument("--no-pld", dest="pld", action="store_false", help="skip the prompt lookup decoding peer")
    p.add_argument("--warmup", type=_non_negative_int, default=1, metavar="N",
                   help="questions decoded untimed by every method first (they warm the TR matrices too; default: 1)")
    p.add_argument("--k", type=_positive_int, default=8, help="candidates per matrix row (default: 8)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)")
    p.add_argument("--no-time-split", dest="time_split", action="store_false",
                   help="do not time the engine phases (on CUDA the phase timer synchronizes)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        questions=args.questions, per_category=args.per_category, max_new_tokens=args.max_new_tokens,
        trees=tuple(args.trees or ("2.2.2",)), model=args.model, json_out=args.json_out,
        prompt_seeding=args.prompt_seeding, pld=args.pld, warmup=args.warmup, device=args.device,
        dtype=args.dtype, k=args.k, time_split=args.time_split, threads=args.threads,
        cpu_kernels=args.cpu_kernels,
    )


def execute(args: argparse.Namespace, prog: str = "tr-serve bench", progress: bool = True) -> int:
    """Run from parsed arguments: tables on stdout, errors as one line on stderr (exit 2)."""
    from tr_serve.bench.report import markdown_tables

    try:
        result = run_bench(config_from_args(args), progress=progress)
    except BenchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(markdown_tables(result))
    png = Path(args.json_out).with_suffix(".png")
    print(f"\nwrote {args.json_out} and {png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from tr_serve.cli import OneLineErrorParser

    parser = OneLineErrorParser(prog="tr-serve bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return execute(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
