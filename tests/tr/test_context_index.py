"""Context index: the longest recent n-gram match and its continuation."""

from __future__ import annotations

import random

import pytest

from tr_serve.tr.context_index import ContextIndex


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, list[int]]:
    """Scan the whole text: longest suffix n-gram with an earlier occurrence followed by a token;
    its latest such occurrence's continuation."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrence tokens[start:start+n], followed by one
            if tokens[start : start + n] == suffix:
                text = list(tokens)
                for i in range(k):  # the text after the suffix repeats the text after the occurrence
                    text.append(text[start + n + i])
                return n, text[len(tokens) :]
    return 0, []


def test_longest_match_and_most_recent_occurrence():
    idx = ContextIndex(max_ngram=4, min_ngram=2)
    idx.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    # suffix (2, 3) occurred at 1..2 (then 9) and 5..6 (then 7): the latest wins; (5, 2, 3) never did
    assert idx.lookup(3) == (2, [7, 5, 2])
    idx.extend([7])
    # now (2, 3, 7) matches at 5..7: a 3-token match beats the shorter ones
    assert idx.lookup(2) == (3, [5, 2])


def test_a_match_near_the_end_continues_as_an_overlapping_copy():
    idx = ContextIndex(max_ngram=4, min_ngram=2)
    idx.extend([9, 4, 7, 7, 7])
    # (7, 7) last occurred at 2..3, followed by the final 7: the loop goes on
    assert idx.lookup(5) == (2, [7, 7, 7, 7, 7])
    idx.extend([1, 2, 1, 2])
    # (1, 2) at 5..6 then "1 2": period 2
    assert idx.lookup(5) == (2, [1, 2, 1, 2, 1])


def test_no_match_below_min_ngram():
    idx = ContextIndex(max_ngram=4, min_ngram=2)
    idx.extend([1, 2, 3, 1])  # only the 1-gram (1,) repeats
    assert idx.lookup(4) == (0, [])
    assert ContextIndex(max_ngram=4, min_ngram=1).lookup(4) == (0, [])
    one = ContextIndex(max_ngram=4, min_ngram=1)
    one.extend([1, 2, 3, 1])
    assert one.lookup(4) == (1, [2, 3, 1, 2])


@pytest.mark.parametrize("seed", range(20))
def test_matches_a_brute_force_scan_while_growing(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])
    min_n = rng.choice([1, 2, 3])
    idx = ContextIndex(max_ngram=5, min_ngram=min_n)
    tokens = [rng.randrange(vocab) for _ in range(rng.choice([0, 1, 4, 40]))]  # a prompt, in one call
    idx.extend(tokens)
    for _ in range(80):
        # mostly a step's 1-3 tokens; now and then 16+ at once (indexed in bulk: context_index.BULK_TOKENS)
        new = [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 3, 1, 2, 3, 16, 21]))]
        idx.extend(new)
        tokens += new
        assert idx.lookup(6) == brute_force(tokens, min_n, 5, 6)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ContextIndex(max_ngram=2, min_ngram=3)
