"""scripts/study_matrix_orders.py: its replay decodes step by step, as the engine does."""

from __future__ import annotations

import numpy as np
import pytest

from script_module import load_script


def _cycle_trace(script, prompt_token: int, output: list[int]):
    """A trace whose model predicts each next token of ``output`` first (probability 0.9)."""
    tokens = np.asarray([prompt_token, *output])
    top = np.zeros((len(tokens), script.K), np.int32)
    top[:-1, 0] = tokens[1:]
    probs = np.full((len(tokens), script.K), 0.01, np.float32)
    probs[:, 0] = 0.9
    return script.Trace(1, tokens, top, probs, measured=True)


def test_a_step_starts_after_the_previous_steps_accepted_run():
    script = load_script("study_matrix_orders")
    vocab = 8
    output = [0, 1, 2, 3, 4] * 4  # 20 tokens after the prompt's one
    ids = np.full((vocab, script.K), 7, np.int32)
    ids[:5, 0] = [1, 2, 3, 4, 0]  # the prior's first candidates are right everywhere
    ids[5, 0] = 0
    prior = (ids, np.full((vocab, script.K), 0.5, np.float32))
    two_deep = lambda rows, root: [(0,), (0, 0)]
    # steps at positions 0, 3, ..., 18: two drafts and the bonus token each, the last only the one
    # draft the output has room for
    assert script.replay([_cycle_trace(script, 5, output)], prior, two_deep) == pytest.approx(20 / 7)


def test_rows_are_recycled_along_the_accepted_path():
    script = load_script("study_matrix_orders")
    vocab = 8
    output = [0, 1, 2, 3, 4] * 4
    prior = (np.full((vocab, script.K), 7, np.int32), np.full((vocab, script.K), 0.5, np.float32))
    one_deep = lambda rows, root: [(0,)]
    # the first cycle drafts the wrong 7 and learns each row; from then on every draft is right:
    # 6 one-token steps (the prompt's token, 0..4), then steps of two tokens over the 14 left
    assert script.replay([_cycle_trace(script, 5, output)], prior, one_deep) == pytest.approx(20 / 13)
