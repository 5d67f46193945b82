"""The fleet shares the suffix index: a replica's finished documents reach the actor with its rows,
other replicas index them (between steps, within their capacity, each document once, never their
own), tenants stay apart on every replica, and the actor keeps the corpus on disk. The real
``MatrixActor`` runs in-process behind a stand-in for its handle (tests/fleet/local_actor.py); the
replicas are plain engines (``tree="auto"``, which has a suffix index) of a tiny random-weight model."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from local_actor import LocalActor
from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.fleet import FleetSyncConfig
from tr_serve.fleet import actor as fleet_actor
from tr_serve.fleet import sync as fleet_sync
from tr_serve.fleet.actor import MatrixActor
from tr_serve.fleet.corpus import DocumentBatch
from tr_serve.fleet.corpus_file import PREFIX as CORPUS_PREFIX
from tr_serve.fleet.snapshot import snapshot_files
from tr_serve.fleet.sync import MatrixSync
from tr_serve.sampling_params import SamplingParams

V = 512
# prompts of disjoint token ranges: no 3-gram of one occurs in another
P = [5, 17, 230, 402, 9, 33, 71, 12]
Q = [100, 101, 150, 160, 170, 180, 190, 199]
R = [300, 301, 350, 360, 370, 380, 390, 399]


@pytest.fixture
def fleet(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(fleet_actor, "atexit", SimpleNamespace(register=lambda *a, **kw: None))
    loaded = tiny_loaded(tokenizer, seed=3, vocab_size=V)
    cfg = FleetSyncConfig(enabled=True, namespace="unit", snapshot_dir=str(tmp_path), snapshot_interval_s=3600)
    made = {}

    def replica(name: str, actor: LocalActor | None = None, **engine_kw) -> tuple[Engine, MatrixSync]:
        config = dict(model="tiny", tree="auto", max_num_seqs=2, max_model_len=128)
        engine = Engine(loaded, EngineConfig(**{**config, **engine_kw}))
        sync = MatrixSync(engine, cfg, model_id="tiny", fingerprint="fp", replica_id=name)
        if "actor" not in made:
            made["actor"] = LocalActor(sync.spec)
        sync._actor = made["actor"]
        return engine, sync

    def plain(prompt: list[int], n: int = 30) -> list[int]:
        engine = Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128))
        return serve(engine, prompt, n).token_ids

    return SimpleNamespace(replica=replica, plain=plain, cfg=cfg, made=made, tmp_path=tmp_path)


def serve(engine: Engine, prompt: list[int], n: int = 30, namespace: str = "default"):
    request = engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), namespace=namespace)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == request:
                return out
    raise AssertionError("the request did not finish")


def run(coro):
    return asyncio.run(coro)


def test_finished_documents_reach_another_replica_within_their_tenant_and_draft_there(fleet):
    ea, sa = fleet.replica("A")
    eb, sb = fleet.replica("B")
    actor = fleet.made["actor"]
    out_p = serve(ea, P, namespace="tenant-a")
    serve(ea, Q, namespace="tenant-b")
    r = run(sa.sync_once())
    assert r["error"] is None and r["imported"] is None  # nothing of others' to import
    corpus = actor.impl.corpus.batch()
    assert corpus.origins == ("A", "A") and corpus.namespaces == ("tenant-a", "tenant-b")
    assert corpus.tokens_of(0).tolist() == P + out_p.token_ids
    assert sa.suffix.documents_pushed == 2 and sa.suffix.imported_seq == 2  # only its own came in: no fetch
    assert actor.corpus_calls == 0

    r = run(sb.sync_once())  # a fresh replica indexes the fleet's documents
    # named tenants write no matrix row every tenant drafts from: no snapshot to adopt
    assert r["error"] is None and r["imported"] == 2 and r["adopted"] is None
    index = eb.suffix
    assert index.num_documents() == 2 and index.holds(("A", 0)) and index.holds(("A", 1))
    text = P + out_p.token_ids[:10]
    assert index.lookup_text(text, "tenant-a", 5).tokens == out_p.token_ids[10:15]
    assert index.lookup_text(text, "tenant-b", 5) is None  # another tenant's text never drafts
    assert index.lookup_text(text, "default", 5) is None

    # B's own requests: the same prompt drafts the fleet's answer in its tenant, losslessly
    want = fleet.plain(P)
    again = serve(eb, P, namespace="tenant-a")
    assert again.token_ids == want == out_p.token_ids
    assert again.stats.mat > out_p.stats.mat + 1.0, (again.stats.mat, out_p.stats.mat)
    other = serve(eb, P, namespace="tenant-c")
    assert other.token_ids == want and other.stats.mat < again.stats.mat
    # B pushes its two documents; A indexes them, B never re-indexes its own
    r = run(sb.sync_once())
    assert r["error"] is None and len(actor.impl.corpus) == 4
    r = run(sa.sync_once())
    assert r["imported"] == 2 and ea.suffix.num_documents() == 4
    assert len(ea.suffix.export_documents(0)[0]) == 2  # A exports only its own
    r = run(sb.sync_once())
    assert r["imported"] is None and eb.suffix.num_documents() == 4


def test_a_failed_push_is_taken_again_a_resent_document_counts_once_and_a_restarted_actor_gets_them_back(fleet):
    ea, sa = fleet.replica("A")
    actor = fleet.made["actor"]
    serve(ea, P)
    actor.fail = ConnectionError("actor gone")
    r = run(sa.sync_once())
    assert r["error"].startswith("actor_unreachable") and len(actor.impl.corpus) == 0
    actor.fail = None
    sa._actor = actor  # (the real sync re-resolves the actor by name)
    serve(ea, Q)
    r = run(sa.sync_once())
    assert r["error"] is None and len(actor.impl.corpus) == 2 and sa.suffix.documents_pushed == 2
    # the same documents again (a push whose reply was lost): held once
    docs = DocumentBatch.from_shared("A", ea.suffix.export_documents(0)[0])
    reply = run(actor.impl.push("A", 99, np.zeros(0, np.int64), np.zeros((0, 8), np.int32), docs))
    assert reply["documents_added"] == 0 and len(actor.impl.corpus) == 2
    # the actor restarts with an empty corpus (no disk snapshot yet): everything is sent again
    actor.impl = MatrixActor(actor.impl.spec)
    assert len(actor.impl.corpus) == 0
    run(sa.sync_once())  # sees the new epoch
    assert sa.restarts_seen == 1
    run(sa.sync_once())
    assert len(actor.impl.corpus) == 2 and actor.impl.corpus.batch().docs.tolist() == [0, 1]


def test_import_runs_in_bounded_chunks_between_steps_and_keeps_the_newest_that_fit(fleet, monkeypatch):
    monkeypatch.setattr(fleet_sync, "IMPORT_TOKENS_PER_STEP", 16)
    ea, sa = fleet.replica("A")
    eb, sb = fleet.replica("B", suffix_index_tokens=80)
    for prompt in (P, Q, R):  # 38 tokens each
        serve(ea, prompt)
    run(sa.sync_once())
    r = run(sb.sync_once())
    assert r["error"] is None and r["imported"] == 2  # 3 x 38 > 80: the two newest
    assert not eb.suffix.holds(("A", 0)) and eb.suffix.holds(("A", 1)) and eb.suffix.holds(("A", 2))
    assert eb.suffix.num_tokens == 76 and len(sb.import_s) == 5  # 76 tokens, 16 at a time
    assert sb.suffix.imported_seq == 3 and sb.stats()["documents_imported"] == 2
    r = run(sb.sync_once())  # nothing new: no fetch, no import
    assert r["imported"] is None and len(sb.import_s) == 5


def test_a_bad_corpus_object_is_refused_and_the_index_kept(fleet, caplog):
    ea, sa = fleet.replica("A")
    eb, sb = fleet.replica("B")
    actor = fleet.made["actor"]
    serve(ea, P)
    run(sa.sync_once())
    good = actor.impl.corpus.batch()
    for bad in (dataclasses.replace(good, tokens=np.full_like(good.tokens, V)), {"not": "a batch"}):
        actor.corpus_override = bad
        r = run(sb.sync_once())
        assert r["error"].startswith("bad_corpus") and eb.suffix.num_documents() == 0
    actor.corpus_override = None
    r = run(sb.sync_once())
    assert r["error"] is None and r["imported"] == 1


def test_replicas_without_a_suffix_index_or_with_sharing_off_send_and_take_no_documents(fleet, tokenizer):
    ea, sa = fleet.replica("A", tree="top8")
    assert ea.suffix is None
    serve(ea, P)
    r = run(sa.sync_once())
    assert r["error"] is None and not sa.suffix.active and len(fleet.made["actor"].impl.corpus) == 0
    loaded = tiny_loaded(tokenizer, seed=3, vocab_size=V)
    engine = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=128))
    off = MatrixSync(engine, fleet.cfg.model_copy(update={"suffix_index": False}), model_id="tiny", fingerprint="fp")
    assert off.suffix is None and off.stats()["suffix_shared"] is False


def test_the_actor_refuses_bad_documents_whole_and_keeps_its_corpus_on_disk(fleet, caplog):
    ea, sa = fleet.replica("A")
    actor = fleet.made["actor"].impl
    serve(ea, P, namespace="tenant-a")
    serve(ea, Q)
    docs = DocumentBatch.from_shared("A", ea.suffix.export_documents(0)[0])
    ids, rows = np.array([3]), np.arange(8, dtype=np.int32).reshape(1, 8)
    bad = dataclasses.replace(docs, tokens=np.where(np.arange(docs.tokens.size) == 0, V, docs.tokens).astype(np.int32))
    for payload in (bad, {"tokens": [1, 2]}):
        with pytest.raises(ValueError):
            run(actor.push("A", 1, ids, rows, payload))
    assert actor.version == 0 and len(actor.corpus) == 0  # refused whole: the rows were not merged either
    reply = run(actor.push("A", 1, ids, rows, docs))
    assert reply["documents_added"] == 2 and reply["corpus_seq"] == 2 and reply["corpus_seq_before"] == 0
    run(actor.save())
    files = snapshot_files(actor.folder, CORPUS_PREFIX)
    assert len(files) == 1 and actor.saved_corpus_seq == 2
    info = run(actor.info())
    assert (info["corpus_documents"], info["corpus_seq"], info["corpus_tokens"]) == (2, 2, docs.num_tokens)

    restarted = MatrixActor(actor.spec)  # same folder: it starts from the newest good snapshots
    assert restarted.corpus_loaded_from == str(files[0]) and restarted.corpus.last_seq == 2
    assert restarted.corpus.batch().namespaces == ("tenant-a", "default")
    # a newer corpus file that is corrupt is refused; the good one still loads
    corrupt = files[0].with_name(files[0].name.replace(CORPUS_PREFIX + "0", CORPUS_PREFIX + "9"))
    corrupt.write_bytes(b"\x00" * 40)
    again = MatrixActor(actor.spec)
    assert again.corpus_loaded_from == str(files[0]) and len(again.corpus) == 2
    assert any("refusing suffix corpus snapshot" in r.getMessage() for r in caplog.records)
    # the corpus setting bounds what a restarted actor holds
    # a capacity (per tenant) below the longest document's length: that one is dropped, none over it kept
    cap = int(max(docs.tokens_of(i).size for i in range(len(docs)))) - 1
    small = MatrixActor({**actor.spec, "suffix_index_tokens": cap})
    assert len(small.corpus) < len(docs) and small.corpus.num_tokens < docs.num_tokens
    assert all(small.corpus.namespace_tokens(ns) <= cap for ns in docs.namespaces)


# ---- lossless on the embedded model: a replica drafting from fleet-merged documents ---------------

NEW_TOKENS = 32


def test_a_replica_drafting_from_the_fleets_documents_is_lossless_on_the_embedded_model(loaded, spec_bench_rows,
                                                                                         tmp_path, monkeypatch):
    """Replica A answers two dev questions; replica B, fresh, indexes A's documents from the fleet and
    answers those two (its suffix index then drafts A's answers) and an unseen one: every answer is
    ``model.generate``'s, token for token."""
    import torch

    from tr_serve.llm import encode_prompt

    monkeypatch.setattr(fleet_actor, "atexit", SimpleNamespace(register=lambda *a, **kw: None))
    prompts, seen = [], set()
    for row in spec_bench_rows:
        ids = encode_prompt(loaded.tokenizer, [{"role": "user", "content": row["turns"][0]}])
        if row["category"] not in seen and len(ids) <= 300:
            seen.add(row["category"])
            prompts.append(ids)
        if len(prompts) == 3:
            break
    want = []
    for ids in prompts:
        with torch.inference_mode():
            gen = loaded.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
        want.append(gen[0, len(ids):].tolist())
    cfg = FleetSyncConfig(enabled=True, namespace="lossless", snapshot_dir=str(tmp_path), snapshot_interval_s=3600)

    def replica(name: str) -> tuple[Engine, MatrixSync]:
        engine = Engine(loaded, EngineConfig(tree="auto", max_num_seqs=1, max_model_len=1024))
        return engine, MatrixSync(engine, cfg, model_id=loaded.model_id, fingerprint="fp", replica_id=name)

    (ea, sa), (eb, sb) = replica("A"), replica("B")
    actor = LocalActor(sa.spec)
    sa._actor = sb._actor = actor
    first = [serve(ea, ids, NEW_TOKENS) for ids in prompts[:2]]
    assert [o.token_ids for o in first] == want[:2]
    assert run(sa.sync_once())["error"] is None
    r = run(sb.sync_once())
    assert r["error"] is None and r["imported"] == 2 and eb.suffix.num_documents() == 2
    trials = eb.speculator.drafter.budget.suffix_stats.trials.sum()
    again = [serve(eb, ids, NEW_TOKENS) for ids in prompts]
    for i, (out, ref) in enumerate(zip(again, want)):
        assert out.token_ids == ref, f"replica B, question {i}: its output differs from plain decoding"
    assert eb.speculator.drafter.budget.suffix_stats.trials.sum() > trials  # B took the suffix index's branches
    mat_a = sum(o.stats.mat for o in first) / 2
    mat_b = sum(o.stats.mat for o in again[:2]) / 2
    print(f"\nMAT of the two questions on A {mat_a:.2f}, on B drafting A's answers from the fleet {mat_b:.2f}")
    assert mat_b > mat_a + 1.0
