"""One table of both engines: a ``tr-serve bench --json`` result and a ``scripts/peer_vllm.py`` result.

    python3 scripts/merge_bench_tables.py bench_out/bench.json bench_out/peer_vllm.json

Every row's tokens/s is set against tr_serve's ``baseline`` (plain greedy decoding through the
engine) and against the row's own plain run (its ``speedup``); ``identical`` is each row's own
check (tr_serve's methods against ``baseline``, ``vllm-ngram`` against ``vllm-plain``). The two
runs are compared first: other questions, other ``max_new_tokens`` or another dtype print a
WARNING line (``--strict`` makes them an error, exit 2), and vLLM's plain run is compared with
tr_serve's baseline on the new tokens per question (their token ids are not in tr_serve's JSON).
Standard library only: runs under any python.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence


def _fmt(v, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{suffix}"


def _identical(m: dict) -> str:
    if m.get("identical") is None:
        return "n/a"
    return ("yes" if m["identical"] else "NO") + (f" (vs {m['identical_to']})" if m.get("identical_to") else "")


def _engine(result: dict, m: dict) -> str:
    if m.get("engine"):
        return m["engine"]
    return "transformers" if m.get("kind") == "hf" else "tr_serve"


def compare_runs(tr: dict, peer: dict) -> list[str]:
    """Why the two runs are not the same measurement (empty when they are)."""
    problems = []
    for key in ("question_ids", "warmup_question_ids", "max_new_tokens", "dtype", "device"):
        if tr.get(key) != peer.get(key):
            problems.append(f"{key} differ: tr_serve {tr.get(key)!r}, vLLM {peer.get(key)!r}")
    if tr.get("torch_threads") != peer.get("torch_threads"):
        problems.append(f"threads differ: tr_serve {tr.get('torch_threads')}, vLLM {peer.get('torch_threads')}")
    return problems


def same_lengths(tr: dict, peer: dict, tr_method: str = "baseline", peer_method: str = "vllm-plain") -> str | None:
    """Whether vLLM's plain run gave as many new tokens per question as tr_serve's baseline."""
    a = tr["methods"].get(tr_method)
    b = peer["methods"].get(peer_method)
    if not a or not b or "per_question" not in a or "per_question" not in b:
        return None
    la = {q["question_id"]: q["new_tokens"] for q in a["per_question"]}
    lb = {q["question_id"]: q["new_tokens"] for q in b["per_question"]}
    if la.keys() != lb.keys():
        return f"{peer_method} and tr_serve {tr_method} ran other questions"
    diff = [qid for qid in la if la[qid] != lb[qid]]
    total = f"{sum(lb.values())} vs {sum(la.values())} tokens"
    if not diff:
        return f"{peer_method} vs tr_serve {tr_method}: same new tokens on every question ({total})"
    shown = ", ".join(f"q{qid} {lb[qid]} vs {la[qid]}" for qid in diff[:8])
    return f"{peer_method} vs tr_serve {tr_method}: new tokens differ on {len(diff)} question(s) ({total}): {shown}"


def merged_table(tr: dict, peer: dict) -> str:
    base = tr["methods"].get("baseline")
    base_tps = base["tokens_per_s"] if base else None
    rows = ["| engine | method | MAT | tokens/s | vs tr_serve baseline | speedup over own plain | over | identical |",
            "| --- | --- | ---: | ---: | ---: | ---: | --- | :---: |"]
    for result in (tr, peer):
        for name, m in result["methods"].items():
            vs = m["tokens_per_s"] / base_tps if base_tps else None
            rows.append(f"| {_engine(result, m)} | {name} | {_fmt(m.get('mat'))} | {_fmt(m.get('tokens_per_s'))} "
                        f"| {_fmt(vs, suffix='x')} | {_fmt(m.get('speedup'), suffix='x')} | {m.get('reference')} "
                        f"| {_identical(m)} |")
    return "\n".join(rows)


def provenance_lines(tr: dict, peer: dict) -> list[str]:
    return [
        f"Spec-Bench: {tr.get('model')} on {tr.get('device')}, {tr.get('dtype')}, {tr.get('questions')} questions "
        f"({tr.get('per_category')} per category), max_new_tokens={tr.get('max_new_tokens')}",
        f"tr_serve: torch {tr.get('torch')}, transformers {tr.get('transformers')}, {tr.get('torch_threads')} threads, "
        f"cpu_kernels {tr.get('cpu_kernels')}",
        f"vLLM: {peer.get('vllm_distribution') or 'vllm ' + str(peer.get('vllm'))}, torch {peer.get('torch')}, "
        f"transformers {peer.get('transformers')}, {peer.get('torch_threads')} threads "
        f"(VLLM_CPU_OMP_THREADS_BIND={(peer.get('vllm_env') or {}).get('VLLM_CPU_OMP_THREADS_BIND')}), "
        f"{peer.get('date')}; prompts {peer.get('prompt_check')}",
    ]


def spec_line(peer: dict) -> str | None:
    m = peer["methods"].get("vllm-ngram") or {}
    spec = m.get("spec_decode")
    if not spec:
        return None
    return (f"vllm-ngram ({json.dumps(m.get('speculative_config'))}): {spec['drafts']} drafts over "
            f"{m.get('verification_forwards')} verification forwards, {spec['draft_tokens']} tokens drafted, "
            f"{spec['accepted_draft_tokens']} accepted (per position {spec.get('accepted_per_position')})")


def render(tr: dict, peer: dict) -> tuple[str, list[str]]:
    problems = compare_runs(tr, peer)
    parts = provenance_lines(tr, peer)
    parts += [f"WARNING: {p}" for p in problems]
    parts += ["", merged_table(tr, peer), ""]
    for line in (same_lengths(tr, peer), spec_line(peer)):
        if line:
            parts.append(line)
    for result in (tr, peer):
        for name, m in result["methods"].items():
            for mm in m.get("mismatches", []):
                parts.append(f"NOT IDENTICAL {name}: question {mm['question_id']} ({mm['category']}) differs from "
                             f"{m.get('identical_to')} at token {mm.get('position')}")
    return "\n".join(parts).rstrip(), problems


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="merge_bench_tables.py", description=__doc__.splitlines()[0])
    p.add_argument("tr_json", help="a tr-serve bench --json result")
    p.add_argument("peer_json", help="a scripts/peer_vllm.py result")
    p.add_argument("--strict", action="store_true",
                   help="exit 2 when the runs differ in questions, max_new_tokens, dtype, device or threads")
    args = p.parse_args(argv)
    try:
        tr = json.loads(Path(args.tr_json).read_text())
        peer = json.loads(Path(args.peer_json).read_text())
        if "methods" not in tr or "methods" not in peer:
            raise ValueError("both files must be benchmark JSONs with 'methods'")
    except (OSError, ValueError) as e:
        print(f"merge_bench_tables.py: error: {e}", file=sys.stderr)
        return 2
    text, problems = render(tr, peer)
    print(text)
    if problems and args.strict:
        print("merge_bench_tables.py: error: the runs are not the same measurement (see WARNING)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
