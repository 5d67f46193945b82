"""Per-request decoding options, validated when they are made."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """``max_tokens`` new tokens at most; stop at any EOS id of the model (unless ``ignore_eos``)
    or after the first occurrence of a ``stop`` string, which is cut from the text.

    ``temperature`` 0 is greedy decoding; above 0 the next token is sampled from the model's
    distribution after temperature, ``top_k`` (0 = off) and ``top_p`` (1.0 = off), applied in
    that order as transformers' logits processors do. ``seed`` makes a sampled request repeatable.
    """

    max_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
