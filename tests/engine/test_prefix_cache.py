"""The prefix cache alone (no model, no torch): block hashes, placement against a reference model
of it, tenant scoping, the order free rows are reused in."""

from __future__ import annotations

import random

import pytest

from tr_serve.engine.prefix_cache import PrefixCache, block_hashes
from tr_serve.engine.request import FinishReason, Request
from tr_serve.engine.request_context import RequestContext
from tr_serve.engine.scheduler import Scheduler
from tr_serve.sampling_params import SamplingParams


def test_a_block_hash_covers_every_token_before_it_and_the_tenant():
    a = block_hashes([1, 2, 3, 4, 5], 2, "t")
    assert len(a) == 2  # the trailing partial block has none
    assert block_hashes([1, 2, 3, 4], 2, "t") == a
    assert block_hashes([9, 2, 3, 4], 2, "t")[1] != a[1]  # same block, another prefix
    assert block_hashes([1, 2, 3, 4], 2, "u")[0] != a[0]  # same tokens, another tenant
    assert block_hashes([1, 2], 2, "") != block_hashes([1, 2], 2, None)


def test_the_docstring_example():
    cache = PrefixCache(num_rows=2, block_size=2)
    first = cache.place([5, 6, 7, 8, 9], "t")
    assert (first.row, first.cached) == (0, 0)
    cache.hold(0, [5, 6, 7, 8, 9, 10, 11][:6], "t")  # finished: 6 tokens of KV
    cache.release(0)
    second = cache.place([5, 6, 7, 8, 9, 10, 11, 12], "t")
    assert (second.row, second.source, second.cached) == (0, 0, 6)


def test_the_last_prompt_token_is_never_cached():
    cache = PrefixCache(num_rows=2, block_size=2)
    cache.place([1, 2, 3, 4], "t")
    cache.hold(0, [1, 2, 3, 4], "t")
    again = cache.place([1, 2, 3, 4], "t")  # all 4 are cached, but the prefill needs the last one's logits
    assert (again.source, again.cached) == (0, 2) and again.row == 1


def test_a_tenant_never_finds_another_tenants_blocks():
    cache = PrefixCache(num_rows=3, block_size=2)
    cache.place([1, 2, 3, 4, 5], "a")
    cache.hold(0, [1, 2, 3, 4, 5], "a")
    cache.release(0)
    other = cache.place([1, 2, 3, 4, 5], "b")
    assert other.cached == 0 and other.row == 1  # not even row 0's free row: it holds a's blocks
    assert cache.place([1, 2, 3, 4, 5], "a").cached == 4


def test_free_rows_are_overwritten_empty_first_then_least_recently_freed():
    cache = PrefixCache(num_rows=3, block_size=1)
    for row, tokens in enumerate(([1, 1], [2, 2], [3, 3])):
        assert cache.place(tokens, "t").row == row
        cache.hold(row, tokens, "t")
    for row in (1, 0, 2):
        cache.release(row)
    assert cache.place([7, 7], "t").row == 1
    assert cache.place([8, 8], "t").row == 0
    assert cache.place([3, 9], "t").row == 2  # its cached prefix, not the order
    assert cache.place([1, 1], "t") is None  # no free row


def test_placement_matches_a_reference_model_of_the_cache():
    """Random prompts over a small alphabet (so prefixes are shared), random tenants, outputs and
    retirements. The reference keeps each row's tokens and tenant and finds the longest
    block-aligned prefix by brute force; the cache must find as long a prefix, in a row whose
    tokens really start with it, for the same tenant."""
    rng = random.Random(0)
    bs, rows = 4, 5
    cache = PrefixCache(rows, bs)
    held: dict[int, tuple[str, list[int]]] = {}  # row -> (tenant, tokens whose KV the row holds)
    live: dict[int, tuple[str, list[int]]] = {}  # row -> (tenant, prompt) of its running request
    stems = [[rng.randrange(3) for _ in range(24)] for _ in range(3)]
    kinds = set()
    for _ in range(600):
        if live and (len(live) == rows or rng.random() < 0.45):
            row = rng.choice(sorted(live))
            tenant, prompt = live.pop(row)
            failed = rng.random() < 0.1
            kv = prompt + [rng.randrange(3) for _ in range(rng.randrange(6))]
            kv = kv[: rng.randrange(len(prompt) // 2, len(kv) + 1)]  # aborted mid-prefill, or mid-output
            if failed:
                held.pop(row, None)
                cache.release(row, keep=False)
            else:
                held[row] = (tenant, kv)
                cache.hold(row, kv, tenant)
                cache.release(row)
            continue
        tenant = rng.choice("ab")
        prompt = rng.choice(stems)[: rng.randrange(2, 25)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
        usable = (len(prompt) - 1) // bs * bs
        best = 0
        for t, tokens in held.values():
            if t != tenant:
                continue
            n = 0
            while n + bs <= min(usable, len(tokens)) and tokens[n : n + bs] == prompt[n : n + bs]:
                n += bs
            best = max(best, n)
        placement = cache.place(prompt, tenant)
        assert placement is not None and placement.cached == best
        if best:
            src_tenant, src_tokens = held[placement.source]
            assert src_tenant == tenant and src_tokens[:best] == prompt[:best]
            kinds.add("in place" if placement.source == placement.row else "copied")
        cache.hold(placement.row, prompt, tenant)  # prefilled
        held[placement.row] = (tenant, prompt)
        live[placement.row] = (tenant, prompt)
    assert kinds == {"in place", "copied"}


def _request(request_id: str, prompt: list[int], learn: bool = True, tenant: str = "t") -> Request:
    req = Request(request_id, prompt, SamplingParams(), detokenizer=None)
    req.request_context = RequestContext(tenant=tenant, learn=learn)
    return req


def test_the_scheduler_starts_a_prefill_after_its_cached_prefix():
    s = Scheduler(num_rows=2, max_num_batched_tokens=100, block_size=2)
    first = _request("a", [1, 2, 3, 4, 5])
    s.add(first)
    s.admit()
    s.start_decoding(first)
    first.output_ids = [6, 7]
    assert s.retire([first], kv_tokens=[6]) == [0]
    second = _request("b", [1, 2, 3, 4, 5, 6, 7, 8])
    s.add(second)
    [(req, placement)] = s.admit()
    assert req is second and (second.row, second.num_prefilled, second.stats.cached_tokens) == (0, 6, 6)
    assert placement.source == 0
    assert [c.tokens for c in s.prefill_chunks()] == [[7, 8]]
    assert s.load().prefix_cache_hits == 6 and s.load().prefix_cache_queries == 13


@pytest.mark.parametrize("learn, reason", [(False, FinishReason.STOP), (True, FinishReason.ERROR)])
def test_a_row_that_must_not_teach_keeps_nothing_findable(learn, reason):
    s = Scheduler(num_rows=2, max_num_batched_tokens=100, block_size=2)
    first = _request("a", [1, 2, 3, 4, 5], learn=learn)
    s.add(first)
    s.admit()
    s.start_decoding(first)
    first.finish_reason = reason
    s.retire([first], kv_tokens=[5])
    s.add(_request("b", [1, 2, 3, 4, 5]))
    [(second, _)] = s.admit()
    assert second.num_prefilled == 0


def test_prefix_caching_off_finds_nothing():
    s = Scheduler(num_rows=2, max_num_batched_tokens=100, prefix_caching=False, block_size=2)
    first = _request("a", [1, 2, 3, 4, 5])
    s.add(first)
    s.admit()
    s.start_decoding(first)
    s.retire([first], kv_tokens=[5])
    s.add(_request("b", [1, 2, 3, 4, 5]))
    [(second, _)] = s.admit()
    assert second.num_prefilled == 0 and s.load().prefix_cache_queries == 0
