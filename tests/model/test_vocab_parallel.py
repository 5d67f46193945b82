"""The LM head split by vocabulary (tr_serve/model/vocab_parallel.py): the ranks' candidates give
the unsplit logits' argmax exactly and their top-k, and the gathered logits are the unsplit ones,
for even and uneven slices; the merge's worked example."""

from __future__ import annotations

import pytest
import torch

from tr_serve.model.vocab_parallel import (VocabShard, logits_over_shards, merge_candidates, pack_candidates,
                                           shard_range)


def test_shard_range_example_and_cover():
    assert shard_range(10, 2, 3) == (8, 10) and shard_range(10, 0, 3) == (0, 4)
    for vocab, world in ((300, 2), (301, 3), (49152, 8), (7, 4)):
        ranges = [shard_range(vocab, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_the_merge_example():
    every = torch.tensor([[[5.0, 5.0, 3.0, 3.0]], [[7.0, 7.0, 9.0, 9.0]]])
    assert merge_candidates(every, 1).tolist() == [[9, 9]]


def _stacked(parts):
    """An all-gather of in-process "ranks": each rank's tensor, stacked in rank order."""
    return torch.stack(parts)


@pytest.mark.parametrize("vocab, world, top_k", [(300, 2, 8), (301, 3, 8), (7, 4, 3), (50, 3, 0)])
def test_the_ranks_candidates_give_the_unsplit_argmax_and_top_k(vocab, world, top_k):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g)
    logits[0, :] = 1.0  # a row of ties: the argmax is the lowest id, as torch.argmax's
    logits[1, vocab - 1] = 50.0  # the winner in the last, shortest slice
    ranges = [shard_range(vocab, r, world) for r in range(world)]
    packed = [pack_candidates(logits[:, a:b], a, top_k) for a, b in ranges]
    ids = merge_candidates(_stacked(packed), top_k)
    assert torch.equal(ids[:, 0], logits.argmax(-1).to(torch.int32))
    if top_k:
        want = logits[2:].topk(top_k, dim=-1)
        got = logits[2:].gather(1, ids[2:, 1:].long())
        assert torch.equal(got, want.values)  # the same values, best first (ids may differ only at ties)

    # the gathered logits, seen from the last (shortest) slice's rank, which pads its own part
    width = -(-vocab // world)
    local = [logits[:, a:b] for a, b in ranges]
    others = [torch.cat((x, x.new_full((6, width - x.shape[1]), float("-inf"))), -1) for x in local[:-1]]
    last = VocabShard(world - 1, world, vocab, gather=lambda mine: _stacked(others + [mine]))
    assert last.width == width and (last.start, last.stop) == ranges[-1]
    assert torch.equal(logits_over_shards(local[-1], last), logits)
