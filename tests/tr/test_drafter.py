"""The drafter: which nodes a step verifies under each tree spec, on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.sampling_params import SamplingParams

# this random model soon repeats one token for ever: the context branch finds long matches
PROMPT = [5, 17, 230, 402, 9, 33, 5, 17, 230, 402, 9, 33, 5, 17]


def run(engine: Engine, prompt: list[int], n: int = 24) -> list[int]:
    engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        out += [o for o in engine.step() if o.finished]
    return out[0].token_ids


def spy(obj, name: str, record) -> None:
    """Wrap ``obj.name`` so every call's arguments and result pass through ``record(args, result)``."""
    real = getattr(obj, name)

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        record(args, result)
        return result

    setattr(obj, name, wrapped)


def test_pld_drafts_from_the_context_and_never_touches_the_matrix(tokenizer):
    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.1)
    plain = run(Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128)), PROMPT)
    engine = Engine(loaded, EngineConfig(model="tiny", tree="pld", max_model_len=128))
    widths = []
    spy(engine.runner, "verify", lambda args, _: widths.append(args[1].shape[1]))  # args: rows, tokens, ...
    assert run(engine, PROMPT) == plain
    assert engine.matrix.num_filled_rows() == 0
    assert max(widths) == 5  # the root and a 4-token branch (the prompt repeats)
    assert min(widths) >= 1


def test_hybrid_trees_are_the_template_plus_a_branch_and_stay_lossless(tokenizer):
    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.1)
    plain = run(Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128)), PROMPT)
    engine = Engine(loaded, EngineConfig(model="tiny", tree="top4+ctx", max_model_len=128))
    drafts = []
    spy(engine.speculator.drafter, "draft", lambda _, batch: drafts.append(batch))
    assert run(engine, PROMPT) == plain
    assert all(d.template_nodes.numel() == 4 for d in drafts)
    assert any(d.chain_columns[0] for d in drafts), "the repeating prompt should give a context branch"
    assert max(d.num_nodes for d in drafts) > 4  # some branch went beyond the template's nodes
    assert engine.matrix.num_filled_rows() > 0


def test_auto_verifies_the_best_estimated_nodes(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.1)
    plain = run(Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=256)), PROMPT, 64)
    engine = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=256))
    drafter = engine.speculator.drafter
    assert drafter.acceptance is drafter.budget.acceptance and drafter.budget.context_stats is not None
    assert run(engine, PROMPT, 64) == plain
    # a re-ranking orders the nodes by estimated path rate: every prefix is a tree and the rates
    # never increase along the order
    rates = drafter.acceptance.rates
    drafter.budget.reorder(rates.tolist())
    paths = drafter.template.template
    assert sorted(drafter.order) == list(range(1, len(paths) + 1))
    seen: set[tuple[int, ...]] = set()
    for node in drafter.order:
        p = paths[node - 1]
        assert len(p) == 1 or p[:-1] in seen, f"{p} comes before its parent"
        seen.add(p)
    ordered = rates[torch.tensor(drafter.order) - 1]
    assert torch.all(ordered[:-1] >= ordered[1:])
    assert drafter.order != list(range(1, len(paths) + 1))  # the estimates moved away from level order
    assert run(engine, PROMPT[::-1], 16)  # and it keeps serving with the new subsets


def test_the_fixed_hybrid_drafts_from_the_pair_table_and_stays_lossless(tokenizer):
    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.1)
    plain = run(Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128)), PROMPT, 40)
    hybrid = Engine(loaded, EngineConfig(model="tiny", tree="2.2.2+ctx", max_model_len=128))
    assert hybrid.speculator.pairs is not None and hybrid.speculator.drafter.pairs is hybrid.speculator.pairs
    befores = []
    spy(hybrid.speculator.drafter, "draft", lambda args, result: befores.append(args[3]))
    assert run(hybrid, PROMPT, 40) == plain
    assert int((hybrid.speculator.pairs.keys >= 0).sum()) > 0
    assert all(b is not None for b in befores) and int(befores[0][0]) == PROMPT[-1]  # the first root: the prompt's last token before it
    # the paper's template drafts from the matrix alone, unless asked
    assert Engine(loaded, EngineConfig(model="tiny", tree="2.2.2", max_model_len=128)).speculator.pairs is None
    opted = Engine(loaded, EngineConfig(model="tiny", tree="2.2.2", max_model_len=128, pair_table=True))
    assert run(opted, PROMPT, 40) == plain and int((opted.speculator.pairs.keys >= 0).sum()) > 0
    off = Engine(loaded, EngineConfig(model="tiny", tree="2.2.2+ctx", max_model_len=128, pair_table=False))
    assert off.speculator.pairs is None and run(off, PROMPT, 40) == plain


def test_auto_hangs_the_pair_tables_chain_where_the_context_has_no_match(tokenizer):
    from tr_serve.tr.drafter import TABLE_CHAIN_MATCH

    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.1)
    prompt = [5, 17, 230, 402, 9, 33, 71, 12]  # no repeated n-gram: the context index finds nothing at first
    plain = run(Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128)), prompt, 40)
    assert Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=128)).speculator.pairs is None  # opt-in
    engine = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=128, pair_table=True))
    assert engine.speculator.pairs is not None
    engine.speculator.pairs.write(torch.tensor([prompt[-1]]), torch.tensor([plain[0]]), torch.tensor([[plain[1]] * 8]))
    engine.speculator.pairs.write(torch.tensor([plain[0]]), torch.tensor([plain[1]]), torch.tensor([[plain[2]] * 8]))
    plans = []
    spy(engine.speculator.drafter.budget, "plan", lambda args, result: plans.append((list(args[2][0]), args[3][0])))
    assert run(engine, prompt, 40) == plain
    # the first step: the context has no match, the pair table holds two steps of the real text
    chain, match = plans[0]
    assert match == TABLE_CHAIN_MATCH and chain[:2] == [plain[1], plain[2]] and chain == plain[1 : 1 + len(chain)]
    assert engine.speculator.drafter.budget.context_stats.trials[0].sum() > 0  # the chain's own acceptance was observed


def test_auto_hangs_the_matrix_confident_chain_on_every_step_where_the_context_has_no_match(tokenizer):
    from tr_serve.tr.drafter import CONFIDENT_STREAK, TABLE_CHAIN_MATCH

    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.5)  # its first tokens differ
    prompt = [5, 17, 230, 402, 9, 33, 71, 12]  # no repeated n-gram: the context index finds nothing at first
    plain = run(Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128)), prompt, 40)
    for lean in (True, False):
        engine = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=128))
        assert engine.speculator.pairs is None
        m = engine.matrix
        m.table[plain[0], 0], m.table[plain[1], 0] = plain[1], plain[2]  # two steps of the real text, confident
        m.streak[plain[0]] = m.streak[plain[1]] = CONFIDENT_STREAK
        m.streak[plain[2]] = CONFIDENT_STREAK - 1  # not confident: the chain ends at plain[2]
        budget = engine.speculator.drafter.budget
        if lean:
            budget.template_use = 0.0  # recent plans bought no template node: the next steps are lean
        plans = []
        agreed = []
        spy(budget, "plan_branches" if lean else "plan",
            lambda args, result: (plans.append((list(args[0 if lean else 2][0]), args[1 if lean else 3][0])),
                                  agreed.append(list(args[2 if lean else 5][0]))))
        assert run(engine, prompt, 40) == plain
        # lean step or full plan, the chain is the row's branch, priced by its own acceptance
        assert plans[0] == ([plain[1], plain[2]], TABLE_CHAIN_MATCH)
        assert agreed[0] == [True, True]  # a chain of first candidates: the matrix agrees with every token
        assert budget.context_stats.trials[0].sum() > 0  # the chain's own acceptance was observed


def test_pair_table_slots_must_be_a_power_of_two():
    import pytest

    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(model="tiny", pair_table_slots=1000)


def test_auto_drafts_another_requests_continuation_from_the_suffix_index_within_its_namespace(tokenizer):
    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.5)
    prompt = [5, 17, 230, 402, 9, 33, 71, 12]  # no repeated n-gram: the context index finds nothing at first
    plain = run(Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128)), prompt, 40)
    engine = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=128))
    assert engine.suffix is not None and engine.speculator.drafter.suffix is engine.suffix  # auto's default
    drafts = []
    spy(engine.speculator.drafter, "draft", lambda args, batch: drafts.append(batch))
    assert run(engine, prompt, 40) == plain
    assert not any(any(d.branch_cells) for d in drafts)  # nothing else was indexed yet
    assert engine.suffix.num_documents() == 1 and engine.suffix.num_tokens == len(prompt) + 40
    drafts.clear()
    assert run(engine, prompt, 40) == plain  # the same request again: its first answer drafts for it
    with_suffix = [d for d in drafts if d.branch_cells[0]]
    assert with_suffix, "the repeated request should take the suffix index's branch"
    text = prompt + plain
    for d in with_suffix:
        assert d.match_lengths[0] >= 3
        # the branch is the first answer's continuation: the root and the branch are its text
        walk = [int(d.tokens[0, 0])] + [int(d.tokens[0, c]) for c in d.chain_columns[0]]
        assert any(text[i : i + len(walk)] == walk for i in range(len(text))), walk
    stats = engine.speculator.drafter.budget.suffix_stats
    assert stats.trials.sum() > 2 * len(stats.trials)  # observed beyond the priors' weight of 2 per cell
    # another tenant's identical request never drafts from this text
    drafts.clear()
    engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True), namespace="tenant-b")
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].token_ids == plain
    assert not any(any(d.branch_cells) for d in drafts)


def test_the_suffix_index_is_autos_and_holds_at_most_its_token_setting(tokenizer):
    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.5)
    config = dict(model="tiny", max_model_len=128)
    assert Engine(loaded, EngineConfig(tree="2.2.2+ctx", **config)).suffix is None
    assert Engine(loaded, EngineConfig(tree="pld", **config)).suffix is None
    assert Engine(loaded, EngineConfig(tree="auto", suffix_index=False, **config)).suffix is None
    with pytest.raises(ValueError, match="suffix_index"):
        EngineConfig(tree="2.2.2", suffix_index=True, **config)
    with pytest.raises(ValueError, match="suffix_index_tokens"):
        EngineConfig(tree="auto", suffix_index_tokens=0, **config)
    plain = run(Engine(loaded, EngineConfig(tree="none", **config)), [7, 8, 9, 10], 30)
    engine = Engine(loaded, EngineConfig(tree="auto", suffix_index_tokens=50, **config))
    for _ in range(3):
        assert run(engine, [7, 8, 9, 10], 30) == plain
        assert engine.suffix.num_tokens <= 50
    assert engine.suffix.evicted_documents == 2 and engine.suffix.num_documents() == 1


def test_a_running_requests_text_drafts_for_a_later_one(tokenizer):
    loaded = tiny_loaded(tokenizer, seed=3, init_range=0.5)
    prompt = [5, 17, 230, 402, 9, 33, 71, 12]
    plain = run(Engine(loaded, EngineConfig(model="tiny", tree="none", max_model_len=128)), prompt, 40)
    engine = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_model_len=128, max_num_seqs=2))
    drafts = []
    spy(engine.speculator.drafter, "draft", lambda args, batch: drafts.append(batch))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = engine.add_request(prompt, params)
    outs = {}
    while not drafts or len(engine.running[0].output_ids) < 20:  # the first request is 20 tokens ahead
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert not any(any(d.branch_cells) for d in drafts)
    second = engine.add_request(prompt, params)
    drafts.clear()
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[first].token_ids == plain and outs[second].token_ids == plain
    rows = [d.branch_cells[-1] for d in drafts if len(d.branch_cells) == 2]  # the second request's row
    assert any(rows), "the running request's text should draft for the later one"
