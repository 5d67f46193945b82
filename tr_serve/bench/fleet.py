"""``tr-serve bench-fleet``: does a replica that adopts the fleet's matrix and suffix corpus start hot?

On a local Ray instance, with a real matrix actor (its own namespace and a temporary snapshot
folder, both removed at the end):

1. **warm**: replica A (an ``AsyncEngine`` + ``MatrixSync`` pushing every ``--sync-interval-s``)
   answers the warm half of the questions; its last rows and documents are pushed when it stops.
2. **adopt**: a fresh replica B adopts the actor's matrix snapshot and, where the tree has a suffix
   index (``auto``, the default), indexes the fleet's suffix corpus (A's warm questions' prompts
   and answers: never a measured question's), between steps, as in serving.
3. **measure**, on the other half (questions neither replica saw), each question in turn on four
   fresh engines, one after the other (in turn first): plain greedy decoding (``tree="none"``), a **cold**
   replica (the model's matrix prior, an empty suffix index), the **fleet-warm** replica B (its
   sync keeps running), and a **local-warm** replica (a copy of A's own matrix and A's documents:
   what A itself would do next). Each replica's own suffix index also takes the measured questions
   it has answered, as in serving: the cold one's as much as the warm ones'. One engine steps at a
   time because ``auto``'s budget prices each step at the latency it measures: four engines
   stepping at once on a few cores would each slow the others and verify fewer nodes, by chance.

Questions: ``2 x --per-category`` per category (Spec-Bench JSONL), alternately warm / measured.

MAT = accepted tokens per verification step (``RequestStats.accepted_per_step``), summed over
the measured questions. ``identical``: cold, fleet-warm and local-warm outputs all equal plain
greedy decoding token for token. Sync overhead on the token path = seconds spent between steps
in ``MatrixSync`` (taking dirty rows, adopting a snapshot) / seconds in ``Engine.step`` of the
same replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

from tr_serve.bench.config import resolve_device
from tr_serve.bench.local_ray import local_ray
from tr_serve.bench.questions import DEFAULT_QUESTIONS, encode_questions, split_questions
from tr_serve.bench.records import BenchError, Question, read_questions, round_floats
from tr_serve.cli_args import add_command, positive_float, positive_int, quiet_transformers, run_standalone
from tr_serve.engine.config import DEFAULT_MODEL

DEFAULT_JSON = os.path.join("bench_out", "bench_fleet.json")
# fleet-warm over cold: 1.05 for the matrix alone, 1.15 with the suffix corpus too (trees with a suffix index)
TARGETS = {"fleet_over_cold": 1.05, "fleet_over_cold_suffix": 1.15, "token_path_overhead": 0.01, "adopt_ms": 20.0}


class StepClock:
    """Seconds spent in ``Engine.step`` (wraps the instance's method)."""

    def __init__(self, engine):
        self.seconds = 0.0
        self.steps = 0
        inner = engine.step

        def timed():
            t0 = time.perf_counter()
            try:
                return inner()
            finally:
                self.seconds += time.perf_counter() - t0
                self.steps += 1

        engine.step = timed


class SuffixHits:
    """How often a replica's suffix index found another text's continuation for a drafted row
    (wraps the index instance's ``lookup``): what the fleet's corpus adds to drafting, whatever the
    budget then verifies of it."""

    def __init__(self, index):
        self.lookups = 0
        self.found = 0
        self.tokens = 0
        inner = index.lookup

        def counted(doc: int, max_tokens: int):
            draft = inner(doc, max_tokens)
            self.lookups += 1
            if draft is not None:
                self.found += 1
                self.tokens += len(draft.tokens)
            return draft

        index.lookup = counted

    def figures(self) -> dict[str, Any]:
        return {"lookups": self.lookups, "found": self.found, "hit_rate": self.found / max(1, self.lookups),
                "tokens_offered": self.tokens}


async def generate_one(engine, prompt_ids: list[int], max_new_tokens: int, request_id: str):
    """Greedy answer of one prompt through an ``AsyncEngine``: its last (finished) ``RequestOutput``."""
    from tr_serve.sampling_params import SamplingParams

    last = None
    async for out in engine.generate(list(prompt_ids), SamplingParams(max_tokens=max_new_tokens), request_id):
        last = out
    return last


def outputs_mat(outs) -> float:
    """MAT over several answers: accepted tokens / verification steps, summed (1.0 with no step)."""
    steps = sum(len(o.stats.accepted_per_step) for o in outs)
    return sum(sum(o.stats.accepted_per_step) for o in outs) / steps if steps else 1.0


async def _bench(args, loaded, warm: list[Question], measure: list[Question], snapshot_dir: str, namespace: str,
                 progress: bool) -> dict[str, Any]:
    from tr_serve.engine.async_engine import AsyncEngine
    from tr_serve.engine.config import EngineConfig
    from tr_serve.engine.engine import Engine
    from tr_serve.fleet import FleetSyncConfig
    from tr_serve.fleet.actor import get_actor
    from tr_serve.fleet.corpus import DocumentBatch
    from tr_serve.fleet.suffix_share import CorpusImport
    from tr_serve.fleet.sync import MatrixSync

    def log(msg: str) -> None:
        if progress:
            print(f"[bench-fleet] {msg}", file=sys.stderr, flush=True)

    longest = max(len(q.prompt_ids) for q in warm + measure)
    max_model_len = max(2048, longest + args.max_new_tokens + 1)
    device = str(next(loaded.model.parameters()).device)

    def engine(tree: str) -> tuple[Any, StepClock]:
        core = Engine(loaded, EngineConfig(model=args.model, tree=tree, k=args.k, max_num_seqs=1,
                                           max_model_len=max_model_len, device=device))
        return AsyncEngine(core), StepClock(core)

    cfg = FleetSyncConfig(enabled=True, namespace=namespace, snapshot_dir=snapshot_dir,
                          sync_interval_s=args.sync_interval_s, snapshot_interval_s=60.0)
    (a, clock_a), (b, clock_b) = engine(args.tree), engine(args.tree)
    (cold, _), (local, _), (plain, _) = engine(args.tree), engine(args.tree), engine("none")
    engines = (a, b, cold, local, plain)
    try:
        # 1. warm replica A on the warm half, syncing in the background
        sync_a = MatrixSync(a, cfg, model_id=loaded.model_id, tokenizer=loaded.tokenizer, replica_id="A")
        sync_a.start()
        t0 = time.perf_counter()
        warm_outs = []
        for i, q in enumerate(warm):
            log(f"warm {i + 1}/{len(warm)} q{q.question_id} ({q.category})")
            warm_outs.append(await generate_one(a, q.prompt_ids, args.max_new_tokens, f"warm-{i}"))
        warm_s = time.perf_counter() - t0
        flushed = await sync_a.flush()  # the rows of the last questions (connects if it had not yet)
        if flushed["error"] is not None:
            raise BenchError(f"replica A could not push to the matrix actor: {flushed['error']}")
        await sync_a.stop(final_push=False)
        actor = get_actor(loaded.model_id, cfg.namespace)
        info = await actor.info.remote()
        local.matrix.adopt(a.matrix.table)  # reference: A's own matrix and documents

        def take_a_documents(engine):
            return engine.suffix.export_documents(0)[0] if engine.suffix is not None else []

        a_docs = await a.call_between_steps(take_a_documents)
        if a_docs:
            job = CorpusImport(DocumentBatch.from_shared("A", a_docs))
            await local.call_between_steps(lambda engine: job.run(engine.suffix, 1 << 62))

        # 2. a fresh replica B adopts the fleet snapshot (between steps)
        sync_b = MatrixSync(b, cfg, model_id=loaded.model_id, tokenizer=loaded.tokenizer, replica_id="B")
        t0 = time.perf_counter()
        first = await sync_b.sync_once()
        adopt_round_trip_ms = (time.perf_counter() - t0) * 1e3
        if first["error"] is not None or not sync_b.adopt_s:
            raise BenchError(f"replica B could not adopt the fleet snapshot: {first}")
        log(f"B adopted version {sync_b.adopted_version} in {sync_b.adopt_s[0] * 1e3:.2f} ms between steps "
            f"({adopt_round_trip_ms:.1f} ms with the poll and fetch)")
        suffix = b.engine.suffix is not None
        if suffix and not first["imported"]:
            raise BenchError(f"replica B indexed no document of the fleet's suffix corpus: {first}")
        import_ms = [t * 1e3 for t in sync_b.import_s]
        b_index = b.engine.suffix
        b_suffix = {"documents": b_index.num_documents(), "tokens": b_index.num_tokens} if suffix else {}
        if suffix:
            log(f"B indexed {first['imported']} fleet documents ({b_suffix['tokens']} tokens) in {len(import_ms)} "
                f"between-steps chunks, {sum(import_ms):.1f} ms in all")
        sync_b.start()

        # 3. measure on the unseen half: question by question, the four engines one at a time
        names = ("plain", "cold", "fleet_warm", "local_warm")
        runs: dict[str, list] = {n: [] for n in names}
        by_name = dict(zip(names, (plain, cold, b, local)))
        hits = {n: SuffixHits(by_name[n].engine.suffix) for n in WARMED if by_name[n].engine.suffix is not None}
        clock_b.seconds, clock_b.steps = 0.0, 0  # B's step time from here on (its sync runs meanwhile)
        token_path_b0, calls_b0 = sync_b.token_path_s, sync_b.token_path_calls
        t0 = time.perf_counter()
        for i, q in enumerate(measure):
            log(f"measure {i + 1}/{len(measure)} q{q.question_id} ({q.category})")
            order = names[i % len(names):] + names[: i % len(names)]  # no replica always runs first or last
            for n in order:
                runs[n].append(await generate_one(by_name[n], q.prompt_ids, args.max_new_tokens, f"{n}-{i}"))
        measure_s = time.perf_counter() - t0
        await sync_b.stop(final_push=False)
    finally:
        for e in engines:
            e.shutdown()

    sync = _sync_figures(args, sync_a, sync_b, clock_a, clock_b, token_path_b0, calls_b0, info, adopt_round_trip_ms,
                         warm_rows=int(a.matrix.num_filled_rows()))
    suffix_figures = None
    if suffix:
        suffix_figures = {
            "fleet_documents": info["corpus_documents"], "fleet_tokens": info["corpus_tokens"],
            "documents_imported": first["imported"], "fleet_replica_documents_before_measuring": b_suffix["documents"],
            "fleet_replica_tokens_before_measuring": b_suffix["tokens"], "import_chunks": len(import_ms),
            "import_ms_total": sum(import_ms), "import_ms_max": max(import_ms) if import_ms else 0.0,
            "warm_question_documents": len(a_docs),
            "lookups_while_measured": {n: h.figures() for n, h in hits.items()},
        }
    return {**_mat_figures(runs, sync, suffix_figures), "warm_seconds": warm_s, "measure_seconds": measure_s,
            "warm_mat": outputs_mat(warm_outs), "per_question": _per_question(runs, measure)}


WARMED = ("cold", "fleet_warm", "local_warm")  # the replicas compared with plain decoding


def _sync_figures(args, sync_a, sync_b, clock_a: StepClock, clock_b: StepClock, token_path_b0: float, calls_b0: int,
                  info: dict, adopt_round_trip_ms: float, warm_rows: int) -> dict[str, Any]:
    """The ``sync`` entry: time the sync took on the token path against step time (warm replica A
    over the whole run, fleet replica B while measured), adoption times, pushes, the actor's state."""
    b_token_path = sync_b.token_path_s - token_path_b0
    return {
        "sync_interval_s": args.sync_interval_s,
        "token_path_overhead": (sync_a.token_path_s + b_token_path) / max(1e-12, clock_a.seconds + clock_b.seconds),
        "token_path_overhead_warm_replica": sync_a.token_path_s / clock_a.seconds if clock_a.seconds else 0.0,
        "token_path_overhead_fleet_replica": b_token_path / clock_b.seconds if clock_b.seconds else 0.0,
        "token_path_ms": {"warm_replica": sync_a.token_path_s * 1e3, "fleet_replica": b_token_path * 1e3},
        "token_path_calls": {"warm_replica": sync_a.token_path_calls,
                             "fleet_replica": sync_b.token_path_calls - calls_b0},
        "step_s": {"warm_replica": clock_a.seconds, "fleet_replica": clock_b.seconds},
        "steps": {"warm_replica": clock_a.steps, "fleet_replica": clock_b.steps},
        "mean_step_ms": {"warm_replica": 1e3 * clock_a.seconds / max(1, clock_a.steps),
                         "fleet_replica": 1e3 * clock_b.seconds / max(1, clock_b.steps)},
        "adopt_ms": sync_b.adopt_s[0] * 1e3,
        "adopt_ms_max": max(sync_b.adopt_s) * 1e3,
        "adoptions": len(sync_b.adopt_s),
        "adopt_round_trip_ms": adopt_round_trip_ms,
        "pushes": sync_a.pushes + sync_b.pushes,
        "rows_pushed_warm_replica": sync_a.rows_pushed,
        "actor_version_after_warm": info["version"],
        "fleet_rows": info["filled_rows"],
        "warm_replica_rows": warm_rows,
        "sync_errors": sync_a.errors + sync_b.errors,
    }


def _same_as_plain(runs: dict[str, list]) -> dict[str, list[bool]]:
    """Per warmed replica, per measured question: its tokens equal plain decoding's."""
    base = [o.token_ids for o in runs["plain"]]
    return {n: [o.token_ids == t for o, t in zip(runs[n], base)] for n in WARMED}


def _mat_figures(runs: dict[str, list], sync: dict[str, Any], suffix: dict[str, Any] | None = None) -> dict[str, Any]:
    """MAT per replica, ``identical``, fleet-warm over cold, and the targets they are held to
    (``suffix``: the suffix corpus's figures where the tree has a suffix index, which raises the bar)."""
    identical = all(all(same) for same in _same_as_plain(runs).values())
    mats = {n: outputs_mat(runs[n]) for n in WARMED}
    fleet_over_cold = mats["fleet_warm"] / mats["cold"] if mats["cold"] else float("nan")
    target = TARGETS["fleet_over_cold_suffix" if suffix is not None else "fleet_over_cold"]
    return {
        "cold_mat": mats["cold"],
        "fleet_warm_mat": mats["fleet_warm"],
        "local_warm_mat": mats["local_warm"],
        "identical": identical,
        "fleet_over_cold": fleet_over_cold,
        "suffix_index": suffix,
        "sync": sync,
        "targets": {
            "fleet_over_cold_min": target,
            "token_path_overhead_max": TARGETS["token_path_overhead"],
            "adopt_ms_max": TARGETS["adopt_ms"],
            "met": bool(identical and fleet_over_cold >= target
                        and sync["token_path_overhead"] < TARGETS["token_path_overhead"]
                        and sync["adopt_ms_max"] < TARGETS["adopt_ms"]),
        },
    }


def _per_question(runs: dict[str, list], measure: list[Question]) -> list[dict[str, Any]]:
    same = _same_as_plain(runs)
    return [{"question_id": q.question_id, "category": q.category, "new_tokens": len(runs["plain"][i].token_ids),
             **{f"{n}_mat": runs[n][i].stats.mat for n in WARMED},
             "identical": all(same[n][i] for n in WARMED)}
            for i, q in enumerate(measure)]


def run_bench_fleet(args: argparse.Namespace, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark and write ``args.json_out``; returns the result."""
    if not str(args.json_out).endswith(".json"):
        raise BenchError(f"--json must name a .json file, got {args.json_out!r}")
    if args.sync_interval_s <= 0:
        raise BenchError(f"--sync-interval-s must be > 0, got {args.sync_interval_s}")
    from tr_serve.tr.tree_spec import validate_tree_spec

    try:
        parsed = validate_tree_spec(args.tree, args.k)
    except ValueError as e:  # TreeTemplateError included
        raise BenchError(str(e)) from None
    if not parsed.uses_matrix:
        raise BenchError("--tree must be a Token Recycling tree, which drafts from the matrix (plain decoding "
                         "is measured anyway)")
    warm, measure = split_questions(read_questions(args.questions), args.per_category)
    device = resolve_device(args.device)

    import torch

    from tr_serve.model_loader import load_model

    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    try:
        loaded = load_model(args.model, device=device, dtype=args.dtype)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot load model {args.model!r}: {e}".splitlines()[0]) from None
    encode_questions(loaded.tokenizer, warm + measure)
    max_pos = getattr(loaded.model.config, "max_position_embeddings", None) or 1 << 30
    if max(len(q.prompt_ids) for q in warm + measure) + args.max_new_tokens + 1 > max_pos:
        raise BenchError(f"a prompt plus --max-new-tokens {args.max_new_tokens} exceeds the model's context")

    own_dir = args.snapshot_dir is None
    snapshot_dir = tempfile.mkdtemp(prefix="tr-bench-fleet-") if own_dir else args.snapshot_dir
    namespace = f"bench-{uuid.uuid4().hex[:8]}"  # its own fleet: never adopts or feeds a real one
    t0 = time.perf_counter()
    try:
        with local_ray(max(1, min(2, os.cpu_count() or 1))):
            try:
                result = asyncio.run(_bench(args, loaded, warm, measure, snapshot_dir, namespace, progress))
            finally:
                try:
                    from tr_serve.fleet.actor import stop_matrix_actor

                    stop_matrix_actor(loaded.model_id, namespace, timeout_s=10)
                except Exception:
                    pass
    finally:
        if own_dir:
            shutil.rmtree(snapshot_dir, ignore_errors=True)
    result = {
        **result,
        "model": args.model,
        "tree": args.tree,
        "k": args.k,
        "device": device,
        "max_new_tokens": args.max_new_tokens,
        "per_category": args.per_category,
        "warm_question_ids": [q.question_id for q in warm],
        "measured_question_ids": [q.question_id for q in measure],
        "wall_seconds": time.perf_counter() - t0,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "definitions": {
            "mat": "sum of accepted tokens per verification step / verification steps, over the measured "
                   "questions (RequestStats.accepted_per_step; the prefill's first token excluded)",
            "identical": "cold, fleet-warm and local-warm outputs all equal plain greedy decoding token for token",
            "token_path_overhead": "seconds MatrixSync spent between engine steps (dirty-row take + snapshot "
                                   "adoption) / seconds in Engine.step, warm replica + fleet replica",
            "adopt_ms": "between-steps part of the fleet replica's first adoption (copy + own rows reapplied)",
            "suffix_index": "where the tree has a suffix index: the fleet's corpus after the warm half (A's "
                            "documents: the warm questions' prompts and answers) and what replica B indexed of it "
                            "before the measured half, in between-steps chunks; lookups_while_measured: per "
                            "replica, the suffix index's lookups for drafted rows and how many found a continuation",
        },
    }
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(round_floats(result), indent=2) + "\n")
    return result


def format_result(r: dict) -> str:
    s = r["sync"]
    ok = lambda cond: "ok" if cond else "MISSED"  # noqa: E731
    target = r["targets"]["fleet_over_cold_min"]
    warm = "matrix + suffix corpus" if r.get("suffix_index") else "matrix"
    lines = [
        f"bench-fleet: {r['model']}, tree {r['tree']}, k={r['k']}, {len(r['measured_question_ids'])} measured / "
        f"{len(r['warm_question_ids'])} warm questions, {r['max_new_tokens']} new tokens, {r['device']}",
        "",
        "| replica | MAT |",
        "| --- | ---: |",
        f"| cold (fresh replica, nothing from the fleet) | {r['cold_mat']:.3f} |",
        f"| fleet-warm (adopted the fleet's {warm}) | {r['fleet_warm_mat']:.3f} |",
        f"| local-warm (copy of the warm replica's {warm}) | {r['local_warm_mat']:.3f} |",
        "",
        f"fleet-warm / cold:          {r['fleet_over_cold']:.3f}  (target >= {target:.2f}: "
        f"{ok(r['fleet_over_cold'] >= target)})",
        f"identical to plain greedy:  {'yes' if r['identical'] else 'NO'}",
        f"token-path sync overhead:   {100 * s['token_path_overhead']:.4f}% of step time "
        f"(warm replica {100 * s['token_path_overhead_warm_replica']:.4f}%, fleet replica "
        f"{100 * s['token_path_overhead_fleet_replica']:.4f}%; target < 1%: "
        f"{ok(s['token_path_overhead'] < TARGETS['token_path_overhead'])})",
        f"snapshot adoption:          {s['adopt_ms']:.3f} ms between steps, max {s['adopt_ms_max']:.3f} ms over "
        f"{s['adoptions']} adoptions (target < 20 ms: {ok(s['adopt_ms_max'] < TARGETS['adopt_ms'])}); "
        f"{s['adopt_round_trip_ms']:.1f} ms with poll + fetch (off the token path)",
        f"mean step:                  warm replica {s['mean_step_ms']['warm_replica']:.1f} ms, fleet replica "
        f"{s['mean_step_ms']['fleet_replica']:.1f} ms",
        f"fleet:                      version {s['actor_version_after_warm']} after warm-up, {s['fleet_rows']} rows, "
        f"{s['pushes']} pushes, {s['sync_errors']} sync errors",
    ]
    x = r.get("suffix_index")
    if x:
        lines.append(f"suffix corpus:              {x['fleet_documents']} documents, {x['fleet_tokens']} tokens after "
                     f"warm-up; the fleet replica indexed {x['documents_imported']} in {x['import_chunks']} "
                     f"between-steps chunks ({x['import_ms_total']:.1f} ms in all, max {x['import_ms_max']:.2f} ms)")
        rates = ", ".join(f"{n} {100 * h['hit_rate']:.1f}%" for n, h in x["lookups_while_measured"].items())
        lines.append(f"suffix lookups that found a continuation while measured: {rates}")
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--questions", default=DEFAULT_QUESTIONS, metavar="PATH",
                   help=f"Spec-Bench JSONL (default: {DEFAULT_QUESTIONS})")
    p.add_argument("--json", dest="json_out", default=DEFAULT_JSON, metavar="OUT",
                   help=f"result JSON (default: {DEFAULT_JSON})")
    p.add_argument("--per-category", type=positive_int, default=1, metavar="N",
                   help="N warm and N measured questions per category (default: 1)")
    p.add_argument("--max-new-tokens", type=positive_int, default=48, metavar="N", help="default: 48")
    p.add_argument("--tree", default="auto", metavar="NAME|PATH",
                   help="Token Recycling tree (default: auto, whose suffix index the fleet shares too; a template "
                        "such as 2.2.2 shares the matrix only)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    p.add_argument("--k", type=positive_int, default=8, help="candidates per matrix row (default: 8)")
    p.add_argument("--sync-interval-s", type=positive_float, default=2.0, metavar="S",
                   help="replica push/poll period (default: 2.0, the serving default)")
    p.add_argument("--snapshot-dir", default=None, metavar="DIR",
                   help="actor snapshot root (default: a temporary folder, removed at the end)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    p.add_argument("--cpu-threads", type=positive_int, default=None, metavar="N", help="torch.set_num_threads")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``tr-serve bench-fleet``: register on the CLI's subparsers (sets ``func=run``)."""
    return add_command(subparsers, "bench-fleet", help="fleet hot start: cold vs fleet-warm vs local-warm MAT",
                       description=__doc__.splitlines()[0], add_arguments=add_arguments, run=run)


def run(args: argparse.Namespace, prog: str = "tr-serve bench-fleet") -> int:
    quiet_transformers()
    try:
        result = run_bench_fleet(args)
    except BenchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(format_result(result))
    print(f"\nwrote {args.json_out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_standalone("tr-serve bench-fleet", __doc__.splitlines()[0], add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
