"""The decoding engine: ``step()`` = schedule -> run the model -> postprocess.

A step either prefills newly admitted requests (one ragged forward) or verifies one draft tree per
running request (one forward for the whole batch). Token Recycling lives in ``tr_serve.tr``; this
file only wires it to the runner and to the requests' stop rules.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import torch

from tr_serve.engine.config import EngineConfig
from tr_serve.engine.detokenizer import IncrementalDetokenizer
from tr_serve.engine.errors import PromptTooLongError
from tr_serve.engine.gc_heap import freeze_long_lived_heap
from tr_serve.engine.prompt import check_prompt
from tr_serve.engine.core import RemoteRunner
from tr_serve.engine.request import Request, RequestOutput
from tr_serve.engine.scheduler import EngineLoad, PrefillChunk, Scheduler
from tr_serve.engine.stopping import append_token
from tr_serve.engine.timing import PhaseTimer
from tr_serve.model_loader import LoadedModel
from tr_serve.runner.cpu_kernels import select_plan
from tr_serve.runner.model_runner import ModelRunner, rows_within_budget
from tr_serve.runner.sampler import request_seed
from tr_serve.runner.step_io import NextTokens, RowSampler, StepSampling
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.step_latency import StepLatency
from tr_serve.tr.draft import DraftBatch
from tr_serve.tr.drafter import Drafter
from tr_serve.tr.matrix import EMPTY, AdjacencyMatrix, last_occurrences
from tr_serve.tr.pair_table import PairTable
from tr_serve.tr.suffix_index import DEFAULT_NAMESPACE, SuffixIndex
from tr_serve.tr.tree import compile_tree, load_template
from tr_serve.tr.tree_spec import parse_tree_spec
from tr_serve.tr.verifier import accept_draft, choices_grid

_ids = itertools.count()

__all__ = ["Engine", "PromptTooLongError"]  # PromptTooLongError: engine/errors.py, importable from here as before


class Engine:
    """The ``EngineCore`` (engine/core.py) of a replica: the scheduler (engine/scheduler.py) decides
    what each step runs; this class runs it through the model runner and the TR pipeline."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, matrix: AdjacencyMatrix | None = None,
                 timer: PhaseTimer | None = None, runner: Callable[[int], tuple[Any, int]] | None = None):
        """``runner``: None runs the model in this process (a ``ModelRunner`` over
        ``loaded.model``); otherwise a factory ``runner(max_len) -> (runner, num_rows)`` of another
        implementation of the runner contract that sizes its own KV cache for rows of ``max_len``
        tokens (tensor parallel: ``tr_serve.tp.runner.TPModelRunner.allocate``); ``loaded.model``
        is then not used."""
        freeze_long_lived_heap()  # the libraries and the loaded model, before this engine's own objects
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.eos_ids = frozenset(loaded.eos_token_ids)
        self.spec = parse_tree_spec(config.tree, config.budget)
        template = None
        if self.spec.template is not None:
            name, paths = load_template(self.spec.template, config.k)
            template = compile_tree(paths, name=name)
        scratch = (template.num_nodes if template is not None else 0) + (Drafter.context_tokens(self.spec) + 1)
        max_len = config.max_model_len + scratch
        if runner is None:
            dtype = next(loaded.model.parameters()).dtype
            self.num_rows = rows_within_budget(loaded.model.config, max_len, dtype, config.max_num_seqs,
                                               config.kv_cache_memory_gb)
            plan = select_plan(loaded.model) if config.cpu_kernels == "auto" else None  # None unless fp32 on CPU
            self.runner = ModelRunner(loaded.model, self.num_rows, max_len, kernel_plan=plan,
                                     tree_attention_enabled=config.cpu_kernels == "auto")
        else:
            self.runner, self.num_rows = runner(max_len)
        vocab = self.runner.vocab_size
        # the matrix lives on the host whatever the model's device: drafting reads it there and the
        # step's one copy from the device brings the top-k ids it recycles (runner/step_io.py)
        self.matrix = matrix if matrix is not None else AdjacencyMatrix(vocab, config.k)
        if self.spec.uses_matrix and config.matrix_prior and runner is None:
            self._seed_prior(loaded, vocab)
        self.pairs = (PairTable(vocab, config.k, config.pair_table_slots, device=self.matrix.device)
                      if self.uses_pairs else None)
        # the prompts and outputs of this replica's requests, drafting for the others (tr/suffix_index.py)
        self.suffix = SuffixIndex(config.suffix_index_tokens) if self.uses_suffix else None
        self.timer = timer or PhaseTimer(self.runner.device, enabled=False)
        self.drafter: Drafter | None = None
        if not self.spec.plain:
            latency = None
            if self.spec.auto_budget:  # cost-aware budget: the step latency measured on this device
                from tr_serve.runner.calibration import load_or_measure

                max_q = self.num_rows * (scratch + 1)
                recycle_k = config.k if self.spec.uses_matrix else 0
                latency = StepLatency(load_or_measure(self.runner, loaded.model_id, max_q, recycle_k))
            self.drafter = Drafter(self.spec, template, self.matrix, latency, self.pairs, self.suffix)
        self.scheduler = Scheduler(self.num_rows, config.max_prefill_tokens)

    def _seed_prior(self, loaded: LoadedModel, vocab: int) -> None:
        """Fill the matrix's empty rows with the model's prior (runner/matrix_prior.py); a matrix
        handed in keeps every row it has learned."""
        from tr_serve.runner.matrix_prior import load_or_compute

        bos = getattr(loaded.tokenizer, "bos_token_id", None)
        self.matrix.seed(load_or_compute(loaded.model, loaded.model_id, vocab, self.config.k, bos))

    # ---- the scheduler's state, for tests and tools ----------------------------------------------
    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def prefilling(self) -> list[Request]:
        return self.scheduler.prefilling

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def free_rows(self) -> list[int]:
        return self.scheduler.free_rows

    # ---- EngineHandle ---------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        return self.scheduler.load()

    def check_health(self) -> None:
        """A runner with workers elsewhere (tensor parallel) is pinged; an in-process one is fine."""
        if isinstance(self.runner, RemoteRunner):
            self.runner.check_health()

    def shutdown(self) -> None:
        if isinstance(self.runner, RemoteRunner):
            self.runner.shutdown()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    namespace: str = DEFAULT_NAMESPACE) -> str:
        """``namespace``: the request's tenant; the suffix index drafts for it from the text of
        requests of the same namespace only."""
        check_prompt(prompt_ids, self.config.max_model_len)
        req = Request(request_id or f"req-{next(_ids)}", list(prompt_ids), params,
                      IncrementalDetokenizer(self.tokenizer), namespace=namespace)
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
        """Admit what fits, then run one forward: a prefill chunk, or one tree per decoding row
        (the scheduler alternates them while prompts are being prefilled)."""
        self._retire(self.scheduler.finished_in_rows())
        for req in self.scheduler.admit():
            if self.drafter is not None:
                req.context = self.drafter.new_context_index()
            if self.suffix is not None:
                req.suffix_doc = self.suffix.open(req.namespace)
        if self.scheduler.prefill_turn():
            batch = self._prefill(self.scheduler.prefill_chunks())
            batch = [r for r in batch if r.output_ids]  # only requests whose prompt is complete
        else:
            batch = self.scheduler.decode_batch()
            if not batch:
                return []
            self._decode(batch)
        outputs = [r.take_output() for r in batch]
        self._retire([r for r in batch if r.finished])
        return outputs

    def _retire(self, done: list[Request]) -> None:
        if self.suffix is not None:
            for req in done:  # the tokens of its last step, which no draft has synced
                self._sync_suffix(req)
        for row in self.scheduler.retire(done):
            self.runner.free(row)

    def _prefill(self, plan: list[PrefillChunk]) -> list[Request]:
        """One ragged forward over the chunks the scheduler planned; requests whose prompt is
        complete get their first token and start decoding."""
        batch = [c.request for c in plan]
        chunks = [c.tokens for c in plan]
        rows = torch.tensor([r.row for r in batch])
        seeding = self.seeds_prompts
        seeds = [last_occurrences(c) for c in chunks] if seeding else None  # the positions recycle keeps
        with self.timer.phase("prefill"):
            out = self.runner.prefill_step(rows, chunks, self._sampling(batch), seed_positions=seeds)
        done = []
        for i, (req, chunk) in enumerate(zip(batch, chunks)):
            start = req.num_prefilled
            req.num_prefilled += len(chunk)
            if self.spec.uses_matrix:
                with self.timer.phase("recycle"):
                    if seeding:
                        keep = seeds[i]
                        self.matrix.recycle(torch.tensor(chunk)[keep], out.seeds[i], pairs=self.pairs,
                                            before=self._prompt_tokens_before(req, start, keep))
                    elif req.num_prefilled == len(req.prompt_ids):
                        self.matrix.recycle(torch.tensor(chunk[-1:]), out.last.top_k[i : i + 1], pairs=self.pairs,
                                            before=self._prompt_tokens_before(req, start, [len(chunk) - 1]))
            if req.num_prefilled == len(req.prompt_ids):
                done.append((req, int(out.last.choices[i])))
        with self.timer.phase("postprocess"):
            for req, token in done:
                self.scheduler.start_decoding(req)
                append_token(req, token, self.eos_ids, self._context_full(req))
        return batch

    def _prompt_tokens_before(self, req: Request, start: int, positions: list[int]) -> torch.Tensor | None:
        """The token before each of ``positions`` of the prompt chunk starting at ``start`` (-1 at
        the prompt's first token): the pair table's keys; None without a pair table."""
        if self.pairs is None:
            return None
        return torch.tensor([req.prompt_ids[start + j - 1] if start + j > 0 else EMPTY for j in positions])

    @property
    def seeds_prompts(self) -> bool:
        """Whether prefill also recycles the prompt positions' logits into the matrix (the LM head
        over every distinct prompt token's last position). By default fixed templates do (MAT 2.21
        -> 2.31 for ``2.2.2``) and the cost-aware budget does not: with its context branch and a
        hot matrix, seeding measured MAT 1.79 vs 1.78 on one stream and no gain at 4-16 clients,
        where it cost 2-3% of the wall time (prefill is a third to a half of it there)."""
        if not self.spec.uses_matrix:
            return False
        if self.config.prompt_seeding is None:
            return not self.spec.auto_budget
        return self.config.prompt_seeding

    @property
    def uses_suffix(self) -> bool:
        """Whether the cross-request suffix index (tr/suffix_index.py) drafts a branch beside each
        row's context. By default ``auto`` does; ``suffix_index: false`` turns it off. Only under the
        cost-aware budget, which prices its branch (EngineConfig refuses it elsewhere)."""
        if not self.spec.prices_branches:
            return False
        return True if self.config.suffix_index is None else self.config.suffix_index

    @property
    def uses_pairs(self) -> bool:
        """Whether the drafts also come from the pair table (tr/pair_table.py). By default the
        fixed hybrid templates' do (``<template>+ctx``: MAT 2.68 -> 2.89 for ``2.2.2+ctx``, 1.89 ->
        1.93 for ``top8+ctx``, 13 dev questions); a bare template's do not, so that ``tr:2.2.2``
        stays the paper's method; nor do ``auto``'s, where it is not a measured gain: with the
        pair table's chain as the branch of rows with no context match, MAT 1.75 -> 1.85 on 26
        questions after 13 warm-up ones, but 1.70 in ``tr-serve bench`` (one warm-up question)
        against 1.72-1.76 without it, 1.44x baseline against 1.46-1.51x (``pair_table: true``
        turns it on)."""
        if not self.spec.uses_matrix:
            return False
        if self.config.pair_table is None:
            return self.spec.context and not self.spec.auto_budget
        return self.config.pair_table

    def _sampling(self, batch: list[Request]) -> StepSampling:
        """How the runner picks each row's next tokens, and how many top-k ids the matrix recycles."""
        return StepSampling(tuple(r.sampler for r in batch), self.matrix.k if self.spec.uses_matrix else 0)

    def _draft(self, batch: list[Request]) -> DraftBatch:
        roots = torch.tensor([r.last_token for r in batch])
        if self.drafter is None:
            return Drafter.plain(roots)
        contexts, room = None, None
        if self.spec.context:
            contexts = [self._synced_context(r) for r in batch]
            room = [min(r.params.max_tokens - len(r.output_ids),
                        self.config.max_model_len - len(r.prompt_ids) - len(r.output_ids)) for r in batch]
        before = torch.tensor([r.token_before_last for r in batch]) if self.pairs is not None else None
        documents = None
        if self.suffix is not None:
            documents = [self._sync_suffix(r) for r in batch]
        return self.drafter.draft(roots, contexts, room, before, documents)

    def _sync_suffix(self, req: Request) -> int | None:
        """The request's suffix-index document, caught up with its prompt and output (None when it
        has none: admitted before the index, or never admitted)."""
        doc = req.suffix_doc
        if doc is None:
            return None
        p, fed = len(req.prompt_ids), req.suffix_fed
        if fed < p:
            self.suffix.extend(doc, req.prompt_ids[fed:])
            fed = p
        if fed - p < len(req.output_ids):
            self.suffix.extend(doc, req.output_ids[fed - p :])
        req.suffix_fed = p + len(req.output_ids)
        return doc

    @staticmethod
    def _synced_context(req: Request):
        """The request's context index, caught up with its prompt and output."""
        ctx = req.context
        done, p = len(ctx), len(req.prompt_ids)
        if done < p:
            ctx.extend(req.prompt_ids[done:])
            done = p
        ctx.extend(req.output_ids[done - p :])
        return ctx

    def _decode(self, batch: list[Request]) -> None:
        rows = torch.tensor([r.row for r in batch])
        with self.timer.phase("propose"):
            draft = self._draft(batch)
        t0 = time.perf_counter()
        with self.timer.phase("forward"):
            out: NextTokens = self.runner.verify_step(rows, draft.tokens, draft.depths, draft.mask, draft.lengths,
                                                      self._sampling(batch))
        with self.timer.phase("accept"):
            # sampled rows walk their tree over their draws exactly as greedy rows over their argmax
            acceptance = accept_draft(draft, choices_grid(draft, out.choices))
            seconds = time.perf_counter() - t0 if self.config.online_latency else None
            accepted, emitted = acceptance.accepted_nodes, acceptance.emitted
            if self.drafter is not None:
                self.drafter.observe(draft, acceptance, seconds)
        with self.timer.phase("compact"):
            self.runner.compact(rows, accepted)
        if self.spec.uses_matrix:
            with self.timer.phase("recycle"):
                on_path = acceptance.accepted_mask.numpy()  # the nodes each row kept
                real = draft.real_nodes()  # the runner's ids are the real nodes', packed in row order
                before = draft.tokens_before() if draft.before_roots is not None else None
                if real is None:
                    self.matrix.recycle(draft.tokens.reshape(-1), out.top_k,
                                        preferred=torch.from_numpy(on_path.reshape(-1)), pairs=self.pairs,
                                        before=before.reshape(-1) if before is not None else None)
                else:
                    self.matrix.recycle(draft.tokens[real], out.top_k, preferred=torch.from_numpy(on_path[real.numpy()]),
                                        pairs=self.pairs, before=before[real] if before is not None else None)
        with self.timer.phase("postprocess"):
            for req, emit, nodes in zip(batch, emitted, draft.nodes_per_row()):
                kept = 0  # tokens of this step that made it into the output (a stop cuts the rest)
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

