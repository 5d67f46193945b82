"""``BenchConfig``: the settings of one ``tr-serve bench`` run (single stream), validated before the
model loads so that a bad argument costs no load time."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tr_serve.bench.questions import DEFAULT_QUESTIONS
from tr_serve.bench.records import BenchError
from tr_serve.cli_args import missing_model_path
from tr_serve.engine.config import CPU_KERNEL_MODES, DEFAULT_MODEL

DEFAULT_JSON = os.path.join("bench_out", "bench.json")
SEEDING_MODES = ("default", "on", "off", "both")
PRIOR_MODES = ("on", "off", "both")
SUFFIX_MODES = ("default", "on", "off", "both")


@dataclass
class BenchConfig:
    questions: str = DEFAULT_QUESTIONS
    per_category: int = 2
    max_new_tokens: int = 128
    trees: tuple[str, ...] = ("2.2.2",)
    model: str = DEFAULT_MODEL
    json_out: str = DEFAULT_JSON
    prompt_seeding: str = "default"
    matrix_prior: str = "on"  # EngineConfig.matrix_prior of tr:*; "both": tr:<tree> with it, tr:<tree>-noprior without
    pld: bool = True  # same-runner prompt lookup (engine tree "pld")
    hf: bool = True  # transformers' generate: hf-greedy and hf-pld
    warmup: int = 1
    device: str = "auto"
    dtype: str = "auto"
    k: int = 8
    time_split: bool = True
    threads: int | None = None  # torch CPU threads; None keeps torch's default
    cpu_kernels: str = "auto"  # EngineConfig.cpu_kernels of every engine method (baseline, tr:*, pld)
    workload: str = "questions"  # tr_serve/bench/workloads.py
    # EngineConfig.suffix_index of the tr:* methods that can use it; "both": tr:<tree> as the engine does by
    # default, and tr:<tree>-nosuffix without it
    suffix_index: str = "default"

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
        if self.matrix_prior not in PRIOR_MODES:
            raise BenchError(f"--matrix-prior must be one of {', '.join(PRIOR_MODES)}, got {self.matrix_prior!r}")
        from tr_serve.bench.workloads import WORKLOADS

        if self.workload not in WORKLOADS:
            raise BenchError(f"--workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if self.suffix_index not in SUFFIX_MODES:
            raise BenchError(f"--suffix-index must be one of {', '.join(SUFFIX_MODES)}, got {self.suffix_index!r}")
        if not self.trees:
            raise BenchError("give at least one --tree")
        seen = set()
        for spec in self.trees:
            validate_tree(spec, self.k)
            if spec.strip() in seen:
                raise BenchError(f"--tree {spec!r} is given twice")
            seen.add(spec.strip())
        if self.suffix_index in ("on", "both"):
            from tr_serve.tr.tree_spec import parse_tree_spec

            if not any(parse_tree_spec(spec).prices_branches for spec in self.trees):
                raise BenchError(f"--suffix-index {self.suffix_index}: the suffix index drafts under tree 'auto' "
                                 "only; give --tree auto")
        from tr_serve.model_loader import parse_dtype

        try:
            parse_dtype(self.dtype, "cpu")
        except ValueError as e:
            raise BenchError(str(e)) from None
        missing = missing_model_path(self.model)
        if missing:
            raise BenchError(missing)
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


def resolve_device(device: str) -> str:
    """``auto`` as ``cuda`` when there is one, else ``cpu``; a CUDA device on a machine without CUDA
    is a :class:`BenchError`."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {device}: CUDA is not available on this machine")
    return device
