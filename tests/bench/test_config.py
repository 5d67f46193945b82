"""``BenchConfig.validate``: the tree settings a single-stream bench accepts and refuses."""

from __future__ import annotations

import pytest

from tr_serve.bench.config import BenchConfig
from tr_serve.bench.records import BenchError


@pytest.mark.parametrize("spec", ["2.2.2", "top8+ctx", "2.2.2+ctx", "auto", "chain4"])
def test_tree_settings_the_engine_accepts_are_accepted(spec):
    BenchConfig(trees=(spec,)).validate()


@pytest.mark.parametrize("spec, message", [
    ("none", "plain decoding, which the baseline method already measures"),
    ("off", "plain decoding"),
    ("pld", "measured as the method 'pld'"),
    ("+ctx", "'\\+ctx' follows a template name"),
    ("auto+ctx", "'\\+ctx' follows a template name"),
    ("nonexistent+ctx", "unknown tree 'nonexistent'"),
])
def test_tree_settings_refused(spec, message):
    with pytest.raises(BenchError, match=message):
        BenchConfig(trees=(spec,)).validate()


def test_a_tree_given_twice_is_refused():
    with pytest.raises(BenchError, match="given twice"):
        BenchConfig(trees=("top4", " top4")).validate()
