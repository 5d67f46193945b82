"""The methods ``tr-serve bench`` compares, and how each answers one question.

Names as in the JSON:

* ``baseline``: plain greedy decoding through the engine (tree ``none``).
* ``tr:<tree>``: the engine with that tree setting (``2.2.2``, ``top8+ctx``, ``auto``, a .json...).
* ``pld``: prompt lookup through the same engine, runner, kernels and verifier (tree ``pld``): the
  only difference from ``tr:*`` is the draft.
* ``hf-greedy`` and ``hf-pld``: transformers' ``generate`` (torch's own kernels), plain greedy and
  prompt lookup decoding, a reference pair outside the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tr_serve.bench.config import BenchConfig
from tr_serve.bench.records import Run
from tr_serve.tr.tree_spec import parse_tree_spec

HF_PLD_NUM_TOKENS = 10  # transformers' prompt_lookup_num_tokens for hf-pld


@dataclass
class Method:
    name: str
    kind: str  # "baseline", "tr", "pld" (engine methods) or "hf" (transformers' generate)
    tree: str | None = None  # engine tree setting
    prompt_seeding: bool | None = None  # EngineConfig.prompt_seeding (None: the engine's default)
    matrix_prior: bool = True  # EngineConfig.matrix_prior
    suffix_index: bool | None = None  # EngineConfig.suffix_index (None: the engine's default)
    reference: str = "baseline"  # the method whose tokens/s is the denominator of this one's speedup
    lookup: int = 0  # hf: prompt_lookup_num_tokens, 0 for plain greedy
    llm: Any = None
    runs: list[Run] = field(default_factory=list)

    @property
    def engine(self) -> bool:
        return self.kind != "hf"


def build_methods(cfg: BenchConfig) -> list[Method]:
    methods = [Method("baseline", "baseline", tree="none")]
    for spec in (t.strip() for t in cfg.trees):
        # tr:<tree> runs as the engine does by default unless seeding is forced on or off
        seeding = {"default": None, "on": True, "off": False, "both": True}[cfg.prompt_seeding]
        prior = cfg.matrix_prior != "off"
        methods.append(Method(f"tr:{spec}", "tr", tree=spec, prompt_seeding=seeding, matrix_prior=prior))
        if cfg.prompt_seeding == "both":
            methods.append(Method(f"tr:{spec}-noseed", "tr", tree=spec, prompt_seeding=False, matrix_prior=prior))
        if cfg.matrix_prior == "both":
            methods.append(Method(f"tr:{spec}-noprior", "tr", tree=spec, prompt_seeding=seeding, matrix_prior=False))
        if cfg.suffix_index == "both" and parse_tree_spec(spec).prices_branches:
            methods.append(Method(f"tr:{spec}-nosuffix", "tr", tree=spec, prompt_seeding=seeding, matrix_prior=prior,
                                  suffix_index=False))
    suffix = {"default": None, "on": True, "off": False, "both": None}[cfg.suffix_index]
    for m in methods:
        if m.kind == "tr" and m.suffix_index is None and parse_tree_spec(m.tree).prices_branches:
            m.suffix_index = suffix
    if cfg.pld:
        methods.append(Method("pld", "pld", tree="pld"))
    if cfg.hf:
        methods.append(Method("hf-greedy", "hf", reference="hf-greedy"))
        methods.append(Method("hf-pld", "hf", reference="hf-greedy", lookup=HF_PLD_NUM_TOKENS))
    return methods


def sync_device(device: str) -> None:
    """Wait for queued CUDA work, so that a timer around it measures the work (no-op on CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run_engine(llm, prompt_ids: list[int], max_new_tokens: int, device: str) -> tuple[list[int], float, list[int], str]:
    """Greedy generation through the engine; returns (token ids, seconds, ``stats.accepted_per_step``,
    finish reason)."""
    from tr_serve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens)
    sync_device(device)
    t0 = time.perf_counter()
    out = llm.generate([list(prompt_ids)], params)[0]
    sync_device(device)
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
        sync_device(device)
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
        sync_device(device)
        seconds = time.perf_counter() - t0
    finish = "stop" if new and new[-1] in eos else "length"
    return new, seconds, counter.count, finish


def run_method(method: Method, loaded, question, max_new_tokens: int, device: str) -> Run:
    """``method`` on one question, as a :class:`Run` whose ``forwards`` and ``accepted`` leave out
    the prefill forward and the token it gave (so ``accepted / forwards`` is the MAT)."""
    q = question
    if not method.engine:
        ids, sec, forwards, finish = run_hf(loaded, q.prompt_ids, max_new_tokens, device, method.lookup)
        return Run(q.question_id, q.category, ids, sec, max(0, forwards - 1), max(0, len(ids) - 1), finish)
    ids, sec, steps, finish = run_engine(method.llm, q.prompt_ids, max_new_tokens, device)
    return Run(q.question_id, q.category, ids, sec, len(steps), sum(steps), finish)
