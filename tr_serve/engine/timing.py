"""Wall-clock split of engine steps by phase (forward, propose, accept, ...)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates seconds per phase. On CUDA each phase ends with a synchronize so the split is
    real; that costs a little, so the timer is only on where timing is wanted."""

    def __init__(self, device: torch.device | str = "cpu", enabled: bool = True):
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = enabled
        self._cuda = torch.device(device).type == "cuda"

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self._cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0

    def reset(self) -> None:
        self.seconds.clear()

    def split(self) -> dict[str, float]:
        """Fraction of the timed total spent in each phase."""
        total = sum(self.seconds.values()) or 1.0
        return {k: v / total for k, v in sorted(self.seconds.items())}
