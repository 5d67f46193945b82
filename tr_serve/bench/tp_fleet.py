"""Fleet sync under tensor parallelism: does a fresh TP replica warmed from the fleet start hot, and
do TP replicas give the single-process engine's greedy tokens with the fleet on?

    tr-serve bench-tp-fleet --config configs/smollm2-cpu-tp.yaml --per-category 1 --max-tokens 48

The engine settings are those of the Serve config's first application (``tensor_parallel_size``,
tree unless ``--tree``, ``max_num_seqs``, ...), with fleet sync switched on (a namespace and snapshot folder of its
own, removed at the end). On a local Ray instance, one replica at a time (``AsyncEngine`` over
``tp_engine``, as ``LLMServer`` builds it):

1. **reference**: ``Engine`` over a local ``ModelRunner`` (tp=1, no fleet) on the measured half.
2. **warm**: TP replica A, fleet sync on, answers the warm half; its rows are pushed.
3. **cold**: a fresh TP replica with an empty matrix (fleet off) answers the measured half.
4. **fleet-warm**: a fresh TP replica B, fleet sync on, adopts the fleet's snapshot and answers the
   measured half (its sync keeps running).

Questions: ``2 x --per-category`` per Spec-Bench dev category, alternately warm / measured (as
``tr-serve bench-fleet``); the requests of a half are submitted together. MAT = accepted tokens per
verification step over the measured half. ``--sequential`` answers one question at a time.
``identical``: cold and fleet-warm TP tokens equal the tp=1 reference token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Sequence

import yaml

from tr_serve.bench.fleet import generate_one, outputs_mat
from tr_serve.bench.local_ray import local_ray
from tr_serve.bench.questions import DEFAULT_QUESTIONS, short_questions, split_questions
from tr_serve.bench.records import read_questions
from tr_serve.cli_args import add_command, positive_float, positive_int, quiet_transformers, run_standalone


def engine_config_from(path: str, max_model_len: int | None = None):
    from tr_serve.serve.config import TRServeConfig

    args = yaml.safe_load(Path(path).read_text())["applications"][0]["args"]
    cfg = TRServeConfig.from_args(args)
    engine_config = cfg.engine_config()
    if max_model_len is not None:
        import dataclasses

        engine_config = dataclasses.replace(engine_config, max_model_len=max_model_len)
    return cfg, engine_config


async def _answer(engine, prompts: list[list[int]], max_tokens: int, tag: str, sequential: bool) -> list:
    """Every prompt's answer: one at a time (``--sequential``, as ``tr-serve bench-fleet``) or all at once."""
    if sequential:
        return [await generate_one(engine, p, max_tokens, f"{tag}-{i}") for i, p in enumerate(prompts)]
    return await asyncio.gather(*[generate_one(engine, p, max_tokens, f"{tag}-{i}") for i, p in enumerate(prompts)])


async def _bench(args) -> dict:
    from tr_serve.engine.async_engine import AsyncEngine
    from tr_serve.engine.engine import Engine
    from tr_serve.fleet import FleetSyncConfig
    from tr_serve.fleet.sync import MatrixSync
    from tr_serve.model_loader import load_model
    from tr_serve.tp.runner import tp_engine

    serve_cfg, config = engine_config_from(args.config)
    if args.tree:
        import dataclasses

        config = dataclasses.replace(config, tree=args.tree)
    tp = serve_cfg.tensor_parallel_size
    loaded = load_model(config.model, config.device, config.dtype)
    questions = short_questions(loaded.tokenizer, read_questions(DEFAULT_QUESTIONS), args.max_prompt_tokens)
    warm, measure = split_questions(questions, args.per_category)
    warm_p = [q.prompt_ids for q in warm]
    measure_p = [q.prompt_ids for q in measure]
    snapshot_dir = tempfile.mkdtemp(prefix="tp_fleet_")
    fleet = FleetSyncConfig(enabled=True, namespace=f"tpbench-{uuid.uuid4().hex[:8]}", snapshot_dir=snapshot_dir,
                            sync_interval_s=args.sync_interval_s, snapshot_interval_s=3600)
    t_start = time.perf_counter()
    result: dict = {"config": args.config, "tensor_parallel_size": tp, "tree": config.tree,
                    "sequential": args.sequential,
                    "max_tokens": args.max_tokens, "warm_questions": [q.question_id for q in warm],
                    "measured_questions": [q.question_id for q in measure]}

    def log(msg):
        print(f"[tp-fleet {time.perf_counter() - t_start:6.1f} s] {msg}", flush=True)

    # 1. reference: tp=1
    ref_engine = AsyncEngine(Engine(loaded, config))
    try:
        ref = await _answer(ref_engine, measure_p, args.max_tokens, "ref", args.sequential)
    finally:
        ref_engine.shutdown()
    log(f"reference tp=1: MAT {outputs_mat(ref):.3f}")

    async def replica(name: str, prompts, sync_on: bool, adopt: bool):
        core = await asyncio.to_thread(tp_engine, config.model, config, tp, cpu_threads=serve_cfg.cpu_threads)
        engine = AsyncEngine(core)
        sync = None
        try:
            if sync_on:
                sync = MatrixSync(engine, fleet, model_id=config.model, tokenizer=core.tokenizer, replica_id=name)
                if adopt:
                    first = await sync.sync_once()
                    if first["error"] is not None or not sync.adopt_s:
                        raise RuntimeError(f"replica {name} could not adopt the fleet snapshot: {first}")
                    log(f"{name} adopted version {sync.adopted_version} in {sync.adopt_s[0] * 1e3:.2f} ms "
                        f"({int(core.matrix.num_filled_rows())} rows)")
                sync.start()
            outs = await _answer(engine, prompts, args.max_tokens, name, args.sequential)
            stats = None
            if sync is not None:
                flushed = await sync.flush()
                if flushed["error"] is not None:
                    raise RuntimeError(f"replica {name} could not push: {flushed['error']}")
                await sync.stop(final_push=False)
                stats = sync.stats()
            transfer = core.runner.transfer
            return outs, stats, {"forwards": transfer.forwards, "messages": transfer.messages,
                                 "forward_s": transfer.seconds}
        finally:
            engine.shutdown()
            core.runner.shutdown()

    warm_outs, warm_sync, _ = await replica("A", warm_p, sync_on=True, adopt=False)
    log(f"warm TP replica A: MAT {outputs_mat(warm_outs):.3f}, pushed {warm_sync['rows_pushed']} rows")
    cold, _, cold_t = await replica("cold", measure_p, sync_on=False, adopt=False)
    log(f"cold TP replica: MAT {outputs_mat(cold):.3f}")
    fleet_warm, b_sync, b_t = await replica("B", measure_p, sync_on=True, adopt=True)
    log(f"fleet-warm TP replica B: MAT {outputs_mat(fleet_warm):.3f}")
    shutil.rmtree(snapshot_dir, ignore_errors=True)

    base = [o.token_ids for o in ref]
    same_cold = [o.token_ids == t for o, t in zip(cold, base)]
    same_warm = [o.token_ids == t for o, t in zip(fleet_warm, base)]
    mats = {name: outputs_mat(outs) for name, outs in (("ref", ref), ("cold", cold), ("fleet_warm", fleet_warm),
                                                         ("warm", warm_outs))}
    result.update({
        "reference_mat_tp1": mats["ref"], "cold_mat": mats["cold"], "fleet_warm_mat": mats["fleet_warm"],
        "fleet_over_cold": mats["fleet_warm"] / mats["cold"], "warm_mat": mats["warm"],
        "identical_cold": all(same_cold), "identical_fleet_warm": all(same_warm),
        "identical_questions": sum(a and b for a, b in zip(same_cold, same_warm)), "questions": len(measure),
        "tokens_compared": sum(len(t) for t in base),
        "sync_warm_replica": warm_sync, "sync_fleet_replica": b_sync,
        "transfer_cold": cold_t, "transfer_fleet_warm": b_t, "seconds": time.perf_counter() - t_start,
    })
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="configs/smollm2-cpu-tp.yaml", help="Serve config (default: %(default)s)")
    p.add_argument("--per-category", type=positive_int, default=1,
                   help="N warm and N measured questions per category (default: 1)")
    p.add_argument("--max-tokens", type=positive_int, default=48, help="new tokens per question (default: 48)")
    p.add_argument("--tree", default=None, help="instead of the config's tree (e.g. 2.2.2, as tr-serve bench-fleet)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=400,
                   help="skip questions with longer prompts (default: 400)")
    p.add_argument("--sync-interval-s", type=positive_float, default=1.0,
                   help="replica push/poll period (default: 1.0)")
    p.add_argument("--num-cpus", type=positive_int, default=None, help="logical CPUs of the local Ray (default tp + 1)")
    p.add_argument("--sequential", action="store_true", help="one question at a time (default: a half at once)")
    p.add_argument("--json", default=None, help="write the results here")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``tr-serve bench-tp-fleet``: register on the CLI's subparsers (sets ``func=run``)."""
    return add_command(subparsers, "bench-tp-fleet",
                       help="fleet sync under tensor parallelism: cold vs fleet-warm TP replica, identical to tp=1",
                       description=__doc__.splitlines()[0], add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone("tr-serve bench-tp-fleet", __doc__.splitlines()[0], add_arguments, run, argv)


def run(args: argparse.Namespace) -> int:
    """Run the four phases on a local Ray, print the figures, write ``--json``."""
    quiet_transformers()
    import torch

    torch.set_num_threads(1)
    serve_cfg, _ = engine_config_from(args.config)
    with local_ray(args.num_cpus or serve_cfg.tensor_parallel_size + 1):
        result = asyncio.run(_bench(args))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("sync_")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
