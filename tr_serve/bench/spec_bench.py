"""Spec-Bench style benchmark: plain greedy decoding vs Token Recycling trees vs prompt lookup decoding.

The command line of ``tr-serve bench`` (single stream; also ``python -m tr_serve.bench.spec_bench``):
its arguments, the :class:`~tr_serve.bench.config.BenchConfig` they make, and the run
(:func:`tr_serve.bench.runner.run_bench`) with its tables on stdout. The methods are described in
:mod:`tr_serve.bench.methods`, the figures in :mod:`tr_serve.bench.summary`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from tr_serve.bench.config import DEFAULT_JSON, SEEDING_MODES, SUFFIX_MODES, BenchConfig
from tr_serve.bench.questions import DEFAULT_QUESTIONS
from tr_serve.bench.records import BenchError
from tr_serve.bench.workloads import WORKLOADS
from tr_serve.cli_args import non_negative_int, positive_int, run_standalone
from tr_serve.engine.config import CPU_KERNEL_MODES, DEFAULT_MODEL


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
    p.add_argument("--prompt-seeding", choices=SEEDING_MODES, default="default",
                   help="seed the TR matrix from the prompt's logits: as the engine does by default (fixed "
                        "templates do, auto does not), forced on or off, or 'both': tr:<tree> seeded and "
                        "tr:<tree>-noseed not, per tree (default: default)")
    p.add_argument("--matrix-prior", choices=("on", "off", "both"), default="on",
                   help="start each tr:* matrix from the model's own top-k after [BOS, token] (as the engine does "
                        "by default), without it, or 'both': tr:<tree> with it and tr:<tree>-noprior without (default: on)")
    p.add_argument("--suffix-index", choices=SUFFIX_MODES, default="default",
                   help="the cross-request suffix index of tr:auto: as the engine does by default, forced on or off, "
                        "or 'both': tr:<tree> as by default and tr:<tree>-nosuffix without it (default: default)")
    p.add_argument("--workload", choices=WORKLOADS, default="questions",
                   help="questions: each question's first turn; multi-turn: the questions with a second turn, each "
                        "as turn 1 then turn 2 after turn 1's answer; code-revision: each coding question, then "
                        "requests that hand its code back with one change (tr_serve/bench/workloads.py; default: "
                        "questions)")
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
        prompt_seeding=args.prompt_seeding, matrix_prior=args.matrix_prior, pld=args.pld, hf=args.hf,
        warmup=args.warmup, device=args.device, dtype=args.dtype, k=args.k, time_split=args.time_split,
        threads=args.threads, cpu_kernels=args.cpu_kernels, workload=args.workload, suffix_index=args.suffix_index,
    )


def execute(args: argparse.Namespace, prog: str = "tr-serve bench", progress: bool = True) -> int:
    """Run from parsed arguments: tables on stdout, errors as one line on stderr (exit 2)."""
    from tr_serve.bench.report import markdown_tables
    from tr_serve.bench.runner import run_bench

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
    return run_standalone("tr-serve bench", __doc__.splitlines()[0], add_arguments, execute, argv)


if __name__ == "__main__":
    sys.exit(main())
