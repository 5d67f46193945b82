"""State of one request inside the engine, and what the engine reports about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from tr_serve.engine.detokenizer import IncrementalDetokenizer
from tr_serve.engine.request_context import DEFAULT_CONTEXT, RequestContext
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.context_index import ContextIndex

if TYPE_CHECKING:  # the scheduler imports this file and stays torch-free
    from tr_serve.runner.step_io import RowSampler


class FinishReason(str, Enum):
    STOP = "stop"  # an EOS token or a stop string
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"
    ERROR = "error"  # this request's own processing raised (engine.py); the others go on


@dataclass
class RequestStats:
    """Speculation statistics: ``accepted_per_step[i]`` tokens that verification step i added to
    the output; ``dropped_at_stop`` tokens the last step accepted past a stop point (cut)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held (not prefilled)
    accepted_per_step: list[int] = field(default_factory=list)
    tree_nodes_per_step: list[int] = field(default_factory=list)
    dropped_at_stop: int = 0

    @property
    def verification_steps(self) -> int:
        return len(self.accepted_per_step)

    @property
    def mat(self) -> float:
        """Mean accepted tokens per verification step (1.0 for plain decoding)."""
        return sum(self.accepted_per_step) / max(1, len(self.accepted_per_step))


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    stats: RequestStats
    new_text: str = ""  # the text delta since the previous output of this request
    new_token_ids: tuple[int, ...] = ()


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    row: int = -1  # KV cache row while admitted
    num_prefilled: int = 0  # prompt tokens already written to the KV cache
    finish_reason: FinishReason | None = None
    text: str = ""  # output text, cut at a stop string
    sampler: "RowSampler | None" = None  # how a sampled request draws (its seed included); None: greedy
    context: ContextIndex | None = None  # prompt + output index of the context branch (tr/context_index.py)
    request_context: RequestContext = DEFAULT_CONTEXT  # tenant and per-request switches (engine/request_context.py)
    suffix_doc: int | None = None  # its document in the engine's suffix index (tr/suffix_index.py)
    suffix_fed: int = 0  # prompt + output tokens handed to that document so far
    _sent_chars: int = 0
    _sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def namespace(self) -> str:
        """The tenant: its text drafts for requests of the same namespace only."""
        return self.request_context.tenant

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def token_before_last(self) -> int:
        """The token before :attr:`last_token` (-1 when the prompt was empty): with it, the key of
        the pair table's row (tr/pair_table.py)."""
        if len(self.output_ids) > 1:
            return self.output_ids[-2]
        return self.prompt_ids[-1] if self.prompt_ids else -1

    def failed_output(self) -> RequestOutput:
        """The last output of a request that failed (``FinishReason.ERROR``): nothing of its text."""
        return RequestOutput(self.request_id, "", [], True, self.finish_reason, RequestStats())

    def take_output(self) -> RequestOutput:
        """The output now, with the text and tokens new since the last call. While running, text
        that could be the start of a stop string is held back."""
        visible = len(self.text)
        if not self.finished and self.params.stop:
            hold = max(len(s) for s in self.params.stop) - 1
            visible = max(self._sent_chars, len(self.text) - hold)
        new_text = self.text[self._sent_chars : visible]
        new_ids = tuple(self.output_ids[self._sent_tokens :])
        self._sent_chars, self._sent_tokens = visible, len(self.output_ids)
        stats = RequestStats(self.stats.prompt_tokens, self.stats.cached_tokens, list(self.stats.accepted_per_step),
                             list(self.stats.tree_nodes_per_step), self.stats.dropped_at_stop)  # a snapshot
        return RequestOutput(self.request_id, self.text if self.finished else self.text[:visible],
                             list(self.output_ids), self.finished, self.finish_reason, stats,
                             new_text, new_ids)
