"""Sampling every node of a draft tree at once, on the logits' device, losslessly.

Speculative sampling on a tree walks from the root: at each node one token is drawn from the
model's processed distribution there; if a drafted child holds it the walk moves on, otherwise the
drawn token is the last one emitted. Done node by node that is one host round trip per emitted
token. Here the draw of *every* node is made in one batched operation, and the walk becomes the
greedy walk over those draws (tr/verifier.py): a node's draw is the token the request would have
drawn at that position, because each draw takes its randomness from the request's seed and the
position of the token drawn, not from a stream consumed in order. So

* every emitted token is a draw from exactly the distribution plain sampling would use (inverse
  CDF of the processed probabilities with a uniform that is independent across positions), and
* a seeded request gives the same tokens with or without a tree, at any batch size, on any rank.

Siblings at one depth share their uniform; only one of them is ever on the accepted path.
"""

from __future__ import annotations

import numpy as np
import torch

from tr_serve.runner.step_io import RowSampler

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_MASK63 = (1 << 63) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on uint64 arrays (wraps modulo 2**64, as the algorithm wants)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        return x ^ (x >> np.uint64(31))


def position_uniforms(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """[m] float64 in [0, 1): the uniform of the draw of the token at ``positions`` [m] of the
    requests seeded ``seeds`` [m]. Computed on the host from small integers (no device work)."""
    s = np.asarray(seeds, dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    x = _splitmix64(_splitmix64(s) ^ p)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def request_seed(seed: int | None) -> int:
    """The 63-bit seed a sampled request draws with: its own, or a fresh random one."""
    if seed is None:
        return int(np.random.default_rng().integers(0, _MASK63))
    return int(seed) & _MASK63


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Probabilities [.., V] after temperature, top-k, then top-p (transformers' warper order and
    rules: top-p removes the low tail whose cumulative mass is <= 1 - top_p, keeping at least one)."""
    scores = logits.float() / temperature
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(dim=-1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[m] int64: for each row of ``probs`` [m, V], the token whose cumulative-probability interval
    holds ``uniforms`` [m] (inverse CDF; a token of probability 0 is never drawn). Stays on the
    device: no host synchronisation."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    # rounding can put the target at the very top of the CDF, past the last token with mass
    last_with_mass = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.where(probs.gather(1, token[:, None]).squeeze(1) > 0, token, last_with_mass)


def sample_rows(logits: torch.Tensor, node_rows: np.ndarray, node_positions: np.ndarray,
                samplers: tuple[RowSampler | None, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Draws for the inputs of sampled rows.

    logits          [n, V] on the device, one row per input of the step
    node_rows       [n] host: the step row each input belongs to
    node_positions  [n] host: the position of the token each input is followed by
    samplers        per step row, None (greedy) or how it samples

    Returns (indices [m] of the sampled inputs, their draws [m]), both on the logits' device, or
    None when no row samples. Rows with the same settings are processed together."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for r, s in enumerate(samplers):
        if s is not None:
            groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(r)
    if not groups:
        return None
    seeds = np.array([s.seed if s is not None else 0 for s in samplers], dtype=np.uint64)
    picked, draws = [], []
    for (temperature, top_k, top_p), rows in groups.items():
        nodes = np.flatnonzero(np.isin(node_rows, rows))
        if nodes.size == 0:
            continue
        u = position_uniforms(seeds[node_rows[nodes]], node_positions[nodes])
        index = torch.from_numpy(nodes).to(logits.device, non_blocking=True)
        probs = process_logits(logits.index_select(0, index), temperature, top_k, top_p)
        draws.append(draw(probs, torch.from_numpy(u).to(logits.device, non_blocking=True)))
        picked.append(index)
    if not picked:
        return None
    return torch.cat(picked), torch.cat(draws)


__all__ = ["draw", "position_uniforms", "process_logits", "request_seed", "sample_rows"]
