"""The LM head split by vocabulary over tensor-parallel ranks: each rank computes the logits of its
slice of the vocabulary and reduces them to its candidates; only those travel.

Why: every tree node needs its argmax and top-k (the output and the recycled matrix row), so the LM
head runs on every node of every row: at 32 rows of 81 nodes and Llama-3's 128256 x 8192 head that
is 2.7 TFLOP a step, one rank's alone when the head is replicated. Split, each rank computes 1/N of
it, and the ranks exchange [nodes, 2 (1 + k)] numbers (each rank's best and top-k, values and ids),
not [nodes, vocab] logits. A sampled step, whose sampler reads whole distributions, gathers the
logits themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class VocabShard:
    """Rank ``rank`` of ``world`` holds vocabulary ids [start, stop) of ``vocab`` (:func:`shard_range`);
    ``gather`` all-gathers a tensor of the same shape on every rank: [...] -> [world, ...]."""

    rank: int
    world: int
    vocab: int
    gather: Callable[[torch.Tensor], torch.Tensor]

    @property
    def start(self) -> int:
        return shard_range(self.vocab, self.rank, self.world)[0]

    @property
    def stop(self) -> int:
        return shard_range(self.vocab, self.rank, self.world)[1]

    @property
    def width(self) -> int:
        """Every shard's padded width: ceil(vocab / world)."""
        return -(-self.vocab // self.world)


def shard_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of ``rank``'s slice: contiguous slices of ceil(vocab / world) ids, the last ones shorter.

    Example: shard_range(10, 2, 3) -> (8, 10); shard_range(10, 0, 3) -> (0, 4)."""
    width = -(-vocab // world)
    return min(vocab, rank * width), min(vocab, (rank + 1) * width)


def pack_candidates(local: torch.Tensor, start: int, top_k: int) -> torch.Tensor:
    """[P, 2 (1 + top_k)] float32 of one rank's logits ``local`` [P, stop - start]: its best value,
    its top-k values, then their vocabulary ids (as float32: exact below 2**24). A shard narrower
    than ``top_k`` pads with -inf candidates."""
    p, width = local.shape
    best_val, best_idx = local.max(-1)  # the first maximal index, as argmax
    k = min(top_k, width)
    val, idx = local.topk(k, dim=-1)
    if k < top_k:
        val = torch.cat((val, val.new_full((p, top_k - k), float("-inf"))), dim=-1)
        idx = torch.cat((idx, idx.new_zeros((p, top_k - k))), dim=-1)
    return torch.cat((best_val[:, None], val, (best_idx[:, None] + start).float(), (idx + start).float()), dim=-1)


def merge_candidates(every: torch.Tensor, top_k: int) -> torch.Tensor:
    """[P, 1 + top_k] int32 from every rank's :func:`pack_candidates` [world, P, 2 (1 + top_k)]: the
    argmax of the whole vocabulary (ties: the lowest id, as argmax of the unsplit logits) then the
    top-k of all the ranks' candidates.

    Example (2 ranks, top_k 1, one node): rank 0 packs [5., 5., 3., 3.], rank 1 [7., 7., 9., 9.]
    -> [[9, 9]]."""
    n = 1 + top_k
    values, ids = every[..., :n], every[..., n:]  # [world, P, 1 + top_k]
    winner = values[..., 0].argmax(0)  # [P]: the first rank with the highest value
    best = ids[..., 0].gather(0, winner[None]).squeeze(0)  # [P]
    if top_k == 0:
        return best[:, None].to(torch.int32)
    cand_val = values[..., 1:].permute(1, 0, 2).reshape(every.shape[1], -1)  # [P, world * top_k]
    cand_ids = ids[..., 1:].permute(1, 0, 2).reshape(every.shape[1], -1)
    top = cand_val.topk(top_k, dim=-1).indices
    return torch.cat((best[:, None], cand_ids.gather(1, top)), dim=-1).to(torch.int32)


def ids_over_shards(local: torch.Tensor, shard: VocabShard, top_k: int) -> torch.Tensor:
    """[P, 1 + top_k] int32, the same on every rank, from this rank's logits ``local`` [P, width of its slice]."""
    return merge_candidates(shard.gather(pack_candidates(local, shard.start, top_k)), top_k)


def logits_over_shards(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """[P, vocab] float32 logits on every rank from each rank's slice ``local`` [P, stop - start]."""
    p, width = local.shape
    if width < shard.width:  # the short last slices: padded to one width to be gathered
        local = torch.cat((local, local.new_full((p, shard.width - width), float("-inf"))), dim=-1)
    every = shard.gather(local)  # [world, P, width]
    return every.permute(1, 0, 2).reshape(p, -1)[:, : shard.vocab]
