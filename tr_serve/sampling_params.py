"""Per-request decoding options, validated when they are made."""

from __future__ import annotations

from dataclasses import dataclass, field

from tr_serve.engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """``max_tokens`` new tokens at most; stop at any EOS id of the model (unless ``ignore_eos``)
    or after the first occurrence of a ``stop`` string, which is cut from the text.

    ``temperature`` 0 is greedy decoding; above 0 the next token is sampled from the model's
    distribution after temperature, ``top_k`` (0 = off) and ``top_p`` (1.0 = off), applied in
    that order as transformers' logits processors do. ``seed`` makes a sampled request repeatable.
    A bad value raises ``InvalidRequestError`` (a ValueError) whose ``param`` names the field.
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
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise InvalidRequestError(f"temperature must be between 0 and 100, got {self.temperature!r}", "temperature")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}", "top_k")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
