"""``tr-serve``: command-line entry point.

    tr-serve generate --prompt TEXT [--model M] [--max-tokens N] [--tree 2.2.2|NAME|PATH.json]
                      [--no-tr] [--k 8] [--stop S ...] [--raw]
    tr-serve bench [--questions PATH] [--per-category N] [--max-new-tokens N] [--tree T ...] ...
    tr-serve bench --concurrency 1,4,8 [--questions PATH] [--per-category N] ...
    tr-serve bench-fleet --questions PATH --json OUT [--per-category N] [--max-new-tokens N] [--tree NAME]
    tr-serve bench-tp [--tp 3] [--questions N] [--max-tokens N] [--tree T] ...
    tr-serve bench-tp-fleet [--config CONFIG.yaml] [--per-category N] [--max-tokens N] ...
    tr-serve run CONFIG.yaml [--drain-timeout S] [--num-cpus N]  # `serve run` with a graceful drain, Ray token auth on
    tr-serve prepare CONFIG.yaml  # a replica's kernel plan, latency table and matrix prior, cached ahead of time

Bad arguments print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

from tr_serve.cli_args import (OneLineErrorParser, UsageError, check_model_arg, non_negative_int, positive_int,
                               positive_int_list, quiet_transformers)
from tr_serve.engine.config import DEFAULT_MODEL

def build_parser() -> OneLineErrorParser:
    from tr_serve.bench import spec_bench

    parser = OneLineErrorParser(prog="tr-serve", description="Lossless Token Recycling speculative decoding.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate one answer and print the Token Recycling statistics",
                       description="Generate one answer (greedy) and print the Token Recycling statistics.")
    g.add_argument("--prompt", required=True, help="the user message (or the raw text with --raw)")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model directory, .gguf file, hub id or {DEFAULT_MODEL} (default)")
    g.add_argument("--max-tokens", type=positive_int, default=128, metavar="N",
                   help="new tokens at most (default: 128)")
    trees = g.add_mutually_exclusive_group()
    trees.add_argument("--tree", default="auto", metavar="auto|2.2.2|NAME[+ctx]|pld|PATH.json",
                       help="tree setting: auto (cost-aware hybrid), a template name or JSON file of paths, "
                            "<template>+ctx, or pld (default: auto)")
    trees.add_argument("--no-tr", action="store_true", help="plain greedy decoding through the same runner")
    g.add_argument("--k", type=positive_int, default=8, help="candidates per matrix row (default: 8)")
    g.add_argument("--stop", nargs="+", action="extend", default=[], metavar="S",
                   help="stop strings (cut from the answer)")
    g.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto = cuda if available)")
    g.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="benchmark TR against plain decoding and PLD on Spec-Bench questions",
                       description="Spec-Bench benchmark: baseline greedy vs Token Recycling trees vs prompt "
                                   "lookup decoding, interleaved prompt by prompt.")
    spec_bench.add_arguments(b)
    b.add_argument("--concurrency", type=positive_int_list, default=None, metavar="N[,N...]",
                   help="instead: N concurrent clients through the async engine per level, comparing plain "
                        "continuous batching (baseline), same-runner pld and tr:<tree> for each --tree (default: "
                        "tr:2.2.2 and tr:auto); every level and round serves --per-category questions per "
                        "category of its own, and at least --questions-per-client per client")
    b.add_argument("--questions-per-client", type=non_negative_int, default=3, metavar="K",
                   help="with --concurrency: each round of level N serves at least K x N questions, so that N "
                        "clients stay busy rather than one static batch waiting on its slowest request "
                        "(default: 3; 0: --per-category alone)")
    b.add_argument("--rounds", type=positive_int, default=1, metavar="R",
                   help="with --concurrency: R rounds per level, each on questions of its own, alternating the "
                        "order of the methods each round (default: 1)")
    b.add_argument("--latency", action="store_true",
                   help="instead: one verify forward's latency by query tokens (1-80) at contexts 256 and 1024 "
                        "through the engine's runner and kernels (tr_serve/bench/latency.py; --json default "
                        "bench_out/latency.json)")
    b.set_defaults(func=cmd_bench)

    from tr_serve.bench import fleet as bench_fleet
    from tr_serve.bench import tp as bench_tp
    from tr_serve.bench import tp_fleet as bench_tp_fleet

    bench_fleet.add_parser(sub)  # tr-serve bench-fleet
    bench_tp.add_parser(sub)  # tr-serve bench-tp
    bench_tp_fleet.add_parser(sub)  # tr-serve bench-tp-fleet
    from tr_serve.serve import run as serve_run

    serve_run.add_parser(sub)  # tr-serve run CONFIG
    from tr_serve.serve import warm_cache

    warm_cache.add_parser(sub)  # tr-serve prepare CONFIG
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    """``tr-serve generate``: one greedy answer, then its Token Recycling statistics."""
    tree = _check_generate_args(args)

    from tr_serve.engine.errors import PromptTooLongError
    from tr_serve.engine.prompt import encode_prompt
    from tr_serve.llm import LLM
    from tr_serve.model_loader import load_model
    from tr_serve.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, stop=tuple(args.stop))
    except ValueError as e:
        raise UsageError(str(e)) from None
    quiet_transformers()
    try:
        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load model {args.model!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    prompt_ids = encode_prompt(loaded.tokenizer, prompt)
    max_pos = getattr(loaded.model.config, "max_position_embeddings", None) or 2048
    max_model_len = min(max_pos, max(2048, len(prompt_ids) + args.max_tokens + 1))
    llm = LLM(model=args.model, tree=tree, k=args.k, loaded=loaded, max_num_seqs=1, max_model_len=max_model_len,
              device=args.device, dtype=args.dtype)
    t0 = time.perf_counter()
    try:
        out = llm.generate([prompt_ids], params)[0]
    except PromptTooLongError as e:
        raise UsageError(str(e)) from None
    wall = time.perf_counter() - t0

    print(out.text)
    print()
    print(_generation_stats(out, len(prompt_ids), tree, args.k, wall))
    return 0


def _check_generate_args(args: argparse.Namespace) -> str:
    """Refuse bad ``generate`` arguments before the model loads (``--device auto`` is resolved in
    ``args``); the tree setting to run."""
    import torch

    from tr_serve.engine.config import EngineConfig
    from tr_serve.model_loader import parse_dtype
    from tr_serve.tr.tree_spec import validate_tree_spec

    if not args.prompt.strip():
        raise UsageError("--prompt is empty")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    tree = "none" if args.no_tr else args.tree
    try:
        validate_tree_spec(tree, args.k)
        EngineConfig(model=args.model, tree=tree, k=args.k, max_num_seqs=1, device=args.device, dtype=args.dtype)
        parse_dtype(args.dtype, args.device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    check_model_arg(args.model)
    return tree


def _generation_stats(out, prompt_tokens: int, tree: str, k: int, wall: float) -> str:
    """The statistics block printed under the answer."""
    from tr_serve.tr.tree_spec import is_plain

    n = len(out.token_ids)
    steps = out.stats.verification_steps
    reason = getattr(out.finish_reason, "value", out.finish_reason)
    header = "plain greedy decoding (no TR)" if is_plain(tree) else f"Token Recycling: tree {tree}, k={k}"
    return "\n".join([
        f"--- {header} ---",
        f"prompt tokens:      {prompt_tokens}",
        f"tokens:             {n}",
        f"verification steps: {steps} (+1 prefill)",
        f"MAT:                {'n/a' if steps == 0 else f'{out.stats.mat:.2f}'}",
        f"tokens/s:           {n / wall:.2f}" if wall > 0 else "tokens/s:           n/a",
        f"wall time:          {wall:.2f} s",
        f"finish reason:      {reason}",
    ])


def cmd_bench(args: argparse.Namespace) -> int:
    """``tr-serve bench``: single stream, or ``--latency``, or ``--concurrency`` (the bench's own modules)."""
    quiet_transformers()
    if args.latency:
        from tr_serve.bench import latency

        return latency.execute(args)
    if args.concurrency:
        from tr_serve.bench import concurrency

        return concurrency.execute(args)
    from tr_serve.bench import spec_bench

    return spec_bench.execute(args, prog="tr-serve bench")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"tr-serve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tr-serve {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
