"""The scheduler alone (no model, no torch): admission, prefill chunks under the step's token budget, row order,
retirement and abort."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tr_serve.engine.request import FinishReason, Request
from tr_serve.engine.scheduler import Scheduler
from tr_serve.sampling_params import SamplingParams


def request(request_id: str, prompt_len: int = 4) -> Request:
    return Request(request_id, list(range(1, prompt_len + 1)), SamplingParams(), detokenizer=None)


@pytest.mark.parametrize("name", ["scheduler.py", "prefix_cache.py"])
def test_the_scheduler_imports_no_torch(name):
    source = Path(__file__).resolve().parents[2] / "tr_serve" / "engine" / name
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert "torch" not in imported


def test_admission_in_arrival_order_to_the_lowest_free_rows():
    s = Scheduler(num_rows=2, max_num_batched_tokens=100)
    for i in range(3):
        s.add(request(f"r{i}"))
    admitted = s.admit()
    assert [(r.request_id, r.row) for r, _ in admitted] == [("r0", 0), ("r1", 1)]
    assert [r.request_id for r in s.waiting] == ["r2"] and s.free_rows == []
    assert s.load().as_dict() == {"running": 0, "prefilling": 2, "waiting": 1, "kv_rows_used": 2, "kv_rows": 2,
                                  "prefix_cache_queries": 8, "prefix_cache_hits": 0}


def test_duplicate_request_id_is_refused():
    s = Scheduler(num_rows=1, max_num_batched_tokens=8)
    s.add(request("a"))
    with pytest.raises(ValueError, match="already in use"):
        s.add(request("a"))


def test_prefill_chunks_fill_the_token_budget_in_order():
    s = Scheduler(num_rows=3, max_num_batched_tokens=10)
    for rid, n in (("a", 6), ("b", 7), ("c", 3)):
        s.add(request(rid, n))
    s.admit()
    chunks = s.prefill_chunks()
    assert [(c.request.request_id, len(c.tokens)) for c in chunks] == [("a", 6), ("b", 4)]  # c waits for budget
    chunks[1].request.num_prefilled = 4
    assert chunks[1].tokens == [1, 2, 3, 4]


def test_a_half_prefilled_request_on_a_high_row_runs_in_row_order():
    """The budget goes in admission order; the forward gets the chunks in row order (the runner's
    segment layout needs ascending rows)."""
    s = Scheduler(num_rows=3, max_num_batched_tokens=16)
    for rid, n in (("a", 4), ("b", 4), ("c", 12)):
        s.add(request(rid, n))
    s.admit()  # a: row 0, b: row 1, c: row 2
    for c in s.prefill_chunks():
        c.request.num_prefilled += len(c.tokens)  # c: 8 of 12
    for rid in ("a", "b"):
        s.start_decoding(next(r for r in s.prefilling if r.request_id == rid))
    s.retire([r for r in s.running])  # rows 0 and 1 free again
    s.add(request("d", 3))
    s.admit()  # d: row 0, admitted after c
    chunks = s.prefill_chunks()
    assert [(c.request.request_id, c.request.row, len(c.tokens)) for c in chunks] == [("d", 0, 3), ("c", 2, 4)]


def test_decode_runs_in_row_order_and_prompts_take_what_the_budget_leaves():
    s = Scheduler(num_rows=4, max_num_batched_tokens=10)
    for rid, n in (("a", 4), ("b", 30), ("c", 4)):
        s.add(request(rid, n))
    s.admit()
    for c in s.prefill_chunks():
        c.request.num_prefilled += len(c.tokens)  # a and c complete, b 2 of 30
    for rid in ("c", "a"):  # done out of row order
        s.start_decoding(next(r for r in s.prefilling if r.request_id == rid))
    assert s.prefilling[0].request_id == "b" and [r.request_id for r in s.running] == ["c", "a"]
    assert [r.row for r in s.decode_batch()] == [0, 2]
    assert [len(c.tokens) for c in s.prefill_chunks(decode_tokens=3)] == [7]  # the budget's rest
    assert [len(c.tokens) for c in s.prefill_chunks(decode_tokens=12)] == [1]  # trees fill it: still progress
    assert [s.prefill_budget(n) for n in (0, 3, 9, 10, 40)] == [10, 7, 1, 1, 1]
    mixed = Scheduler(num_rows=1, max_num_batched_tokens=10, mixed_prefill_tokens=4)
    assert [mixed.prefill_budget(n) for n in (0, 3, 7, 9, 40)] == [10, 4, 3, 1, 4]


def test_retire_frees_rows_sorted_and_abort():
    s = Scheduler(num_rows=3, max_num_batched_tokens=100)
    reqs = [request(f"r{i}") for i in range(4)]
    for r in reqs:
        s.add(r)
    s.admit()
    for r in reqs[:3]:
        s.start_decoding(r)
    s.abort("r3")  # waiting: gone at once
    assert reqs[3].finish_reason is FinishReason.ABORT and not s.waiting
    s.abort("r1")  # holds a row: retired at the next step
    assert s.finished_in_rows() == [reqs[1]]
    reqs[2].finish_reason = FinishReason.STOP
    assert s.retire([reqs[2], reqs[1]]) == [2, 1]
    assert s.free_rows == [1, 2] and [r.request_id for r in s.running] == ["r0"]
    s.abort("r1")  # unknown now: ignored
    s.add(request("r1"))  # the id is free again
    assert s.has_unfinished()
