"""What the kernel plan's measurement times: a sample of a forward's linear calls, cut into parts
whose prepacked weight copies fit a memory bound.

Why: timing every kernel at every token count over a whole 1B model's linears is minutes of CPU,
and every prepacked kernel keeps a copy of each weight it is timed on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tr_serve.kernels.cpu_kernels import PREPACKED

# What one measurement packs and times. The plan picks one kernel per token count for every linear
# of the forward, so it compares whole forwards' linears; it times a sample of them:
STREAM_BYTES = 128 << 20  # the first blocks whose weights reach this (each block's calls stand for every block's)
EVICT_BYTES = 64 << 20  # a part smaller than this is timed after this many bytes are written: out of the caches
# the prepacked copies a measurement holds at a time: one copy of the model's largest weight, or this
# much where that is smaller (a small model's parts would only cost time)
PACK_FLOOR_BYTES = 64 << 20


def weight_bytes(call) -> int:
    return call.weight.numel() * call.weight.element_size()


def call_shape(call) -> tuple[int, int, bool]:
    return call.out_features, call.in_features, call.bias is not None


def measurement_sample(calls: list) -> list[tuple[Any, float]]:
    """(call, how many of the forward's calls it stands for), in model order.

    Why a sample: timing every kernel at every count over a whole 1B model's linears is minutes of
    CPU. Where the model is a stack of identical blocks (same shapes in the same order, as
    transformers' decoder layers), the first blocks whose weights reach :data:`STREAM_BYTES`
    stand for all of them (weight = blocks / sampled blocks): enough bytes that a pass streams its
    weights from memory, as a forward does, rather than from a cache. Calls outside the blocks (the
    LM head) are timed themselves. Anything else: every call, weight 1."""
    blocks: dict[int, list] = {}
    for c in calls:
        layer = getattr(c, "layer", None)
        if layer is not None:
            blocks.setdefault(layer, []).append(c)
    if len(blocks) < 2 or len({tuple(call_shape(c) for c in cs) for cs in blocks.values()}) != 1:
        return [(c, 1.0) for c in calls]
    chosen, size = set(), 0
    for layer, cs in blocks.items():  # in model order
        chosen.add(layer)
        size += sum(weight_bytes(c) for c in cs)
        if size >= STREAM_BYTES:
            break
    weight = len(blocks) / len(chosen)
    out = []
    for c in calls:
        layer = getattr(c, "layer", None)
        if layer is None:
            out.append((c, 1.0))
        elif layer in chosen:
            out.append((c, weight))
    return out


@dataclass
class Part:
    """Consecutive calls of the sample packed together, and the kernels timed together over them:
    one phase per group of prepacked kernels whose copies fit the memory bound."""

    calls: list
    weight: float
    phases: list[list[str]]

    @property
    def bytes(self) -> int:
        return sum(weight_bytes(c) for c in self.calls)


def memory_parts(sample: list[tuple[Any, float]], kernels: list[str], budget: int) -> list[Part]:
    """The sample cut into parts whose prepacked copies together stay within ``budget`` bytes (the
    largest weight: one extra copy of it at a time). Parts of one weight are cut evenly, so none is
    a small remainder; a call too large to pack for every prepacked kernel at once gets a phase per
    kernel (the kernels without a copy are timed in the first)."""
    prepacked = [k for k in kernels if k in PREPACKED]
    plain = [k for k in kernels if k not in PREPACKED]
    limit = budget / max(1, len(prepacked))
    runs: list[tuple[float, list]] = []  # consecutive calls of one weight
    for c, w in sample:
        if runs and runs[-1][0] == w:
            runs[-1][1].append(c)
        else:
            runs.append((w, [c]))
    parts = []
    for w, cs in runs:
        pieces = max(1, math.ceil(sum(weight_bytes(c) for c in cs) / max(1.0, limit)))
        target = sum(weight_bytes(c) for c in cs) / pieces
        current, size = [], 0
        for c in cs:
            b = weight_bytes(c)
            if current and size + b > limit:  # never over the limit (but a single call may be)
                parts.append(Part(current, w, []))
                current, size = [], 0
            current.append(c)
            size += b
            if size >= target:
                parts.append(Part(current, w, []))
                current, size = [], 0
        if current:
            parts.append(Part(current, w, []))
    for part in parts:
        if part.bytes * len(prepacked) <= budget or len(prepacked) <= 1:
            part.phases = [list(kernels)]
        else:
            part.phases = [plain + prepacked[:1]] + [[k] for k in prepacked[1:]]
    return parts
