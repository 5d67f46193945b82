"""The engine's one entry into Token Recycling: what each step drafts, what verification accepts,
and what the model's top-k ids teach the tables.

The engine schedules and runs the model; the speculator owns the rest of a step's speculation:
the adjacency matrix, the pair table, the cross-request suffix index, the drafter (its template
and, under ``auto``, its budget), each request's context index, and the rules of when each is used.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch

from tr_serve.engine.request_context import SHARED_TENANT, RequestContext
from tr_serve.runner.step_io import NextTokens, PrefillOutput
from tr_serve.sampling_params import SamplingParams
from tr_serve.tr.context_index import ContextIndex
from tr_serve.tr.draft import DraftBatch
from tr_serve.tr.drafter import Drafter
from tr_serve.tr.matrix import EMPTY, AdjacencyMatrix, last_occurrences
from tr_serve.tr.pair_table import PairTable
from tr_serve.tr.step_latency import LatencyTable, StepLatency
from tr_serve.tr.suffix_index import SuffixIndex
from tr_serve.tr.tenant_rows import TenantMatrices
from tr_serve.tr.tree import CompiledTree, compile_tree, load_template
from tr_serve.tr.tree_spec import TreeSpec, parse_tree_spec
from tr_serve.tr.verifier import Acceptance, accept_draft, choices_grid


class SpeculationSettings(Protocol):
    """The settings the speculator reads; ``EngineConfig`` (engine/config.py) has them all."""

    tree: str
    budget: str
    k: int
    max_model_len: int
    prompt_seeding: bool | None
    pair_table: bool | None
    pair_table_slots: int
    suffix_index: bool | None
    suffix_index_tokens: int
    tenant_matrix_rows: int
    online_latency: bool


class SpeculatedRequest(Protocol):
    """What the speculator reads of a request, and the state it keeps there (engine/request.py)."""

    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    namespace: str
    context: ContextIndex | None  # prompt + output, indexed for the row's context branch
    suffix_doc: int | None  # its document in the suffix index
    suffix_fed: int  # prompt + output tokens handed to that document so far
    request_context: RequestContext  # its tenant and switches (engine/request_context.py)

    @property
    def last_token(self) -> int:
        ...

    @property
    def token_before_last(self) -> int:
        ...


# (max query tokens, recycled top-k per node, adopt) -> the step latency measured on the runner's
# device; a provisional table now may be followed by the full one, handed to adopt later (on the
# step thread, between steps: runner/calibration.py)
Calibrate = Callable[[int, int, Callable[[LatencyTable], None]], LatencyTable]


def _load_tree(settings: SpeculationSettings) -> tuple[TreeSpec, CompiledTree | None]:
    spec = parse_tree_spec(settings.tree, settings.budget)
    if spec.template is None:
        return spec, None
    name, paths = load_template(spec.template, settings.k)
    return spec, compile_tree(paths, name=name)


class Speculator:
    """Proposes each step's draft trees, accepts against the model's choices, recycles the model's
    top-k into the matrix (and the pair table), and feeds the suffix index; ``rows``: the runner's
    KV-cache rows, ``calibrate``: measures the step latency the cost-aware budget prices drafts by."""

    def __init__(self, settings: SpeculationSettings, vocab_size: int, rows: int,
                 matrix: AdjacencyMatrix | None = None, calibrate: Calibrate | None = None):
        self.settings = settings
        self.spec, self.template = _load_tree(settings)
        # on the host whatever the model's device: drafting reads it there, and the step's one copy
        # from the device brings the top-k ids it recycles (runner/step_io.py)
        self.matrix = matrix if matrix is not None else AdjacencyMatrix(vocab_size, settings.k)
        self.pairs = PairTable(vocab_size, settings.k, settings.pair_table_slots) if self.uses_pairs else None
        # a named tenant's own rows, over the shared ones (tr/tenant_rows.py)
        self.tenant_rows = TenantMatrices(self.matrix, settings.tenant_matrix_rows) if self.uses_matrix else None
        self.suffix = SuffixIndex(settings.suffix_index_tokens) if self.uses_suffix else None
        self.drafter: Drafter | None = None
        if not self.spec.plain:
            latency = None
            if self.spec.auto_budget:
                if calibrate is None:
                    raise ValueError("the cost-aware budget needs the step latency: pass calibrate")
                latency = StepLatency(calibrate(rows * (self.kv_scratch(settings) + 1), self.recycle_k,
                                                self.adopt_latency_table))
            self.drafter = Drafter(self.spec, self.template, self.matrix, latency, self.pairs, self.suffix)

    def adopt_latency_table(self, table: LatencyTable) -> None:
        """Price drafts by ``table`` from now on (the full table measured after start-up in place
        of the provisional one); what was learned online against the old table starts over."""
        self.drafter.adopt_latency_table(table)

    @staticmethod
    def kv_scratch(settings: SpeculationSettings) -> int:
        """KV-cache slots a row needs past ``max_model_len``: a step's tree (root, template, context branch)."""
        spec, template = _load_tree(settings)
        return (template.num_nodes if template is not None else 0) + Drafter.context_tokens(spec) + 1

    # ---- policy: what is used, by default ---------------------------------------------------------
    @property
    def uses_matrix(self) -> bool:
        return self.spec.uses_matrix

    @property
    def recycle_k(self) -> int:
        """Top-k ids per input the runner sends back for the matrix (0: nothing recycled)."""
        return self.matrix.k if self.spec.uses_matrix else 0

    @property
    def seeds_prompts(self) -> bool:
        """Whether prefill recycles the prompt's logits too (the LM head over each distinct prompt
        token's last position). Why the default: fixed templates gain (MAT 2.21 -> 2.31 for 2.2.2);
        ``auto`` does not (1.79 vs 1.78 on one stream, none at 4-16 clients, for 2-3% of the wall time)."""
        if not self.spec.uses_matrix:
            return False
        if self.settings.prompt_seeding is None:
            return not self.spec.auto_budget
        return self.settings.prompt_seeding

    @property
    def uses_suffix(self) -> bool:
        """Whether the cross-request suffix index drafts a branch beside each row's context: by
        default under ``auto``, the one budget that prices its branch (EngineConfig refuses it elsewhere)."""
        if not self.spec.prices_branches:
            return False
        return True if self.settings.suffix_index is None else self.settings.suffix_index

    @property
    def uses_pairs(self) -> bool:
        """Whether the pair table drafts too. Why the default: the fixed hybrids gain (MAT 2.68 ->
        2.89 for 2.2.2+ctx), a bare template stays the paper's method, and ``auto`` measured no gain
        (1.70 in ``tr-serve bench`` against 1.72-1.76 without it)."""
        if not self.spec.uses_matrix:
            return False
        if self.settings.pair_table is None:
            return self.spec.context and not self.spec.auto_budget
        return self.settings.pair_table

    # ---- the matrix's prior ---------------------------------------------------------------------
    def seed_prior(self, prior: torch.Tensor) -> None:
        """Fill the matrix's empty rows from the model's prior [vocab, k] (runner/matrix_prior.py);
        every row a matrix handed in has learned is kept."""
        self.matrix.seed(prior)

    # ---- a request's life -------------------------------------------------------------------------
    def admit(self, req: SpeculatedRequest) -> None:
        """A request that got a row: its context index and its suffix-index document."""
        if self.drafter is not None:
            req.context = self.drafter.new_context_index()
        if self.suffix is not None and req.request_context.learn:  # learn: false leaves no text behind
            req.suffix_doc = self.suffix.open(req.namespace)

    def finish(self, req: SpeculatedRequest) -> None:
        """A request that leaves its row: the suffix index gets the tokens of its last step, and its
        document is whole, so the fleet may share it (fleet/suffix_share.py)."""
        if self.suffix is not None and self._sync_suffix(req) is not None:
            self.suffix.finish(req.suffix_doc)

    # ---- prefill ------------------------------------------------------------------------------
    def seed_positions(self, chunks: list[list[int]]) -> list[list[int]] | None:
        """Per prompt chunk, the positions whose top-k ids :meth:`seed` recycles (None: no seeding)."""
        return [last_occurrences(c) for c in chunks] if self.seeds_prompts else None

    def seed(self, batch: list[SpeculatedRequest], chunks: list[list[int]], starts: list[int],
             positions: list[list[int]] | None, out: PrefillOutput) -> None:
        """Recycle a prefill step's ids: the ``positions`` of each chunk (prompt seeding), else the
        last token of each chunk that completes its prompt; starts[i]: chunk i's offset in its prompt."""
        if not self.spec.uses_matrix:
            return
        for i, (req, chunk, start) in enumerate(zip(batch, chunks, starts)):
            target = learns_into(req)
            if target is None:
                continue
            if positions is not None:
                keep = positions[i]
                tokens, top = torch.tensor(chunk)[keep], out.seeds[i]
            elif start + len(chunk) == len(req.prompt_ids):
                keep = [len(chunk) - 1]
                tokens, top = torch.tensor(chunk[-1:]), out.last.top_k[i : i + 1]
            else:
                continue
            before = self._prompt_tokens_before(req, start, keep) if target == SHARED_TENANT else None
            self._learn(target, tokens, top, before=before)

    def _learn(self, target: str, tokens: torch.Tensor, top: torch.Tensor, preferred: torch.Tensor | None = None,
               before: torch.Tensor | None = None) -> None:
        """Rows ``top`` [n, >=k] at ``tokens`` [n] into the shared rows (and the pair table, with
        ``before`` [n]) or ``target``'s overlay, as :func:`learns_into` named it."""
        if target == SHARED_TENANT:
            self.matrix.recycle(tokens, top, preferred=preferred, pairs=self.pairs, before=before)
        else:
            self.tenant_rows.recycle(target, tokens, top, preferred)

    def _prompt_tokens_before(self, req: SpeculatedRequest, start: int, positions: list[int]) -> torch.Tensor | None:
        """The token before each of ``positions`` of the prompt chunk at ``start`` (EMPTY before the
        prompt's first): the pair table's keys; None without a pair table."""
        if self.pairs is None:
            return None
        return torch.tensor([req.prompt_ids[start + j - 1] if start + j > 0 else EMPTY for j in positions])

    # ---- decode: propose, accept, recycle -----------------------------------------------------------
    def propose(self, batch: list[SpeculatedRequest]) -> DraftBatch:
        """One draft tree per row, rooted at its last token."""
        roots = torch.tensor([r.last_token for r in batch])
        if self.drafter is None:
            return Drafter.plain(roots)
        contexts, room = None, None
        if self.spec.context:
            contexts = [_synced_context(r) for r in batch]
            room = [min(r.params.max_tokens - len(r.output_ids),
                        self.settings.max_model_len - len(r.prompt_ids) - len(r.output_ids)) for r in batch]
        before = torch.tensor([r.token_before_last for r in batch]) if self.pairs is not None else None
        documents = [self._sync_suffix(r) for r in batch] if self.suffix is not None else None
        plain = [not r.request_context.speculation for r in batch]
        tenants = [None if r.request_context.shared else r.request_context.tenant for r in batch]
        scopes = self.tenant_rows.scopes(tenants) if self.tenant_rows is not None else None
        return self.drafter.draft(roots, contexts, room, before, documents, plain if any(plain) else None, scopes,
                                  tenants)

    def accept(self, draft: DraftBatch, out: NextTokens, started: float) -> Acceptance:
        """Each row's longest path of the model's choices (sampled rows walk their draws as greedy
        rows their argmax), learned by the budget with the step's latency since ``started``
        (``time.perf_counter``) where ``online_latency``."""
        acceptance = accept_draft(draft, choices_grid(draft, out.choices))
        seconds = time.perf_counter() - started if self.settings.online_latency else None
        if self.drafter is not None:
            self.drafter.observe(draft, acceptance, seconds)
        return acceptance

    def recycle(self, draft: DraftBatch, acceptance: Acceptance, out: NextTokens,
                batch: list[SpeculatedRequest] | None = None) -> None:
        """Write the real nodes' top-k ids (packed in row order, as the runner sends them) into the
        matrix and the pair table; a node on an accepted path wins over another of its token.
        ``batch``: the rows' requests; each row writes where :func:`learns_into` says (the shared
        rows, its tenant's overlay, or nowhere)."""
        if not self.spec.uses_matrix:
            return
        on_path = torch.from_numpy(acceptance.accepted_mask.numpy())
        before = draft.tokens_before() if draft.before_roots is not None else None
        targets = [learns_into(r) for r in batch] if batch is not None else [SHARED_TENANT] * draft.tokens.shape[0]
        real = draft.real_nodes()
        if all(t == SHARED_TENANT for t in targets):  # the common case: one write of every node
            if real is None:
                self.matrix.recycle(draft.tokens.reshape(-1), out.top_k, preferred=on_path.reshape(-1),
                                    pairs=self.pairs, before=before.reshape(-1) if before is not None else None)
            else:
                self.matrix.recycle(draft.tokens[real], out.top_k, preferred=on_path[real],
                                    pairs=self.pairs, before=before[real] if before is not None else None)
            return
        real = real if real is not None else torch.ones(draft.tokens.shape, dtype=torch.bool)
        for target in dict.fromkeys(t for t in targets if t is not None):
            rows = torch.tensor([t == target for t in targets])
            kept = rows[:, None].expand_as(real)[real]  # top_k is packed over the real nodes, in row order
            nodes = real & rows[:, None]
            self._learn(target, draft.tokens[nodes], out.top_k[kept], preferred=on_path[nodes],
                        before=before[nodes] if before is not None and target == SHARED_TENANT else None)

    def _sync_suffix(self, req: SpeculatedRequest) -> int | None:
        """The request's suffix-index document caught up with its prompt and output (None when it
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


def learns_into(req: SpeculatedRequest) -> str | None:
    """Where the request's verified nodes and prompt write matrix rows: the shared rows
    (:data:`SHARED_TENANT`, and the pair table) for the shared tenant, the tenant's own overlay
    for a named tenant, nowhere under ``learn: false``. Every request drafts from the shared rows,
    so a named tenant's text must never reach them (docs/serving.md, "Tenants and privacy")."""
    ctx = req.request_context
    if not ctx.learn:
        return None
    return SHARED_TENANT if ctx.shared else ctx.tenant


def _synced_context(req: SpeculatedRequest) -> ContextIndex:
    """The request's context index, caught up with its prompt and output."""
    ctx = req.context
    done, p = len(ctx), len(req.prompt_ids)
    if done < p:
        ctx.extend(req.prompt_ids[done:])
        done = p
    ctx.extend(req.output_ids[done - p :])
    return ctx
