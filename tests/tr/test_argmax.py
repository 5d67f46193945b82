"""The blocked argmax equals ``torch.argmax`` bit for bit, ties and non-finite values included."""

from __future__ import annotations

import torch

from tr_serve.tr.argmax import argmax_rows


def test_equals_torch_argmax_on_random_logits_and_ties():
    g = torch.Generator().manual_seed(0)
    for n, v in ((1, 49152), (15, 49152), (7, 1024), (3, 4096)):
        x = torch.randn(n, v, generator=g)
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        # coarse values: many exact ties, inside one block and across blocks
        x = torch.randint(0, 4, (n, v), generator=g).float()
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_first_of_equal_maxima_wins_across_blocks():
    x = torch.zeros(2, 1024)
    x[0, 700] = x[0, 130] = x[0, 900] = 5.0  # three blocks hold the maximum: the first index wins
    x[1, 129] = x[1, 128] = 1.0  # two positions in one block
    assert argmax_rows(x).tolist() == [130, 128] == x.argmax(dim=-1).tolist()


def test_non_finite_rows_follow_torch():
    x = torch.randn(4, 512)
    x[0] = float("-inf")  # every logit masked: torch says index 0
    x[1, 300] = float("inf")
    x[2, 17] = float("nan")  # torch's argmax takes the NaN
    x[3, 400] = float("nan")
    x[3, 5] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_other_shapes_fall_back():
    x = torch.randn(3, 1000)  # not a multiple of the block
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(torch.zeros(0, 512)).shape == (0,)
