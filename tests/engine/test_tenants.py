"""A tenant's text never shapes what another tenant observes (real embedded model).

The attack: tenant A sends a prompt holding the greedy answer to a question; tenant B then asks
that question. B must decode exactly as on a fresh engine; the same run with both requests in the
shared tenant shows the channel the isolation closes (so each test can fail).
"""

from __future__ import annotations

from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.engine.prompt import encode_prompt
from tr_serve.engine.request import FinishReason
from tr_serve.engine.request_context import RequestContext
from tr_serve.sampling_params import SamplingParams

QUESTION = "Explain what a hash table is and how collisions are handled."
NEW_TOKENS = 64


def _decode(engine: Engine, prompt: list[int], context: RequestContext | None = None, n: int = NEW_TOKENS):
    engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), context=context)
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    return done[0]


def _engine(loaded, **kw) -> Engine:
    return Engine(loaded, EngineConfig(model=loaded.model_id, max_num_seqs=2, max_model_len=1024, **kw))


def _attack(loaded, attacker: RequestContext, victim: RequestContext, **kw):
    """B's output on a fresh engine, and after A proofread B's answer on another engine."""
    tok = loaded.tokenizer
    question = encode_prompt(tok, [{"role": "user", "content": QUESTION}])
    fresh = _decode(_engine(loaded, **kw), question, victim)
    answer = tok.decode(fresh.token_ids)
    proofread = encode_prompt(tok, [{"role": "user", "content": "Please proofread this:\n\n" + answer}])
    engine = _engine(loaded, **kw)
    for _ in range(2):
        _decode(engine, proofread, attacker)
    return fresh, _decode(engine, question, victim), engine


def test_matrix_rows_written_by_one_tenant_never_draft_for_another(loaded):
    a, b = RequestContext(tenant="t-a"), RequestContext(tenant="t-b")
    fresh, after, _ = _attack(loaded, a, b, tree="2.2.2")  # the matrix alone: no suffix index, no budget
    assert after.token_ids == fresh.token_ids
    assert after.stats.accepted_per_step == fresh.stats.accepted_per_step  # every draft as on a fresh engine
    shared = RequestContext()
    fresh, after, _ = _attack(loaded, shared, shared, tree="2.2.2")
    assert after.token_ids == fresh.token_ids
    assert after.stats.mat > 1.1 * fresh.stats.mat  # the channel, open within one tenant


def test_the_suffix_index_and_matrix_of_one_tenant_never_draft_for_another(loaded):
    # A speculates as any caller does: its text fills its suffix documents and its matrix rows, and
    # its steps teach its own budget's acceptance estimates, none of which plan B's rows
    a, b = RequestContext(tenant="t-a"), RequestContext(tenant="t-b")
    fresh, after, engine = _attack(loaded, a, b, tree="auto")
    assert after.token_ids == fresh.token_ids
    assert after.stats.mat < 1.1 * fresh.stats.mat
    assert engine.tenant_matrix_stats()["tenants"] == 2  # A learned rows of its own
    fresh_s, after_s, _ = _attack(loaded, RequestContext(), RequestContext(), tree="auto")
    assert after_s.token_ids == fresh_s.token_ids
    assert after_s.stats.mat > 1.5 * fresh_s.stats.mat


def _learned(budget) -> list:
    """What a budget learned from acceptance: its estimates, calibrations and template order."""
    out = [budget.steps, budget.order, budget.calibration.expected, budget.calibration.accepted,
           budget.branch_calibration.expected, budget.branch_calibration.accepted]
    for stats in (budget.acceptance, budget.branchless, budget.context_stats, budget.suffix_stats):
        out += [stats.hits.tolist(), stats.trials.tolist()]
    return out


def test_one_tenants_acceptance_never_sizes_another_tenants_trees(loaded):
    """The cost-aware budget's estimates are per tenant: steps of A's rows (alone, or in one batch
    with another tenant's) teach A's budget and no other, so B's trees are planned from the priors."""
    tok = loaded.tokenizer
    question = encode_prompt(tok, [{"role": "user", "content": QUESTION}])
    plain = _decode(_engine(loaded, tree="none"), question)
    engine = _engine(loaded, tree="auto")
    drafter = engine.speculator.drafter
    prior = _learned(drafter.budget)
    a, b = RequestContext(tenant="t-a"), RequestContext(tenant="t-b")
    assert _decode(engine, question, a).token_ids == plain.token_ids
    assert _learned(drafter.budget) == prior  # the shared tenant's budget: untouched
    assert _learned(drafter.budget_of("t-b")) == prior  # B's, made now: the priors, nothing of A's
    taught = _learned(drafter.budget_of("t-a"))
    assert taught != prior
    engine.add_request(question, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), "a", context=a)
    engine.add_request(question, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), "s")
    done = {}
    while engine.has_unfinished():  # one batch of two tenants: each row learned by its own budget
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["a"].token_ids == plain.token_ids == done["s"].token_ids
    assert _learned(drafter.budget_of("t-b")) == prior
    assert _learned(drafter.budget) != prior and _learned(drafter.budget_of("t-a")) != taught
    assert drafter.budget.steps == len(done["s"].stats.accepted_per_step)  # one plan per step of its row


def test_learn_false_leaves_every_index_and_row_byte_identical(loaded):
    engine = _engine(loaded, tree="auto")
    question = encode_prompt(loaded.tokenizer, [{"role": "user", "content": QUESTION}])
    _decode(engine, question[:20], RequestContext(), n=16)  # something learned already
    table, streak = engine.matrix.table.clone(), engine.matrix.streak.clone()
    docs, tokens = engine.suffix.num_documents(), engine.suffix.num_tokens
    plain = _decode(_engine(loaded, tree="none"), question)
    out = _decode(engine, question, RequestContext(learn=False))
    assert out.token_ids == plain.token_ids
    assert bool((engine.matrix.table == table).all()) and bool((engine.matrix.streak == streak).all())
    assert engine.matrix.take_dirty_rows().numel() > 0  # the earlier request's rows only, checked next
    assert (engine.suffix.num_documents(), engine.suffix.num_tokens) == (docs, tokens)


def test_speculation_off_decodes_plainly_beside_a_speculating_request(loaded):
    engine = _engine(loaded, tree="auto")
    question = encode_prompt(loaded.tokenizer, [{"role": "user", "content": QUESTION}])
    plain = _decode(_engine(loaded, tree="none"), question)
    engine.add_request(question, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), "on")
    engine.add_request(question, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), "off",
                       context=RequestContext(speculation=False))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["on"].token_ids == plain.token_ids == done["off"].token_ids
    assert set(done["off"].stats.tree_nodes_per_step) == {0}  # the root alone, every step
    assert done["on"].stats.mat > 1.0


def test_a_fault_in_one_request_fails_it_alone_and_the_others_stay_lossless(loaded, monkeypatch):
    tok = loaded.tokenizer
    prompts = [encode_prompt(tok, [{"role": "user", "content": q}]) for q in
               ("Name three colors.", QUESTION, "What is TCP?", "Write a haiku about rain.")]
    plain = [_decode(_engine(loaded, tree="none"), p, n=32).token_ids for p in prompts]
    engine = Engine(loaded, EngineConfig(model=loaded.model_id, tree="auto", max_num_seqs=4, max_model_len=1024))
    import tr_serve.engine.engine as engine_module

    real = engine_module.append_token

    def faulty(req, token, *args):
        if req.request_id == "r1" and len(req.output_ids) >= 5:
            raise RuntimeError("injected fault")
        return real(req, token, *args)

    monkeypatch.setattr(engine_module, "append_token", faulty)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=32, ignore_eos=True), f"r{i}")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["r1"].finish_reason is FinishReason.ERROR and done["r1"].token_ids == []
    for i in (0, 2, 3):
        assert done[f"r{i}"].token_ids == plain[i]
    assert not engine.has_unfinished() and engine.load().running == 0


def test_a_tenant_drafts_from_the_rows_its_own_text_wrote(loaded):
    a = RequestContext(tenant="t-a")
    question = encode_prompt(loaded.tokenizer, [{"role": "user", "content": QUESTION}])
    plain = _decode(_engine(loaded, tree="none"), question)
    fresh, after, engine = _attack(loaded, a, a, tree="2.2.2")  # the matrix alone: its overlay's rows
    assert after.token_ids == fresh.token_ids == plain.token_ids
    assert after.stats.mat > 1.1 * fresh.stats.mat  # as the shared tenant gains from its own text
    totals = engine.tenant_matrix_stats()
    assert totals["tenants"] == 1 and 0 < totals["rows"] <= totals["rows_per_tenant"]
    assert engine.matrix.take_dirty_rows().numel() == 0  # nothing of A's reached the shared rows


def test_rows_of_several_tenants_with_overlays_in_one_batch_stay_lossless(loaded):
    tok = loaded.tokenizer
    question = encode_prompt(tok, [{"role": "user", "content": QUESTION}])
    other = encode_prompt(tok, [{"role": "user", "content": "What is TCP?"}])
    plain = [_decode(_engine(loaded, tree="none"), p).token_ids for p in (question, other)]
    for tree in ("auto", "2.2.2+ctx"):
        engine = _engine(loaded, tree=tree)
        a, b = RequestContext(tenant="t-a"), RequestContext(tenant="t-b")
        _decode(engine, question, a, n=24)
        _decode(engine, other, b, n=24)  # both tenants hold an overlay now
        for p, ctx, rid in ((question, a, "a"), (other, b, "b"), (question, RequestContext(), "s")):
            engine.add_request(p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), rid, context=ctx)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done["a"].token_ids == plain[0] == done["s"].token_ids, tree
        assert done["b"].token_ids == plain[1], tree
        assert engine.tenant_matrix_stats()["tenants"] == 2
