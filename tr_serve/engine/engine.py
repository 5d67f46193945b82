"""The decoding engine: ``step()`` = schedule -> propose -> verify -> accept -> stop rules.

A step verifies one draft tree per running request (one forward for the whole batch) and, beside
it, prefills chunks of admitted prompts (one ragged forward) under the step's token budget
(``max_num_batched_tokens``: the trees' nodes first). Token Recycling lives behind the speculator
(tr/speculator.py); this file wires it to the scheduler, the runner and the requests' stop rules.
"""

from __future__ import annotations

import itertools
import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from tr_serve.engine.config import EngineConfig
from tr_serve.engine.core import RemoteRunner
from tr_serve.engine.detokenizer import IncrementalDetokenizer
from tr_serve.engine.gc_heap import freeze_long_lived_heap
from tr_serve.engine.prompt import check_prompt
from tr_serve.engine.request import FinishReason, Request, RequestOutput
from tr_serve.engine.request_context import DEFAULT_CONTEXT, RequestContext
from tr_serve.engine.scheduler import EngineLoad, PrefillChunk, Scheduler
from tr_serve.engine.stopping import append_token
from tr_serve.engine.timing import PhaseTimer
from tr_serve.model_loader import LoadedModel
from tr_serve.runner.calibration import load_or_measure
from tr_serve.runner.factory import local_runner
from tr_serve.runner.sampler import request_seed
from tr_serve.runner.step_io import RowSampler, StepRunner, StepSampling
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.draft import DraftBatch
from tr_serve.tr.speculator import AdjacencyMatrix, Speculator

_ids = itertools.count()
logger = logging.getLogger(__name__)


@contextmanager
def _fails_alone(req: Request) -> Iterator[None]:
    """An exception in one request's own processing (its stop rules, detokenizer, suffix document)
    finishes that request with ``FinishReason.ERROR``, logged with its traceback; the step goes on
    for the others. The batched forward is not wrapped: its failure leaves every row's state unknown."""
    try:
        yield
    except Exception:
        logger.exception("tr_serve: request %s failed", req.request_id)
        req.finish_reason = FinishReason.ERROR


class Engine:
    """The ``EngineCore`` (engine/core.py) of a replica: the scheduler (engine/scheduler.py) decides
    what each step runs, the runner runs it, the speculator (tr/speculator.py) drafts and learns."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, matrix: AdjacencyMatrix | None = None,
                 timer: PhaseTimer | None = None, runner: Callable[[int], StepRunner] | None = None):
        """``matrix``: an ``AdjacencyMatrix`` to start from (its learned rows are kept).
        ``runner``: None runs the model in this process (runner/factory.py over ``loaded.model``);
        otherwise ``runner(max_len)`` builds another runner of the contract (runner/step_io.py),
        which sizes its own KV cache for rows of ``max_len`` tokens (tensor parallel:
        ``tr_serve.tp.runner.TPModelRunner.allocate``); ``loaded.model`` is then not used."""
        freeze_long_lived_heap()  # the libraries and the loaded model, before this engine's own objects
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.eos_ids = frozenset(loaded.eos_token_ids)
        max_len = config.max_model_len + Speculator.kv_scratch(config)
        if runner is None:
            self.runner = local_runner(loaded.model, max_len, config.max_num_seqs, config.kv_cache_memory_gb,
                                       config.cpu_kernels, decoder=config.decoder, compile=config.compile)
        else:
            self.runner = runner(max_len)
        self.num_rows = self.runner.num_rows
        self.speculator = Speculator(config, self.runner.vocab_size, self.num_rows, matrix,
                                     lambda max_q, k, adopt: load_or_measure(self.runner, loaded.model_id, max_q, k,
                                                                             adopt))
        if self.speculator.uses_matrix and config.matrix_prior and runner is None:
            self._seed_prior(loaded)
        # what the fleet shares (fleet/sync.py)
        self.matrix, self.suffix = self.speculator.matrix, self.speculator.suffix
        self.tenant_matrices = self.speculator.tenant_rows
        self.timer = timer or PhaseTimer(self.runner.device, enabled=False)
        self.scheduler = Scheduler(self.num_rows, config.batched_tokens, config.enable_prefix_caching,
                                   config.block_size, config.mixed_prefill_tokens)
        self._forwards = self.runner.forwards  # the runner's forwards this engine knows of

    def _seed_prior(self, loaded: LoadedModel) -> None:
        """The matrix's empty rows from the model's prior (runner/matrix_prior.py)."""
        from tr_serve.runner.matrix_prior import load_or_compute

        bos = getattr(loaded.tokenizer, "bos_token_id", None)
        self.speculator.seed_prior(load_or_compute(loaded.model, loaded.model_id, self.runner.vocab_size,
                                                   self.config.k, bos))

    # ---- the scheduler's state, for tools (scripts/gpu_check.py) ----------------------------------
    @property
    def prefilling(self) -> list[Request]:
        return self.scheduler.prefilling

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # ---- EngineHandle ---------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        return self.scheduler.load()

    def tenant_matrix_stats(self) -> dict[str, int] | None:
        overlays = self.speculator.tenant_rows
        return overlays.totals() if overlays is not None else None

    def check_health(self) -> None:
        """A runner with workers elsewhere (tensor parallel) is pinged; an in-process one is fine."""
        if isinstance(self.runner, RemoteRunner):
            self.runner.check_health()

    def shutdown(self) -> None:
        if isinstance(self.runner, RemoteRunner):
            self.runner.shutdown()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    namespace: str | None = None, context: RequestContext | None = None) -> str:
        """``context``: the request's tenant and switches (engine/request_context.py; None: the
        shared tenant, speculation and learning on); ``namespace``: the tenant alone, as a shorthand.
        Only the shared tenant's requests teach the matrix every request drafts from; the suffix
        index drafts for a tenant from its own requests' text only."""
        if context is None:
            context = RequestContext(tenant=namespace) if namespace is not None else DEFAULT_CONTEXT
        check_prompt(prompt_ids, self.config.max_model_len)
        req = Request(request_id or f"req-{next(_ids)}", list(prompt_ids), params,
                      IncrementalDetokenizer(self.tokenizer))
        req.request_context = context
        self.scheduler.add(req)  # ValueError for an id in use, before anything else is made for it
        if not params.greedy:
            req.sampler = RowSampler(params.temperature, params.top_k, params.top_p, request_seed(params.seed))
        req.stats.prompt_tokens = len(prompt_ids)
        return req.request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)  # a request holding a row is retired at the next step

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule; draft a tree per decoding row; prefill what the token budget leaves beside the
        trees' nodes (one forward), then verify the trees (one forward); then the stop rules."""
        self._retire(self.scheduler.finished_in_rows())
        if self.runner.forwards != self._forwards:  # another caller (the latency calibration) wrote free rows
            self.scheduler.prefix_cache.forget_free_rows()
        for req, placement in self.scheduler.admit():
            if placement.cached:  # the prompt's cached blocks: its prefill starts after them
                self.runner.reuse_prefix(placement.row, placement.source, placement.cached)
            self.speculator.admit(req)
        decoding = self.scheduler.decode_batch()
        draft = None
        if decoding:
            with self.timer.phase("propose"):
                draft = self.speculator.propose(decoding)
        plan = self.scheduler.prefill_chunks(draft.num_inputs if draft is not None else 0)
        batch = []
        if plan:  # first: the rows that complete their prompt here decode from the next step
            batch = [r for r in self._prefill(plan) if r.output_ids or r.finished]  # prompt complete, or failed
        if draft is not None:
            self._decode(decoding, draft)
            batch += decoding
        outputs = [self._output(r) for r in batch]
        self._retire([r for r in batch if r.finished])
        return outputs

    @staticmethod
    def _output(req: Request) -> RequestOutput:
        with _fails_alone(req):
            if req.finish_reason is not FinishReason.ERROR:
                return req.take_output()
        return req.failed_output()

    def _retire(self, done: list[Request]) -> None:
        for req in done:
            with _fails_alone(req):
                self.speculator.finish(req)
        # what each row's KV holds of its request's tokens, findable by later prompts of its tenant
        kv_tokens = [min(self.runner.length(r.row), len(r.prompt_ids) + len(r.output_ids)) if r.row >= 0 else 0
                     for r in done]
        for row in self.scheduler.retire(done, kv_tokens):
            self.runner.free(row)

    def _sampling(self, batch: list[Request]) -> StepSampling:
        """How the runner picks each row's next tokens, and how many top-k ids come back for the matrix."""
        return StepSampling(tuple(r.sampler for r in batch), self.speculator.recycle_k)

    def _prefill(self, plan: list[PrefillChunk]) -> list[Request]:
        """One ragged forward over the chunks the scheduler planned; requests whose prompt is
        complete get their first token and start decoding."""
        batch = [c.request for c in plan]
        chunks = [c.tokens for c in plan]
        rows = torch.tensor([r.row for r in batch])
        seeds = self.speculator.seed_positions(chunks)
        with self.timer.phase("prefill"):
            out = self.runner.prefill_step(rows, chunks, self._sampling(batch), seed_positions=seeds)
        self._forwards = self.runner.forwards
        starts = [r.num_prefilled for r in batch]
        for req, chunk in zip(batch, chunks):
            req.num_prefilled += len(chunk)
        if self.speculator.uses_matrix:
            with self.timer.phase("recycle"):
                self.speculator.seed(batch, chunks, starts, seeds, out)
        with self.timer.phase("postprocess"):
            for i, req in enumerate(batch):
                if req.num_prefilled == len(req.prompt_ids):
                    self.scheduler.start_decoding(req)
                    with _fails_alone(req):
                        append_token(req, int(out.last.choices[i]), self.eos_ids, self._context_full(req))
        return batch

    def _decode(self, batch: list[Request], draft: DraftBatch) -> None:
        """Verify ``draft`` (one forward) -> accept -> keep the accepted KV -> recycle -> stop rules."""
        rows = torch.tensor([r.row for r in batch])
        started = time.perf_counter()
        with self.timer.phase("forward"):
            out = self.runner.verify_step(rows, draft.tokens, draft.depths, draft.mask, draft.lengths,
                                          self._sampling(batch))
        self._forwards = self.runner.forwards
        with self.timer.phase("accept"):
            acceptance = self.speculator.accept(draft, out, started)
        with self.timer.phase("compact"):
            self.runner.compact(rows, acceptance.accepted_nodes)
        if self.speculator.uses_matrix:
            with self.timer.phase("recycle"):
                self.speculator.recycle(draft, acceptance, out, batch)
        with self.timer.phase("postprocess"):
            for req, emit, nodes in zip(batch, acceptance.emitted, draft.nodes_per_row()):
                kept = 0  # tokens of this step that made it into the output (a stop cuts the rest)
                with _fails_alone(req):
                    for token in emit.tolist():
                        kept += 1
                        if append_token(req, token, self.eos_ids, self._context_full(req)):
                            break
                req.stats.accepted_per_step.append(kept)
                req.stats.dropped_at_stop = len(emit) - kept
                req.stats.tree_nodes_per_step.append(nodes)

    def _context_full(self, req: Request) -> bool:
        # called before the token is appended: True when that token is the last one that fits
        return len(req.prompt_ids) + len(req.output_ids) + 1 >= self.config.max_model_len
