"""The first-day GPU check: one command, nothing downloaded, random-weight models built in code.

    python scripts/gpu_check.py                              # one GPU, <= 8 min (bfloat16)
    python3 scripts/gpu_check.py --json $OUT/gpu_check.json  # the same on the lent GPU machine
    python scripts/gpu_check.py --bench-json bench_out/bench.json   # MAT from a `tr-serve bench` run
    python scripts/gpu_check.py --tiny --device cpu          # seconds; what the test suite runs
    python scripts/gpu_check.py --tiny --device cpu --tp 2   # adds the tensor-parallel part (needs ray)

It needs torch and transformers (5.17 as on the GPU image, or the pinned 5.24+) plus this
repository: no tokenizer, no GGUF, no hub (the engine's tokenizer is :class:`IdTokenizer`). Every
engine and the latency table run the compact decoder (``decoder: compact``, tr_serve/model/), the
path every GPU takes, on any device, so ``--tiny --device cpu`` checks that path's code.

Exit status 0 when every gating check passed, 1 when one failed, a section raised, or the time
budget cut the run short. The JSON (``--json``) is rewritten after every section (and after every
engine run), so a run killed part-way leaves what it measured; its ``failures`` say what failed.
Sections (``--sections``), each with its peak GPU memory (``torch.cuda.max_memory_allocated``,
reset per section) and the attention kernels that ran (torch profiler op names: SDPA's flash /
efficient / cuDNN / math backends, or flex attention):

1. ``latency``: eager forward latency by query tokens (1 .. 128) at contexts 512 and 2048, one row,
   for a Llama-3-8B-shaped model (32 layers, hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab
   128256) in bfloat16 through the runner's verify path (the tree mask, the slot KV cache, the LM
   head); median of ``--repeats`` timed calls after a warm-up, synchronised; and the bytes the
   runner returns per call.
2. ``engine``: plain decoding (``tree: none``) and each tree (``--trees``, ``budget: fixed``) through
   ``Engine.step`` at 1, 8 and 32 rows on the same model, greedy and sampled (seeded): seconds per
   decode step, bytes returned by the runner per verification step (beside the 2 MB a step should
   return at 32 rows: reported, not gated, until the runner returns ids), peak memory per run. A
   random-weight model accepts almost no drafts, so the speedup is projected as ``MAT x (plain
   step time / TR step time)`` with the MAT of the dev questions (``--bench-json``, ``--mat``, or
   an earlier CPU single-stream run's figures, ``EARLIER_CPU_MAT``), and from the latency table at 1 row.
3. ``losslessness``: a small random Llama; TR (each tree) against plain decoding through the same
   engine, greedy and sampled with the same seeds, and plain against ``model.generate`` (greedy).
   In float32 every token must match (gating: a difference is reported with the reference's top-2
   logit gap there). In the check's dtype, when it is not float32 (bfloat16 on CUDA), the same
   comparisons are reported, not gated: near-ties under different GEMM shapes can flip there.
4. ``step_audit``: the compiled step (``compile: true``) of a small random Llama through the engine,
   TR 2.2.2 greedy and sampled, run twice: the first pass warms every bucket it meets, the second
   counts graph breaks, recompiles (a shape compiled again), new shapes (reported: buckets the
   warm-up pass did not meet), and the copies the runner's calls make in each engine step to the
   device and back (``.to(<device>)`` and ``.cpu()`` intercepted by a torch function mode; on a
   CPU the runner lives on the stand-in device ``cpu:0`` so its copies are seen). Also the
   report's top-level ``step_audit``.
5. ``tp`` (only with ``--tp N``): the same greedy requests through a ``TPModelRunner`` of N workers
   (gloo on a CPU, NCCL on N GPUs) against the local runner, and the bytes each step moves between
   the replica and the workers. Absent where ray is not installed (the GPU image has none).

The ``latency`` and ``engine`` sections run under ``sdpa_kernel`` with the fused backends only
(flash, memory-efficient, cuDNN): a silent fallback to the math kernel raises there and is reported
as such (``--allow-math-attention`` lifts the guard).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
# an earlier single-stream run (today's figures: docs/benchmarks.md): tr-serve bench --per-category 2 (26 questions),
# SmolLM2-135M-Instruct, 128 new tokens, hot matrix, prompt seeding on
EARLIER_CPU_MAT = {"top2": 1.38, "top4": 1.53, "top8": 1.71, "2.2.2": 2.41}
QUERY_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (512, 2048)
CONCURRENCY = (1, 8, 32)
SECTIONS = ("latency", "engine", "losslessness", "step_audit", "tp")
SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50)  # the sampled requests' settings (seeded per request)
# the most the runner may return per verify step at Llama-3's vocabulary, 32 rows x 81 nodes (token
# ids: 93 kB; full float32 logits were 1.33 GB)
RETURN_BYTES_TARGET = 2_000_000
TIME_BUDGET_S = 420.0  # the full check on one H200: 8 minutes with start-up; --tiny has none
FUSED_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
# profiler op name -> attention kernel (substring match, most specific first)
ATTENTION_OPS = (("flash_attention_for_cpu", "flash (cpu)"), ("flash_attention", "flash"),
                 ("efficient_attention", "efficient"), ("cudnn_attention", "cudnn"),
                 ("attention_math", "math"), ("fused_attention_overrideable", "overrideable"),
                 ("flex_attention", "flex"))
GIB = 2**30


class IdTokenizer:
    """What the engine uses of a tokenizer, built in code (none is downloaded): ``decode`` for the
    incremental detokenizer (ids as text), no BOS (so no matrix prior prefix) and no EOS ids, so
    every request runs its full ``max_tokens``."""

    eos_token_id = None
    bos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


class BudgetExceeded(RuntimeError):
    """The run has used its time budget: the rest is skipped (and the check fails)."""


# ---- the report ----------------------------------------------------------------------------------
class Report:
    """The check's JSON, rewritten atomically after every section (and whenever a section asks),
    so a killed run leaves what it measured. ``passed`` turns False at the first failing gating
    check, a section that raises, or a section skipped for time."""

    def __init__(self, path: str | None, env: dict, device: torch.device, budget_s: float | None):
        self.path = Path(path) if path else None
        self.device = device
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.data: dict[str, Any] = {"passed": True, "failures": [], "env": env, "sections": {}}
        self.write()

    @property
    def passed(self) -> bool:
        return self.data["passed"]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def check_time(self, what: str) -> None:
        if self.budget_s is not None and self.elapsed() > self.budget_s:
            raise BudgetExceeded(f"time budget of {self.budget_s:.0f} s used up before {what}")

    def fail(self, where: str, message: str) -> None:
        self.data["failures"].append(f"{where}: {message}")
        self.data["passed"] = False

    def check(self, sec: dict, name: str, ok: bool, detail: Any = None, gating: bool = True) -> bool:
        """Record one check in section ``sec``; a failing gating check fails the run."""
        entry = {"name": name, "passed": bool(ok), "gating": gating}
        if detail is not None:
            entry["detail"] = detail
        sec.setdefault("checks", []).append(entry)
        if gating and not ok:
            self.fail(sec["name"], f"{name}" + (f" ({detail})" if detail is not None else ""))
        return bool(ok)

    def run_section(self, name: str, body: Callable[[dict], None]) -> dict:
        """Run ``body(sec)``, which fills the section's dict in place; its status, seconds and peak
        GPU memory are added here. An exception is recorded and the run goes on with the next
        section; one past the time budget is not started (and fails the run)."""
        sec: dict[str, Any] = {"name": name, "status": "running"}
        self.data["sections"][name] = sec
        self.write()  # a run killed in this section shows it running
        print(f"== {name}", flush=True)
        reset_peak_memory(self.device)
        t0 = time.perf_counter()
        try:
            self.check_time(f"section {name}")
            body(sec)
            failed = [c["name"] for c in sec.get("checks", []) if c["gating"] and not c["passed"]]
            sec["status"] = "failed" if failed else "passed"
        except BudgetExceeded as e:
            sec["status"] = "out of time"
            sec["reason"] = str(e)
            self.fail(name, str(e))
        except Exception as e:  # reported, and the next section still runs
            sec["status"] = "error"
            sec["error"] = f"{type(e).__name__}: {e}"
            sec["traceback"] = traceback.format_exc(limit=8).splitlines()[-12:]
            if is_math_fallback(e):
                sec["math_fallback_refused"] = True
            self.fail(name, sec["error"])
        finally:
            sec["seconds"] = round(time.perf_counter() - t0, 2)
            fold_peak(sec, self.device)
            print(f"   {name}: {sec['status']} ({sec['seconds']} s)", flush=True)
            self.write()
        return sec

    def skip(self, name: str, reason: str) -> None:
        """A section that does not apply here (not a failure)."""
        self.data["sections"][name] = {"name": name, "status": "skipped", "reason": reason}
        print(f"== {name}: skipped ({reason})", flush=True)
        self.write()

    def write(self) -> None:
        self.data["seconds"] = round(self.elapsed(), 2)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)


# ---- device helpers ------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> float | None:
    """Peak GPU memory allocated since the last reset (None off CUDA)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.max_memory_allocated(device) / GIB, 3)


def release(device: torch.device) -> None:
    """Free what dropped engines held (their KV caches) before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fold_peak(sec: dict, device: torch.device) -> float | None:
    """Fold the peak since the last reset into ``sec['peak_gpu_memory_gb']`` (the section's max)."""
    peak = peak_memory_gb(device)
    if peak is not None:
        sec["peak_gpu_memory_gb"] = max(peak, sec.get("peak_gpu_memory_gb") or 0.0)
    return peak


@contextlib.contextmanager
def fused_attention_only(enabled: bool) -> Iterator[None]:
    """SDPA restricted to its fused backends (flash, memory-efficient, cuDNN): a call that would
    fall back to the math kernel raises instead of running slowly and silently."""
    if not enabled:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, name) for name in FUSED_SDPA if hasattr(SDPBackend, name)]):
        yield


def is_math_fallback(error: BaseException) -> bool:
    """Whether ``error`` is SDPA refusing to run with every allowed backend (the guard's doing)."""
    text = str(error)
    return isinstance(error, RuntimeError) and ("No viable backend" in text or "No available kernel" in text)


def attention_kernels(fn: Callable[[], Any]) -> dict[str, int]:
    """The attention kernels ``fn()`` ran (:data:`ATTENTION_OPS` names) and how often, read off the
    profiler's op names; the aten dispatch ops are recorded on the host for every device."""
    from torch.profiler import ProfilerActivity, profile

    with kineto_lines_dropped(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts: Counter = Counter()
    for event in prof.events():
        for pattern, kernel in ATTENTION_OPS:
            if pattern in event.name:
                counts[kernel] += 1
                break
    return dict(sorted(counts.items()))


@contextlib.contextmanager
def kineto_lines_dropped(prefixes: tuple[str, ...] = ("USDT:", "STAGE:")) -> Iterator[None]:
    """The profiler's own C++ log lines (two per profiled call, on stderr) dropped; everything
    else written to stderr meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith(prefixes):
                    sys.stderr.write(line)


def returned_bytes(obj: Any) -> int:
    """Bytes of the tensors in what a runner returned: a tensor, or tensors inside tuples, lists,
    dicts or dataclasses (``numel * element_size`` each; numpy arrays by ``nbytes``)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(returned_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, (tuple, list)):
        return sum(returned_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(returned_bytes(o) for o in obj.values())
    nbytes = getattr(obj, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, int) else 0


# ---- the model -----------------------------------------------------------------------------------
def random_llama(shape: dict, dtype: torch.dtype, device: torch.device, seed: int, init_range: float = 0.02):
    """A random-weight ``LlamaForCausalLM`` built straight on ``device`` (skeleton on meta first),
    as a ``LoadedModel`` with an :class:`IdTokenizer`. On a CPU it runs transformers' forward in
    the runner, as on GPUs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tr_serve.model_loader import LoadedModel
    from tr_serve.runner.llama_body import use_transformers_forward

    config = LlamaConfig(**shape, initializer_range=init_range)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    model.to_empty(device=device)  # allocated once, in the check's dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * init_range)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config.eos_token_id = None  # like the engine here (no end-of-sequence id): fixed lengths
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        use_transformers_forward(model)
    name = f"random-llama-{shape['hidden_size']}x{shape['num_hidden_layers']}-v{shape['vocab_size']}"
    return LoadedModel(model, IdTokenizer(), name, ())


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=gen).tolist() for _ in range(count)]


# ---- thin helpers over the runner and the engine: the one place to adapt to their contracts -------
def verify_once(runner, rows: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor):
    """One verification step as the engine makes it (``verify_step``: the forward, the reduction
    to token ids and their copy to the host): tokens [b, q], depths [q], tree_mask [q, q]."""
    from tr_serve.runner.step_io import StepSampling

    return runner.verify_step(rows, tokens, depths, tree_mask, None, StepSampling((None,) * rows.shape[0], 8))


def prefill_once(runner, rows: torch.Tensor, prompts: list[list[int]]):
    from tr_serve.runner.step_io import StepSampling

    return runner.prefill_step(rows, prompts, StepSampling((None,) * rows.shape[0], 8))


class VerifyMeter:
    """Counts the runner's verification calls and the bytes of what they return, while attached
    (it shadows the bound ``verify_step`` of one runner instance; the local and the tensor-parallel
    runner alike). ``detach`` breaks the runner -> wrapper -> runner cycle, so a dropped engine's
    KV cache is freed at once."""

    def __init__(self, runner):
        self.calls = 0
        self.bytes = 0
        self.runner = runner
        inner = runner.verify_step

        def verify_step(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.calls += 1
            self.bytes += returned_bytes(out)
            return out

        runner.verify_step = verify_step

    def detach(self) -> None:
        self.runner.__dict__.pop("verify_step", None)
        self.runner = None

    @property
    def bytes_per_call(self) -> int | None:
        return self.bytes // self.calls if self.calls else None


def make_engine(loaded, tree: str, rows: int, max_model_len: int, device: torch.device, dtype_name: str):
    """An ``Engine`` over a local runner of the compact decoder (the path GPUs run, eager): ``budget:
    fixed`` (the whole template every step), no matrix prior (nothing computed or cached beside the check)."""
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine

    cfg = EngineConfig(model=loaded.model_id, tree=tree, k=8, max_num_seqs=rows, max_model_len=max_model_len,
                       device=str(device), dtype=dtype_name, budget="fixed", cpu_kernels="torch",
                       matrix_prior=False, decoder="compact")
    return Engine(loaded, cfg)


def submit(engine, prompt: list[int], new_tokens: int, seed: int | None) -> str:
    """Add one request: greedy when ``seed`` is None, else sampled (:data:`SAMPLED`) with ``seed``."""
    from tr_serve.sampling_params import SamplingParams

    if seed is None:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    else:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=seed, **SAMPLED)
    return engine.add_request(prompt, params)


@dataclasses.dataclass
class EngineRun:
    tokens: list[list[int]]  # per prompt, in prompt order
    decode_step_s: list[float]  # wall seconds of each step that only verified (prefill steps excluded)
    steps: int  # every engine step, prefill included
    verify_calls: int
    verify_bytes_per_call: int | None
    mat: float | None  # accepted tokens per verification step (random weights: says little)
    tree_nodes: int  # the widest tree verified
    kernels: dict[str, int]  # attention kernels of the first decode step
    peak_gpu_memory_gb: float | None
    cuda_syncs: dict | None = None  # CUDA only: synchronising calls per decode step (sync debug mode)

    @property
    def step_ms(self) -> float | None:
        return round(statistics.mean(self.decode_step_s) * 1e3, 3) if self.decode_step_s else None


def decode(engine, prompts: list[list[int]], new_tokens: int, sampled: bool, device: torch.device,
           seed: int = 0) -> EngineRun:
    """All ``prompts`` submitted at once and stepped to the end; the first decode step runs under
    the profiler (untimed) to see which attention kernels ran."""
    meter = VerifyMeter(engine.runner)
    ids = [submit(engine, p, new_tokens, seed + i if sampled else None) for i, p in enumerate(prompts)]
    reset_peak_memory(device)
    outputs, times, steps, kernels, syncs = {}, [], 0, None, None
    while engine.has_unfinished():
        decoding = bool(engine.running) and not engine.prefilling
        sync(device)
        t0 = time.perf_counter()
        if decoding and kernels is None:
            kernels = attention_kernels(lambda: outputs.update({o.request_id: o for o in engine.step()}))
        elif decoding and device.type == "cuda" and len(times) == 2:  # one step counted, untimed
            with counted_cuda_syncs() as found:
                for out in engine.step():
                    outputs[out.request_id] = out
            syncs = {"count": len(found), "first": found[:4]}
        else:
            for out in engine.step():
                outputs[out.request_id] = out
            sync(device)
            if decoding:
                times.append(time.perf_counter() - t0)
        steps += 1
    outs = [outputs[i] for i in ids]
    verifications = sum(o.stats.verification_steps for o in outs)
    accepted = sum(sum(o.stats.accepted_per_step) for o in outs)
    nodes = [n for o in outs for n in o.stats.tree_nodes_per_step]
    meter.detach()
    return EngineRun([list(o.token_ids) for o in outs], times, steps, meter.calls, meter.bytes_per_call,
                     round(accepted / verifications, 4) if verifications else None, max(nodes, default=0),
                     kernels or {}, peak_memory_gb(device), syncs)


@contextlib.contextmanager
def counted_cuda_syncs():
    """The synchronising CUDA calls made inside the block, as torch's sync debug mode reports them
    (its warnings' first lines): on the GPU, what runner/sync_audit.py counts on a CPU. The step's
    one copy of its ids to the host is expected; anything else is a stall to look at."""
    import warnings

    found: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    found += [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message).lower()]


# ---- comparisons ---------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """top-1 minus top-2 logit of ``model`` (a plain transformers forward) after prompt + prefix."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + prefix], device=device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def compare(reference: list[list[int]], other: list[list[int]], model=None, prompts=None) -> dict:
    """How many outputs differ from the reference and where first; with ``model`` and ``prompts``,
    the reference's top-2 logit gap at each first difference (a near-tie says rounding)."""
    positions = [first_difference(a, b) for a, b in zip(reference, other)]
    differing = [(i, p) for i, p in enumerate(positions) if p is not None]
    out = {"differing": len(differing), "outputs": len(reference), "first_positions": [p for _, p in differing],
           "tokens_compared": sum(len(a) for a in reference)}
    if model is not None and differing:
        out["top2_gaps"] = [round(top2_gap(model, prompts[i], reference[i][:p]), 6) for i, p in differing]
    return out


# ---- 1. latency table ----------------------------------------------------------------------------
def latency_section(rep: Report, sec: dict, loaded, device: torch.device, args) -> None:
    from tr_serve.model.decoder import from_hf
    from tr_serve.runner.decoder_runner import DecoderRunner

    sec.update(model=_shape(loaded), repeats=args.repeats,
               statistic="median of timed verify calls (ms)", by_context={}, bytes_returned={}, kernels={})
    max_len = max(args.contexts) + max(args.query_tokens) + 8
    runner = DecoderRunner(from_hf(loaded.model, max_positions=max_len), 1, max_len)
    row = torch.tensor([0])
    vocab = loaded.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    with fused_attention_only(args.attention_guard):
        for ctx in args.contexts:
            rep.check_time(f"context {ctx}")
            runner.free(0)
            prefill_once(runner, row, [torch.randint(10, vocab, (ctx,), generator=gen).tolist()])
            table = sec["by_context"][str(ctx)] = {}
            sizes = sec["bytes_returned"][str(ctx)] = {}
            for q in args.query_tokens:
                tokens = torch.randint(10, vocab, (1, q), generator=gen)
                depths, mask = torch.arange(q), torch.ones(q, q, dtype=torch.bool).tril()
                sizes[str(q)] = returned_bytes(verify_once(runner, row, tokens, depths, mask))  # warm-up
                times = []
                for _ in range(args.repeats):
                    sync(device)
                    t0 = time.perf_counter()
                    verify_once(runner, row, tokens, depths, mask)
                    sync(device)
                    times.append(time.perf_counter() - t0)
                table[str(q)] = round(statistics.median(times) * 1e3, 3)
            q = max(args.query_tokens)
            tokens = torch.randint(10, vocab, (1, q), generator=gen)
            sec["kernels"][str(ctx)] = attention_kernels(lambda: verify_once(
                runner, row, tokens, torch.arange(q), torch.ones(q, q, dtype=torch.bool).tril()))
            print(f"   context {ctx}: " + ", ".join(f"q={q} {ms:.2f} ms" for q, ms in table.items())
                  + f"; kernels {sec['kernels'][str(ctx)]}", flush=True)
            rep.write()
    rep.check(sec, "an attention kernel ran", all(sec["kernels"].values()), sec["kernels"])
    rep.check(sec, "no math attention", not any("math" in k for k in sec["kernels"].values()), sec["kernels"],
              gating=args.attention_guard)


def _shape(loaded) -> dict:
    config = loaded.model.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads")
    return {k: getattr(config, k) for k in keys} | {"dtype": str(next(loaded.model.parameters()).dtype)}


# ---- 2. TR vs plain through the engine -----------------------------------------------------------
def read_mat(args) -> tuple[dict[str, float], str]:
    mats = dict(EARLIER_CPU_MAT)
    source = "an earlier CPU single-stream run (tr-serve bench, SmolLM2-135M-Instruct, 26 Spec-Bench dev questions, CPU)"
    if args.bench_json:
        data = json.loads(Path(args.bench_json).read_text())
        found = {name.split(":", 1)[1]: m["mat"] for name, m in data.get("methods", {}).items()
                 if name.startswith("tr:") and m.get("mat")}
        if not found:
            raise SystemExit(f"{args.bench_json} has no tr:<tree> method with a MAT")
        mats.update(found)
        source = f"{args.bench_json} (tr-serve bench on the dev questions: methods tr:<tree>.mat)"
    for item in args.mat or []:
        tree, _, value = item.partition("=")
        mats[tree] = float(value)
        source = "--mat on the command line" + (f", else {source}" if len(mats) > 1 else "")
    return mats, source


def _run_entry(run: EngineRun) -> dict:
    return {"step_ms": run.step_ms, "decode_steps": len(run.decode_step_s), "steps": run.steps,
            "tree_nodes": run.tree_nodes, "mat_random_model": run.mat, "verify_calls": run.verify_calls,
            "bytes_per_verify": run.verify_bytes_per_call, "kernels": run.kernels, "cuda_syncs": run.cuda_syncs,
            "peak_gpu_memory_gb": run.peak_gpu_memory_gb}


def engine_section(rep: Report, sec: dict, loaded, device: torch.device, dtype_name: str, args,
                   table: dict) -> None:
    mats, mat_source = read_mat(args)
    sec.update(model=_shape(loaded), mat_source=mat_source, sampled=SAMPLED, prompt_tokens=args.prompt_tokens,
               new_tokens=args.new_tokens, return_bytes_target=RETURN_BYTES_TARGET,
               projection="speedup = MAT x plain step time / TR step time (measured here); table_speedup (1 row) "
                          "= MAT x latency(q=1) / latency(q=nodes+1) at the first context", levels={})
    vocab = loaded.model.config.vocab_size
    lat = {int(k): v for k, v in table.get(str(args.contexts[0]), {}).items()}
    kernels: Counter = Counter()
    with fused_attention_only(args.attention_guard):
        for c in args.concurrency:
            level = sec["levels"][str(c)] = {}
            prompts = random_prompts(c, args.prompt_tokens, vocab, seed=c)
            for mode in ("greedy", "sampled"):
                plain = None
                for tree in ["none"] + args.trees:
                    rep.check_time(f"{tree} {mode} at {c} rows")
                    engine = make_engine(loaded, tree, c, args.prompt_tokens + args.new_tokens + 1, device,
                                         dtype_name)
                    run = decode(engine, prompts, args.new_tokens, mode == "sampled", device)
                    del engine
                    release(device)
                    fold_peak(sec, device)
                    kernels.update(run.kernels)
                    entry = _run_entry(run)
                    if tree == "none":
                        plain = run
                        level[f"plain {mode}"] = entry
                    else:
                        entry["vs_plain"] = compare(plain.tokens, run.tokens)  # bf16 near-ties: reported
                        mat = mats.get(tree)
                        entry["mat_dev"] = mat
                        if mat and run.step_ms and plain.step_ms:
                            entry["speedup_projected"] = round(mat * plain.step_ms / run.step_ms, 3)
                        if c == 1 and mat and lat and mode == "greedy":
                            big = min((k for k in lat if k >= run.tree_nodes + 1), default=max(lat))
                            entry["table_speedup"] = round(mat * lat[min(lat)] / lat[big], 3)
                            entry["table_query_tokens"] = big
                        level[f"tr:{tree} {mode}"] = entry
                    rep.write()
                print(f"   {c} rows, {mode}: " + "; ".join(
                    f"{name.split()[0]} {e['step_ms']} ms/step, {_mb(e['bytes_per_verify'])} back/step"
                    for name, e in level.items() if name.endswith(mode)), flush=True)
    sec["kernels"] = dict(sorted(kernels.items()))
    from tr_serve.runner import step_attention

    # which step attention the runners used, and whether FlexAttention failed to compile (a fallback
    # to one fused attention per row is correct but not the kernel the GPU should run)
    sec["step_attention"] = {"backend": step_attention.default_backend(device),
                             "flex_failure": step_attention.flex_failure}
    rep.check(sec, "FlexAttention compiled where chosen", step_attention.flex_failure is None,
              sec["step_attention"], gating=False)
    widest = [e for name, e in sec["levels"].get(str(max(args.concurrency)), {}).items() if name.startswith("tr:")]
    if widest:
        most = max(widest, key=lambda e: e["bytes_per_verify"] or 0)
        rep.check(sec, f"runner returns <= {RETURN_BYTES_TARGET} bytes per step at {max(args.concurrency)} rows",
                  (most["bytes_per_verify"] or 0) <= RETURN_BYTES_TARGET,
                  f"{most['bytes_per_verify']} bytes at {most['tree_nodes']} nodes, vocab {vocab}")
    rep.check(sec, "an attention kernel ran", bool(kernels), sec["kernels"])
    rep.check(sec, "no math attention", "math" not in kernels, sec["kernels"], gating=args.attention_guard)


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:.3f} MB"


# ---- 3. losslessness -----------------------------------------------------------------------------
def losslessness_section(rep: Report, sec: dict, device: torch.device, dtype: torch.dtype, args) -> None:
    """TR against plain decoding through the engine (greedy and seeded sampling) and plain against
    ``model.generate``; gated in float32, reported in another check dtype."""
    shape = dict(TINY if args.tiny else SMALL)
    if args.vocab:
        shape["vocab_size"] = args.vocab
    dtypes = [torch.float32] + ([dtype] if dtype != torch.float32 else [])
    sec.update(model=shape, prompts=args.prompts, new_tokens=args.lossless_new_tokens, sampled=SAMPLED, by_dtype={})
    prompts = random_prompts(args.prompts, args.lossless_prompt_tokens, shape["vocab_size"], seed=1)
    n = args.lossless_new_tokens
    for dt in dtypes:
        name = str(dt).removeprefix("torch.")
        gating = dt == torch.float32
        rep.check_time(f"losslessness in {name}")
        loaded = random_llama(shape, dt, device, seed=1, init_range=0.1)
        model = loaded.model
        report = sec["by_dtype"][name] = {"gating": gating, "trees": {}}
        reference = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                     pad_token_id=0)
            reference.append(out[0, len(p):].tolist())
        max_len = args.lossless_prompt_tokens + n + 1

        def through_engine(tree: str, sampled: bool) -> EngineRun:
            return decode(make_engine(loaded, tree, len(prompts), max_len, device, name), prompts, n, sampled, device)

        plain, plain_sampled = through_engine("none", False), through_engine("none", True)
        report["plain_vs_generate"] = compare(reference, plain.tokens, model, prompts)
        rep.check(sec, f"{name}: plain decoding == generate (greedy)", report["plain_vs_generate"]["differing"] == 0,
                  report["plain_vs_generate"], gating=gating)
        for tree in args.trees:
            greedy, sampled = through_engine(tree, False), through_engine(tree, True)
            entry = report["trees"][tree] = {
                "mat_random_model": greedy.mat, "mat_random_model_sampled": sampled.mat,
                "greedy_vs_plain": compare(plain.tokens, greedy.tokens, model, prompts),
                "sampled_vs_plain": compare(plain_sampled.tokens, sampled.tokens)}
            rep.check(sec, f"{name}: tr:{tree} == plain (greedy)", entry["greedy_vs_plain"]["differing"] == 0,
                      entry["greedy_vs_plain"], gating=gating)
            rep.check(sec, f"{name}: tr:{tree} == plain (sampled, same seeds)",
                      entry["sampled_vs_plain"]["differing"] == 0, entry["sampled_vs_plain"], gating=gating)
            rep.write()
        print(f"   {name}: plain vs generate {report['plain_vs_generate']['differing']}/{len(prompts)} differ; "
              + "; ".join(f"tr:{t} {e['greedy_vs_plain']['differing']} greedy / {e['sampled_vs_plain']['differing']} "
                          f"sampled differ (MAT {e['mat_random_model']})" for t, e in report["trees"].items()),
              flush=True)
        del loaded, model
        release(device)


# ---- 4. the compiled step's audit ----------------------------------------------------------------
STEP_AUDIT_KEYS = ("graph_breaks", "recompiles_after_warmup", "new_shapes_after_warmup", "h2d_copies_per_step",
                   "d2h_copies_per_step")


class DeviceTransfers(torch.overrides.TorchFunctionMode):
    """Counts, while active, copies to ``device`` (``.to`` naming it) and to the host (``.cpu()``,
    or ``.to`` naming the host) of tensors, in the order made."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.to_device = self.to_host = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to:
            targets = [torch.device(a) for a in (*args[1:], kwargs.get("device"))
                       if isinstance(a, (str, torch.device))]
            if any(t == self.device for t in targets):
                self.to_device += 1
            elif any(t.type == "cpu" and t != self.device for t in targets) and args[0].device == self.device:
                self.to_host += 1
        elif func is torch.Tensor.cpu:
            self.to_host += 1
        return func(*args, **kwargs)


def step_audit_section(rep: Report, sec: dict, device: torch.device, dtype: torch.dtype, args) -> None:
    """The compiled compact step through the engine, twice over the same requests (a warm-up pass,
    then the counted one): 0 graph breaks, no shape compiled twice, one copy to the device and one
    back per engine step."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine
    from tr_serve.model.decoder import from_hf
    from tr_serve.runner.decoder_runner import DecoderRunner
    from tr_serve.runner.sync_audit import AUDIT_DEVICE

    shape = dict(TINY if args.tiny else SMALL)
    name = str(dtype).removeprefix("torch.")
    loaded = random_llama(shape, dtype, device, seed=4, init_range=0.1)
    runner_device = AUDIT_DEVICE if device.type == "cpu" else device  # a CPU's copies are seen on the stand-in
    prompts = random_prompts(2, args.lossless_prompt_tokens, shape["vocab_size"], seed=5)
    n = args.lossless_new_tokens
    cfg = EngineConfig(model=loaded.model_id, tree="2.2.2", k=8, max_num_seqs=2 * len(prompts),
                       max_model_len=args.lossless_prompt_tokens + n + 1, device=str(device), dtype=name,
                       budget="fixed", matrix_prior=False, decoder="compact", compile=True)
    dynamo.reset()
    counters.clear()
    t0 = time.perf_counter()
    engine = Engine(loaded, cfg, runner=lambda max_len: DecoderRunner(
        from_hf(loaded.model, max_positions=max_len), cfg.max_num_seqs, max_len, compile=True, device=runner_device))
    runner = engine.runner
    per_step: list[tuple[int, int]] = []
    seen = [0, 0]  # copies to the device and back in the runner's calls of this engine step

    def counted(call):  # the runner's own calls only: the engine's host tensors are no copies
        def run(*a, **k):
            with DeviceTransfers(runner_device) as transfers:
                out = call(*a, **k)
            seen[0] += transfers.to_device
            seen[1] += transfers.to_host
            return out
        return run

    runner.prefill_step, runner.verify_step = counted(runner.prefill_step), counted(runner.verify_step)

    def serve() -> None:
        for i, p in enumerate(prompts):
            submit(engine, p, n, None)
            submit(engine, p, n, 7 + i)
        while engine.has_unfinished():
            seen[:] = [0, 0]
            engine.step()
            per_step.append((seen[0], seen[1]))

    serve()
    warm_shapes, warm_graphs = len(runner._graphs), counters["stats"]["unique_graphs"]
    sec["warmup_s"] = round(time.perf_counter() - t0, 2)
    sec["shapes_warmed"] = warm_shapes
    per_step.clear()
    serve()
    new_shapes = len(runner._graphs) - warm_shapes
    sec.update(model=shape, tree="2.2.2", steps=len(per_step), graph_breaks=sum(counters["graph_break"].values()),
               recompiles_after_warmup=counters["stats"]["unique_graphs"] - warm_graphs - new_shapes,
               new_shapes_after_warmup=new_shapes,
               h2d_copies_per_step=max(h for h, _ in per_step), d2h_copies_per_step=max(d for _, d in per_step),
               copies_per_step_seen=sorted(set(per_step)))
    rep.check(sec, "0 graph breaks", sec["graph_breaks"] == 0, sec["graph_breaks"])
    rep.check(sec, "0 recompiles after warm-up", sec["recompiles_after_warmup"] == 0, sec["recompiles_after_warmup"])
    rep.check(sec, "1 copy to the device and 1 back per step", set(per_step) == {(1, 1)}, sec["copies_per_step_seen"])
    print(f"   {len(per_step)} steps: {sec['graph_breaks']} graph breaks, {sec['recompiles_after_warmup']} recompiles, "
          f"{new_shapes} new shapes after warm-up ({warm_shapes} warmed in {sec['warmup_s']} s); copies per step "
          f"{sec['copies_per_step_seen']}", flush=True)
    runner.__dict__.pop("prefill_step")
    runner.__dict__.pop("verify_step")
    del engine, runner, loaded
    release(device)


# ---- 5. tensor parallelism -----------------------------------------------------------------------
def tp_section(rep: Report, sec: dict, device: torch.device, dtype: torch.dtype, args) -> None:
    """The same greedy requests through the local runner and a ``TPModelRunner``: tokens (a
    difference only at a near-tie of the unsharded model: the shards sum in another order) and the
    bytes each verification step brings back to the replica."""
    from tr_serve.bench.local_ray import local_ray
    from tr_serve.engine.config import EngineConfig
    from tr_serve.tp.runner import tp_engine

    shape = dict(TINY if args.tiny else SMALL)
    if args.vocab:
        shape["vocab_size"] = args.vocab
    name = str(dtype).removeprefix("torch.")
    shipped = random_llama(shape, dtype, torch.device("cpu"), seed=2, init_range=0.1)  # each worker moves its slice
    loaded = dataclasses.replace(shipped, model=copy.deepcopy(shipped.model).to(device))  # the local runner's
    tree = args.trees[-1] if args.trees else "none"
    rows = max(args.concurrency)
    prompts = random_prompts(rows, args.lossless_prompt_tokens, shape["vocab_size"], seed=3)
    n = args.lossless_new_tokens
    max_len = args.lossless_prompt_tokens + n + 1
    sec.update(model=shape, world_size=args.tp, tree=tree, rows=rows, new_tokens=n)
    local = decode(make_engine(loaded, tree, rows, max_len, device, name), prompts, n, False, device)
    if IdTokenizer.__module__ != "__main__":  # loaded by path (the tests): the workers cannot import
        import ray.cloudpickle  # this script, so its tokenizer travels by value, as from __main__

        ray.cloudpickle.register_pickle_by_value(sys.modules[IdTokenizer.__module__])
    config = EngineConfig(model=loaded.model_id, tree=tree, k=8, max_num_seqs=rows, max_model_len=max_len,
                          device=str(device), dtype=name, budget="fixed", cpu_kernels="torch", matrix_prior=False)
    with local_ray(args.tp + 1):
        engine = tp_engine(shipped, config, args.tp, cpu_threads=1, measure_bytes=True)
        try:
            got = decode(engine, prompts, n, False, device)
            t = engine.runner.transfer
            sec["transfer"] = {"forwards": t.forwards, "messages_per_forward": t.messages / max(t.forwards, 1),
                               "bytes_out_per_forward": t.bytes_out // max(t.forwards, 1),
                               "bytes_back_per_forward": t.bytes_back // max(t.forwards, 1)}
        finally:
            engine.shutdown()
    sec["local"], sec["tp"] = _run_entry(local), _run_entry(got)
    sec["tp_vs_local"] = diff = compare(local.tokens, got.tokens, loaded.model, prompts)
    near_tie = all(g < 1e-3 for g in diff.get("top2_gaps", []))
    rep.check(sec, "tp == local (greedy), or parts at a near-tie (top-2 gap < 1e-3)", near_tie, diff)
    print(f"   tp={args.tp}: {diff['differing']}/{rows} differ; {_mb(got.verify_bytes_per_call)} back per "
          f"verification step ({_mb(local.verify_bytes_per_call)} local)", flush=True)


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny models and shapes: seconds on a CPU (the test suite)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    ap.add_argument("--trees", default="top4,top8,2.2.2", help="comma-separated tree templates")
    ap.add_argument("--mat", action="append", metavar="TREE=VALUE", help="MAT of a tree on the dev questions")
    ap.add_argument("--bench-json", help="a `tr-serve bench` JSON: the MAT of its tr:<tree> methods")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="engine part: prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=32, help="engine part: new tokens per request")
    ap.add_argument("--prompts", type=int, default=16, help="losslessness: prompts")
    ap.add_argument("--lossless-new-tokens", type=int, default=64)
    ap.add_argument("--lossless-prompt-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary of the small models (losslessness, tp), e.g. 128256 for Llama-3's")
    ap.add_argument("--tp", type=int, default=0, help="tensor-parallel workers for the tp section (0: none)")
    ap.add_argument("--allow-math-attention", dest="attention_guard", action="store_false",
                    help="do not refuse SDPA's math fallback in the latency and engine sections")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help=f"skip what is left after this many seconds (default {TIME_BUDGET_S:.0f}; none with --tiny)")
    ap.add_argument("--json", default="bench_out/gpu_check.json")
    args = ap.parse_args(argv)
    args.trees = [t for t in args.trees.split(",") if t]
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}: choose from {','.join(SECTIONS)}")
    args.contexts, args.query_tokens, args.concurrency = CONTEXTS, QUERY_TOKENS, CONCURRENCY
    if args.time_budget_s is None and not args.tiny:
        args.time_budget_s = TIME_BUDGET_S
    if args.tiny:  # the same parts and report, smaller: contexts 64 and 256, one timed call per point
        args.contexts, args.repeats = (64, 256), 1
        args.prompt_tokens, args.new_tokens = min(args.prompt_tokens, 16), min(args.new_tokens, 16)
        args.prompts, args.lossless_new_tokens = min(args.prompts, 4), min(args.lossless_new_tokens, 16)
        args.lossless_prompt_tokens = min(args.lossless_prompt_tokens, 16)
    return args


def environment(device: torch.device, dtype: torch.dtype, args) -> dict:
    import transformers
    from transformers import LlamaModel

    from tr_serve.runner.hf_compat import cache_keyword

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "transformers_path": str(Path(transformers.__file__).parent),
           "cache_keyword": cache_keyword(LlamaModel), "device": str(device),
           "dtype": str(dtype).removeprefix("torch."), "tiny": args.tiny, "sections": args.sections,
           "attention_guard": list(FUSED_SDPA) if args.attention_guard else None,
           "ray": importlib.util.find_spec("ray") is not None,
           "flex_attention": importlib.util.find_spec("torch.nn.attention.flex_attention") is not None,
           "runner_forward": "compact decoder (as on GPUs)",
           "time_budget_s": args.time_budget_s}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gb=round(props.total_memory / GIB, 1), cuda=torch.version.cuda,
                   matmul_tf32=torch.backends.cuda.matmul.allow_tf32,
                   sdpa_enabled={"flash": torch.backends.cuda.flash_sdp_enabled(),
                                 "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                 "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                 "math": torch.backends.cuda.math_sdp_enabled()})
    else:
        env["device_name"] = platform.processor() or platform.machine()
    return env


def run(argv=None) -> dict:
    """Run the check; returns the report (also written to ``--json``)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu (and --tiny for seconds)")
    threads = torch.get_num_threads()
    if device.type == "cpu" and args.tiny:
        torch.set_num_threads(1)  # tiny shapes: more threads only contend
    try:
        return _run(args, device)
    finally:
        torch.set_num_threads(threads)


def _run(args, device: torch.device) -> dict:
    from tr_serve.model_loader import parse_dtype

    dtype = parse_dtype(args.dtype, device.type)
    dtype_name = str(dtype).removeprefix("torch.")
    read_mat(args)  # a bad --bench-json stops here, before anything is built
    rep = Report(args.json, environment(device, dtype, args), device, args.time_budget_s)
    print(f"gpu_check: {rep.data['env']}", flush=True)
    big = None
    if "latency" in args.sections or "engine" in args.sections:
        big = random_llama(TINY if args.tiny else LLAMA3_8B, dtype, device, seed=0)
    table: dict = {}
    if "latency" in args.sections:
        table = rep.run_section("latency", lambda sec: latency_section(rep, sec, big, device, args)).get(
            "by_context", {})
    if "engine" in args.sections:
        rep.run_section("engine", lambda sec: engine_section(rep, sec, big, device, dtype_name, args, table))
    del big
    release(device)
    if "losslessness" in args.sections:
        rep.run_section("losslessness", lambda sec: losslessness_section(rep, sec, device, dtype, args))
    if "step_audit" in args.sections:
        audit = rep.run_section("step_audit", lambda sec: step_audit_section(rep, sec, device, dtype, args))
        rep.data["step_audit"] = {k: audit.get(k) for k in STEP_AUDIT_KEYS}
    if "tp" in args.sections:
        if args.tp < 2:
            rep.skip("tp", "no --tp N (N >= 2) given")
        elif importlib.util.find_spec("ray") is None:
            rep.skip("tp", "ray is not installed here")
        elif device.type == "cuda" and torch.cuda.device_count() < args.tp:
            rep.skip("tp", f"{torch.cuda.device_count()} GPU(s) visible, --tp {args.tp} needs one per worker")
        else:
            rep.run_section("tp", lambda sec: tp_section(rep, sec, device, dtype, args))
    rep.write()
    verdict = "PASSED" if rep.passed else "FAILED: " + "; ".join(rep.data["failures"])
    print(f"gpu_check {verdict} ({rep.data['seconds']} s)" + (f", wrote {rep.path}" if rep.path else ""), flush=True)
    return rep.data


def main(argv=None) -> int:
    """The command: exit status 0 when every gating check passed, else 1."""
    return 0 if run(argv)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
