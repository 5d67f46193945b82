"""Spec-Bench style benchmark: plain greedy decoding vs Token Recycling trees vs prompt lookup decoding.

The model is loaded once. Methods (names as in the JSON):

* ``baseline``: plain greedy decoding through the engine (tree ``none``).
* ``tr:<tree>``: the engine with that tree setting (``2.2.2``, ``top8+ctx``, ``auto``, a .json...).
* ``pld``: prompt lookup through the same engine, runner, kernels and verifier (tree ``pld``): the
  only difference from ``tr:*`` is the draft.
* ``hf-greedy`` and ``hf-pld``: transformers' ``generate`` (torch's own kernels), plain greedy and
  prompt lookup decoding, a reference pair outside the engine.

Every engine method has its own engine (so each Token Recycling method keeps its own adjacency
matrix for the whole run: hot start), and the questions are interleaved: for each question every
method runs in turn, so machine noise hits all methods alike.

Definitions (written into the JSON under ``definitions``):

* ``mat``: tokens per verification forward, the prefill forward and its first token excluded. Engine
  methods: sum / count of ``RequestOutput.stats.accepted_per_step``; hf-*: (new tokens - 1) /
  (forward passes - 1).
* ``tokens_per_s``: total new tokens / total wall time of that method (``time.perf_counter``).
* ``speedup``: ``tokens_per_s`` / ``tokens_per_s`` of the method's own framework's plain greedy
  decoding in the same run (``reference``): ``baseline`` for engine methods, ``hf-greedy`` for
  hf-*. Per category: the ratio of per-category tokens/s.
* ``identical``: every output token list equals the baseline's for the same question (EOS
  included when generation stopped at EOS); the baseline's own is checked against ``hf-greedy``
  (null when the hf rows are skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tr_serve.bench.records import (BenchError, Question, Run, check_same_questions, method_entry,  # noqa: F401 - re-exported
                                    non_negative_int, positive_int, read_questions, round_floats, select_questions,
                                    warmup_questions)
from tr_serve.data import SPEC_BENCH_DEV
from tr_serve.engine.config import CPU_KERNEL_MODES

DEFAULT_QUESTIONS = str(SPEC_BENCH_DEV)  # the packaged Spec-Bench dev questions (tr_serve/data)
DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_JSON = os.path.join("bench_out", "bench.json")
HF_PLD_NUM_TOKENS = 10  # transformers' prompt_lookup_num_tokens for hf-pld
SEEDING_MODES = ("off", "on", "both")


@dataclass
class BenchConfig:
    questions: str = DEFAULT_QUESTIONS
    per_category: int = 2
    max_new_tokens: int = 128
    trees: tuple[str, ...] = ("2.2.2",)
    model: str = DEFAULT_MODEL
    json_out: str = DEFAULT_JSON
    prompt_seeding: str = "on"
    pld: bool = True  # same-runner prompt lookup (engine tree "pld")
    hf: bool = True  # transformers' generate: hf-greedy and hf-pld
    warmup: int = 1
    device: str = "auto"
    dtype: str = "auto"
    k: int = 8
    time_split: bool = True
    threads: int | None = None  # torch CPU threads; None keeps torch's default
    cpu_kernels: str = "auto"  # EngineConfig.cpu_kernels of every engine method (baseline, tr:*, pld)

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
        seen = set()
        for spec in self.trees:
            validate_tree(spec, self.k)
            if spec.strip() in seen:
                raise BenchError(f"--tree {spec!r} is given twice")
            seen.add(spec.strip())
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


def validate_tree(spec: str, k: int) -> None:
    """A ``--tree`` the engine accepts (:func:`tr_serve.tr.tree_spec.parse_tree_spec`, then the
    template part loaded), other than plain decoding and same-runner ``pld`` (methods of their own)."""
    from tr_serve.tr.tree import TreeTemplateError, load_template
    from tr_serve.tr.tree_spec import parse_tree_spec

    try:
        parsed = parse_tree_spec(spec)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if parsed.plain:
        raise BenchError(f"--tree {spec!r} is plain decoding, which the baseline method already measures")
    if parsed.template is None:
        raise BenchError(f"--tree {spec!r} is same-runner prompt lookup, measured as the method 'pld' "
                         "(on unless --no-pld)")
    try:
        load_template(parsed.template, k)
    except TreeTemplateError as e:
        raise BenchError(str(e)) from None


# ---- methods -----------------------------------------------------------------------------------

@dataclass
class Method:
    name: str
    kind: str  # "baseline", "tr", "pld" (engine methods) or "hf" (transformers' generate)
    tree: str | None = None  # engine tree setting
    prompt_seeding: bool = False
    reference: str = "baseline"  # the method whose tokens/s is the denominator of this one's speedup
    lookup: int = 0  # hf: prompt_lookup_num_tokens, 0 for plain greedy
    llm: Any = None
    runs: list[Run] = field(default_factory=list)

    @property
    def engine(self) -> bool:
        return self.kind != "hf"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run_engine(llm, prompt_ids: list[int], max_new_tokens: int, device: str) -> tuple[list[int], float, list[int], str]:
    """Greedy generation through the engine; returns (token ids, seconds, ``stats.accepted_per_step``,
    finish reason)."""
    from tr_serve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens)
    _sync(device)
    t0 = time.perf_counter()
    out = llm.generate([list(prompt_ids)], params)[0]
    _sync(device)
    seconds = time.perf_counter() - t0
    reason = getattr(out.finish_reason, "value", out.finish_reason)
    return list(out.token_ids), seconds, list(out.stats.accepted_per_step), str(reason)


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


def run_hf(loaded, prompt_ids: list[int], max_new_tokens: int, device: str,
           lookup: int = 0) -> tuple[list[int], float, int, str]:
    """transformers' greedy ``generate`` (torch's own kernels), with prompt lookup decoding of
    ``lookup`` tokens when > 0; returns (new token ids, seconds, forwards, finish).

    ``forwards`` counts every forward pass of the model, the prefill included."""
    import torch

    model = loaded.model
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    eos = list(loaded.eos_token_ids)
    extra = {"prompt_lookup_num_tokens": lookup} if lookup > 0 else {}
    with ForwardCounter(model) as counter, torch.inference_mode():
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
            **extra,
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
    for spec in (t.strip() for t in cfg.trees):
        # tr:<tree> runs as the engine does by default (prompt seeding on)
        if cfg.prompt_seeding in ("on", "both"):
            methods.append(Method(f"tr:{spec}", "tr", tree=spec, prompt_seeding=True))
        if cfg.prompt_seeding == "off":
            methods.append(Method(f"tr:{spec}", "tr", tree=spec, prompt_seeding=False))
        if cfg.prompt_seeding == "both":
            methods.append(Method(f"tr:{spec}-noseed", "tr", tree=spec, prompt_seeding=False))
    if cfg.pld:
        methods.append(Method("pld", "pld", tree="pld"))
    if cfg.hf:
        methods.append(Method("hf-greedy", "hf", reference="hf-greedy"))
        methods.append(Method("hf-pld", "hf", reference="hf-greedy", lookup=HF_PLD_NUM_TOKENS))
    return methods


def logit_gap_at(loaded, prompt_ids: list[int], reference: list[int], mismatch: dict) -> dict:
    """The model's top-2 logits where a method left the reference (a plain Hugging Face forward over
    prompt + common prefix): a near tie says rounding, a wide gap says a real error."""
    import torch

    pos = mismatch["position"]
    model = loaded.model
    with torch.inference_mode():
        ids = torch.tensor([list(prompt_ids) + list(reference[:pos])], device=model.device)
        logits = model(ids).logits[0, -1].float()
    top = torch.topk(logits, 2)
    info = {"top2_tokens": top.indices.tolist(), "top2_logit_gap": float(top.values[0] - top.values[1])}
    for key in ("reference_token", "method_token"):
        if mismatch.get(key) is not None:
            info[key.replace("token", "logit")] = float(logits[mismatch[key]])
    return info


def summarize(methods: list[Method], categories: list[str]) -> dict:
    """Per method: MAT, tokens/s, speedup over its reference, ``identical`` (with a ``mismatches``
    entry per differing question: where it first differs), per category and per question."""
    by_name = {m.name: m for m in methods}
    base = by_name["baseline"]
    check_same_questions({m.name: m.runs for m in methods}, "baseline")
    out: dict[str, dict] = {}
    for m in methods:
        ref = by_name[m.reference]
        # the baseline is the reference of every other method's tokens; its own are checked against
        # transformers' greedy decoding when that ran
        check_against = by_name.get("hf-greedy") if m is base else base
        entry: dict[str, Any] = {"kind": m.kind, "reference": ref.name,
                                 "identical_to": check_against.name if check_against else None}
        if m.kind in ("tr", "pld"):
            entry["tree"] = m.tree
        if m.kind == "tr":
            entry["prompt_seeding"] = m.prompt_seeding
        if m.kind == "hf":
            entry["prompt_lookup_num_tokens"] = m.lookup or None
        entry.update(method_entry(m.runs, None if ref is m else ref.runs,
                                  check_against.runs if check_against else None, categories))
        out[m.name] = entry
    return out


DEFINITIONS = {
    "mat": "tokens per verification forward, the prefill forward and its first token excluded: engine methods "
           "sum(stats.accepted_per_step) / verification steps; hf-* (new_tokens-1)/(forwards-1)",
    "tokens_per_s": "total new tokens / total perf_counter seconds of the method",
    "speedup": "tokens_per_s / tokens_per_s of 'reference' in the same run: baseline for engine methods, "
               "hf-greedy for hf-*",
    "identical": "every output token id list equals that of 'identical_to' for the same question: the baseline "
                 "for every method, hf-greedy for the baseline itself (null without the hf rows)",
    "template_sha256": "sha256 of json.dumps(list of paths) of the method's matrix template, in template order",
    "kernel_plan": "the engine methods' linear kernel per token count (the runner's KernelPlan; counts between two "
                   "points take the next point's kernel), or 'torch' for torch's own F.linear",
}


def run_bench(cfg: BenchConfig, loaded=None, progress: bool = True) -> dict:
    """Run the benchmark, write the JSON (and the PNG chart beside it) and return the result."""
    cfg.validate()
    chosen, rest = select_questions(read_questions(cfg.questions), cfg.per_category)
    warm = warmup_questions(chosen, rest, cfg.warmup)
    device = resolve_device(cfg.device)

    import torch
    from tqdm import tqdm

    from tr_serve.bench.provenance import environment, template_record
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
        if not m.engine:
            continue
        try:
            m.llm = LLM(model=cfg.model, tree=m.tree, k=cfg.k, loaded=loaded, max_num_seqs=1,
                        max_model_len=max_model_len, prompt_seeding=m.prompt_seeding, device=device,
                        cpu_kernels=cfg.cpu_kernels)
        except ValueError as e:  # a tree setting the engine refuses
            raise BenchError(f"method {m.name}: {e}") from None
        if cfg.time_split:
            m.llm.engine.timer = PhaseTimer(device, enabled=True)

    def run_one(m: Method, q: Question) -> Run:
        if not m.engine:
            ids, sec, forwards, finish = run_hf(loaded, q.prompt_ids, cfg.max_new_tokens, device, m.lookup)
            # minus the prefill forward and the token it gave
            return Run(q.question_id, q.category, ids, sec, max(0, forwards - 1), max(0, len(ids) - 1), finish)
        ids, sec, steps, finish = run_engine(m.llm, q.prompt_ids, cfg.max_new_tokens, device)
        return Run(q.question_id, q.category, ids, sec, len(steps), sum(steps), finish)

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
    by_name = {m.name: m for m in methods}
    position = {q.question_id: i for i, q in enumerate(chosen)}
    for m in methods:
        entry = summary[m.name]
        if m.llm is not None and cfg.time_split:
            entry["time_split"] = m.llm.engine.timer.split()
        if m.kind == "tr":
            entry["template"] = template_record(m.tree, cfg.k)
        for mm in entry.get("mismatches", []):
            i = position[mm["question_id"]]
            mm.update(logit_gap_at(loaded, chosen[i].prompt_ids, by_name[entry["identical_to"]].runs[i].token_ids, mm))

    base_llm = by_name["baseline"].llm
    result = {
        "model": cfg.model,
        "device": device,
        "device_name": _device_name(device),
        "dtype": str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
        "questions_file": str(cfg.questions),
        "questions": len(chosen),
        "question_ids": [q.question_id for q in chosen],
        "categories": categories,
        "warmup_question_ids": [q.question_id for q in warm],
        "max_new_tokens": cfg.max_new_tokens,
        "per_category": cfg.per_category,
        "prompt_seeding": cfg.prompt_seeding,
        "k": cfg.k,
        "hf_pld_num_tokens": HF_PLD_NUM_TOKENS if cfg.hf else None,
        **environment(base_llm.engine.runner.kernel_plan, cfg.cpu_kernels),
        "definitions": DEFINITIONS,
        "methods": summary,
    }
    result = round_floats(result)
    out = Path(cfg.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    from tr_serve.bench.report import write_chart

    write_chart(result, out.with_suffix(".png"))
    return result


# ---- command line ------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, metavar="PATH",
                   help="Spec-Bench JSONL (question_id, category, turns); the first turn is the user message "
                        "(default: the Spec-Bench dev questions packaged in tr_serve/data)")
    p.add_argument("--per-category", type=positive_int, default=2, metavar="N",
                   help="first N questions of each category (default: 2)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="default: 128")
    p.add_argument("--tree", action="append", dest="trees", metavar="SPEC",
                   help="Token Recycling tree setting, repeatable: a template (2.2.2, top8, a .json file of paths), "
                        "<template>+ctx (the hybrid with a context branch) or auto (cost-aware budget); "
                        "method tr:<SPEC> (default: 2.2.2)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    p.add_argument("--json", dest="json_out", default=DEFAULT_JSON, metavar="OUT",
                   help=f"result JSON; the chart is written beside it as .png (default: {DEFAULT_JSON})")
    p.add_argument("--prompt-seeding", choices=SEEDING_MODES, default="on",
                   help="seed the TR matrix from the prompt, as the engine does by default; 'both' adds a "
                        "method tr:<tree>-noseed per tree (default: on)")
    p.add_argument("--cpu-kernels", choices=CPU_KERNEL_MODES, default="auto",
                   help="linear kernels of the engine methods (baseline, tr:*, pld) on CPU: the fastest measured "
                        "per token count, or torch's own (default: auto; hf-* always run torch's own)")
    p.add_argument("--no-pld", dest="pld", action="store_false",
                   help="skip 'pld', prompt lookup through the same engine, runner and kernels")
    p.add_argument("--no-hf", dest="hf", action="store_false",
                   help="skip the transformers reference rows 'hf-greedy' and 'hf-pld' (generate, torch kernels)")
    p.add_argument("--warmup", type=non_negative_int, default=1, metavar="N",
                   help="questions decoded untimed by every method first (they warm the TR matrices too; default: 1)")
    p.add_argument("--k", type=positive_int, default=8, help="candidates per matrix row (default: 8)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)")
    p.add_argument("--no-time-split", dest="time_split", action="store_false",
                   help="do not time the engine phases (on CUDA the phase timer synchronizes)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        questions=args.questions, per_category=args.per_category, max_new_tokens=args.max_new_tokens,
        trees=tuple(args.trees or ("2.2.2",)), model=args.model, json_out=args.json_out,
        prompt_seeding=args.prompt_seeding, pld=args.pld, hf=args.hf, warmup=args.warmup, device=args.device,
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
