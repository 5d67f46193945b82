"""The one-pass top-k of a step's logits (kernels/top_k.py): its argmax is torch's, bit for bit,
and its top-k holds torch's values; where it cannot answer exactly it says so (None)."""

from __future__ import annotations

import pytest
import torch

from tr_serve.kernels import top_k
from tr_serve.kernels.top_k import top_k_rows
from tests.kernel_testutil import needs_kernel

pytestmark = needs_kernel(top_k.KERNEL)


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


@pytest.mark.parametrize("width", [16, 48, 64, 80, 592, 4096 + 48])
def test_blocks_scanned_four_at_a_time_and_the_tail_alone_find_the_same_top_k(width):
    """The scan skips four 16-float blocks at once when none beats the k-th value so far, and takes a
    width's last blocks (below a multiple of 64) one by one: the maximum in either place, and ties
    across them, come out as torch's."""
    g = torch.Generator().manual_seed(width)
    logits = torch.randn(6, width, generator=g)
    logits[1, -1] = 9.0  # the maximum in the last block
    logits[2, width // 2] = logits[2, -3] = 9.0  # tied maxima, the second in the tail
    logits[3, 0] = 9.0  # the first block
    top = top_k_rows(logits, 8)
    assert torch.equal(top[:, 0], logits.argmax(dim=-1))
    assert torch.equal(logits.gather(1, top), torch.topk(logits, 8, dim=-1).values)


def test_a_nan_in_a_skipped_stretch_is_still_caught():
    """A NaN where no value beats the k-th so far (a stretch the scan skips) still makes it decline."""
    logits = torch.zeros(2, 1024)
    logits[:, :8] = 5.0  # the top 8 are settled in the first block
    logits[1, 700] = float("nan")
    assert top_k_rows(logits[:1], 8) is not None
    assert top_k_rows(logits, 8) is None
