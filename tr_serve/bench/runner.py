"""``run_bench``: one ``tr-serve bench`` run (single stream). The model is loaded once; every engine
method gets an engine of its own (each Token Recycling method keeps its adjacency matrix for the whole
run: hot start), and the questions are interleaved: for each question every method runs in turn, so
machine noise hits all methods alike."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tr_serve.bench.config import BenchConfig, resolve_device
from tr_serve.bench.methods import HF_PLD_NUM_TOKENS, Method, build_methods, run_method
from tr_serve.bench.records import BenchError, Question, round_floats, selection_record
from tr_serve.bench.summary import DEFINITIONS, logit_gap_at, summarize
from tr_serve.bench.workloads import FollowUp, Workload, build_workload


def run_bench(cfg: BenchConfig, loaded=None, progress: bool = True) -> dict:
    """Run the benchmark, write the JSON (and the PNG chart beside it) and return the result."""
    cfg.validate()
    workload = build_workload(cfg.workload, cfg.questions, cfg.per_category, cfg.warmup)
    chosen, warm = workload.chosen, workload.warm
    device = resolve_device(cfg.device)

    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if loaded is None:
        loaded = _load(cfg, device)
    device = str(next(loaded.model.parameters()).device.type)
    known = [q for q in chosen + warm if not isinstance(q, FollowUp)]  # a follow-up's prompt needs an answer first
    for q in known:
        workload.prepare(q, loaded.tokenizer)
    # a follow-up holds an earlier prompt or answer and some text of its own
    extra = 2 * cfg.max_new_tokens + FOLLOW_UP_TOKENS if len(known) < len(chosen) + len(warm) else 0
    max_model_len = _context_length(loaded, known, cfg.max_new_tokens, extra)

    methods = build_methods(cfg)
    _start_engines(methods, cfg, loaded, device, max_model_len)
    _run_interleaved(methods, loaded, workload, cfg.max_new_tokens, device, progress)
    result = round_floats(_result(cfg, loaded, device, methods, chosen, warm, workload.categories))
    write_result(result, Path(cfg.json_out))
    return result


def _load(cfg: BenchConfig, device: str):
    from tr_serve.model_loader import load_model

    try:
        return load_model(cfg.model, device=device, dtype=cfg.dtype)
    except (OSError, ValueError) as e:  # FileNotFoundError is an OSError
        raise BenchError(f"cannot load model {cfg.model!r}: {e}".splitlines()[0]) from None


FOLLOW_UP_TOKENS = 512  # room for a follow-up request's own text (a second turn, a revision request)


def _context_length(loaded, questions: list[Question], max_new_tokens: int, extra: int = 0) -> int:
    """The engines' ``max_model_len``: at least 2048, and room for the longest prompt (``extra``
    tokens more, for prompts not encoded yet) and its answer."""
    longest = max(len(q.prompt_ids) for q in questions) + extra
    max_pos = getattr(loaded.model.config, "max_position_embeddings", None) or 1 << 30
    max_model_len = max(2048, longest + max_new_tokens + 1)
    if max_model_len > max_pos:
        raise BenchError(f"the longest prompt has {longest} tokens; with --max-new-tokens {max_new_tokens} "
                         f"it exceeds the model's context of {max_pos} tokens")
    return max_model_len


def _start_engines(methods: list[Method], cfg: BenchConfig, loaded, device: str, max_model_len: int) -> None:
    """An ``LLM`` per engine method over the shared weights, with the phase timer on unless
    ``--no-time-split``."""
    from tr_serve.engine.timing import PhaseTimer
    from tr_serve.llm import LLM

    for m in methods:
        if not m.engine:
            continue
        try:
            m.llm = LLM(model=cfg.model, tree=m.tree, k=cfg.k, loaded=loaded, max_num_seqs=1,
                        max_model_len=max_model_len, prompt_seeding=m.prompt_seeding,
                        matrix_prior=m.matrix_prior, device=device,
                        cpu_kernels=cfg.cpu_kernels, suffix_index=m.suffix_index)
        except ValueError as e:  # a tree setting the engine refuses
            raise BenchError(f"method {m.name}: {e}") from None
        if cfg.time_split:
            m.llm.engine.timer = PhaseTimer(device, enabled=True)


def _run_interleaved(methods: list[Method], loaded, workload: Workload, max_new_tokens: int, device: str,
                     progress: bool) -> None:
    """The warm-up questions untimed, then every measured question by every method in turn (each
    method's runs appended to ``Method.runs``); a follow-up request is encoded once the baseline
    (the first method) has answered the request it quotes."""
    from tqdm import tqdm

    chosen, warm = workload.chosen, workload.warm
    total = (len(warm) + len(chosen)) * len(methods)
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    try:
        for i, q in enumerate(warm):
            for m in methods:
                bar.set_postfix_str(f"warm-up {i + 1}/{len(warm)} {m.name}", refresh=False)
                run_method(m, loaded, q, max_new_tokens, device)
                bar.update(1)
        for m in methods:
            if m.llm is not None:
                m.llm.engine.timer.reset()
        for q in chosen:
            workload.prepare(q, loaded.tokenizer)
            for m in methods:
                bar.set_postfix_str(f"q{q.question_id} {q.category} {m.name}", refresh=False)
                m.runs.append(run_method(m, loaded, q, max_new_tokens, device))
                if m.kind == "baseline":
                    workload.answered(q, m.runs[-1].token_ids, loaded.tokenizer)
                bar.update(1)
    finally:
        bar.close()


def _result(cfg: BenchConfig, loaded, device: str, methods: list[Method], chosen: list[Question],
            warm: list[Question], categories: list[str]) -> dict[str, Any]:
    """The JSON: the run's settings and environment, and per method its summary, phase split,
    template record and, for each question that left its reference, the logit gap there."""
    from tr_serve.bench.provenance import environment, template_record

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
    return {
        "model": cfg.model,
        "device": device,
        "device_name": device_name(device),
        "dtype": str(next(loaded.model.parameters()).dtype).replace("torch.", ""),
        **selection_record(cfg.questions, chosen, warm, categories),
        "workload": cfg.workload,
        "max_new_tokens": cfg.max_new_tokens,
        "per_category": cfg.per_category,
        "prompt_seeding": cfg.prompt_seeding,
        "matrix_prior": cfg.matrix_prior,
        "suffix_index": cfg.suffix_index,
        "k": cfg.k,
        "hf_pld_num_tokens": HF_PLD_NUM_TOKENS if cfg.hf else None,
        **environment(base_llm.engine.runner.kernel_plan, cfg.cpu_kernels),
        "definitions": DEFINITIONS,
        "methods": summary,
    }


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's with the torch thread count."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"{platform.processor() or platform.machine()} ({torch.get_num_threads()} torch threads)"


def write_result(result: dict, out: Path) -> None:
    """The JSON at ``out`` and its chart beside it (``.png``)."""
    from tr_serve.bench.report import write_chart

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    write_chart(result, out.with_suffix(".png"))
