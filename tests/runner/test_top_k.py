"""The one-pass top-k of a step's logits (runner/top_k.py): its argmax is torch's, bit for bit,
and its top-k holds torch's values; where it cannot answer exactly it says so (None)."""

from __future__ import annotations

import pytest
import torch

from tr_serve.runner import top_k
from tr_serve.runner.top_k import top_k_rows

pytestmark = pytest.mark.skipif(top_k.KERNEL.get() is None, reason="no C compiler or libgomp here")


def test_argmax_and_top_k_match_torch_on_model_sized_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 49152, generator=g) * 4
    top = top_k_rows(logits, 8)
    assert top.shape == (20, 8) and top.dtype == torch.long
    assert torch.equal(top[:, 0], logits.argmax(dim=-1))
    assert torch.equal(logits.gather(1, top), torch.topk(logits, 8, dim=-1).values)


def test_ties_resolve_to_the_first_index_as_torch_argmax_does():
    logits = torch.randint(0, 3, (6, 4096)).float()  # every row full of ties for its maximum
    logits[2, 100] = 7.0
    logits[2, 5000 % 4096] = 7.0
    top = top_k_rows(logits, 8)
    assert torch.equal(top[:, 0], logits.argmax(dim=-1))
    assert top[2, :2].tolist() == [100, 904]  # both maxima, in index order
    assert torch.equal(logits.gather(1, top), torch.topk(logits, 8, dim=-1).values)


def test_a_strided_view_of_rows_is_read_with_its_own_stride():
    base = torch.randn(4, 2, 1024)
    rows = base[:, 1]  # row stride 2048
    assert torch.equal(top_k_rows(rows, 4), torch.topk(rows, 4, dim=-1).indices)


@pytest.mark.parametrize("case", ["nan", "too_few_finite", "k_too_large", "int", "odd_vocab", "empty"])
def test_declines_what_it_cannot_answer_exactly(case):
    logits = torch.randn(3, 256)
    k = 4
    if case == "nan":
        logits[1, 17] = float("nan")  # torch.argmax answers the NaN's index
    elif case == "too_few_finite":
        logits[0, 3:] = float("-inf")
    elif case == "k_too_large":
        k = top_k.MAX_K + 1
    elif case == "int":
        logits = logits.to(torch.int32)
    elif case == "odd_vocab":
        logits = torch.randn(3, 250)
    elif case == "empty":
        logits = torch.randn(0, 256)
    assert top_k_rows(logits, k) is None
