"""Runs the model over a batch of rows of the slot KV cache: ragged prefill and tree verification.

The runner owns the KV cache and knows nothing of drafting or acceptance: it takes tokens, a
per-query depth (position offset) and an intra-step visibility mask, and returns logits.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from tr_serve.model_shape import attention_shape
from tr_serve.runner.attention import runner_attention, takes_step
from tr_serve.kernels import layer_ops, tree_attention
from tr_serve.kernels.cpu_kernels import KernelPlan
from tr_serve.runner.hf_compat import cache_kwargs
from tr_serve.runner.kv_cache import SlotKVCache
from tr_serve.runner.llama_body import body_for, supports_layer_ops
from tr_serve.runner.next_tokens import next_token_ids, on_host, top_ids, unpack
from tr_serve.runner.step_io import NextTokens, PrefillOutput, StepRunner, StepSampling
from tr_serve.runner.step_attention import StepAttention, default_backend


def build_step_mask(starts: torch.Tensor, local: torch.Tensor, kv_len: int, dtype: torch.dtype,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """4D float mask [b, 1, q, kv_len]: row r sees its prefix slots < starts[r] and, among its own
    new slots starts[r] .. starts[r]+q-1, those allowed by ``local`` [b or 1, q, q].

    Built on ``device`` (default: local's): only ``starts`` and ``local`` travel there, not the
    mask (on a GPU at 32 rows x 81 queries x 8k slots the mask is ~40 MB in bf16)."""
    device = torch.device(device) if device is not None else local.device
    starts, local = starts.to(device), local.to(device)
    b, q = starts.shape[0], local.shape[-1]
    rel = torch.arange(kv_len, device=device)[None, :] - starts[:, None]  # [b, kv_len] slot offset from row start
    prefix = (rel < 0)[:, None, :]  # [b, 1, kv_len]
    in_new = (rel >= 0) & (rel < q)
    idx = rel.clamp(0, q - 1)[:, None, :].expand(b, q, kv_len)
    new = torch.gather(local.expand(b, q, q), 2, idx) & in_new[:, None, :]  # [b, q, kv_len]
    visible = prefix | new
    mask = torch.zeros(b, 1, q, kv_len, dtype=dtype, device=device)
    mask.masked_fill_(~visible[:, None], torch.finfo(dtype).min)
    return mask


def real_positions(lengths: torch.Tensor | None, q: int) -> torch.Tensor | None:
    """[b * q] bool on the host: the first lengths[r] tokens of each row of width ``q``; None when
    no row is padded (nothing to pack)."""
    if lengths is None or not bool((lengths < q).any()):
        return None
    return (torch.arange(q)[None, :] < lengths.cpu()[:, None]).flatten()


def kv_bytes_per_row(config, max_len: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one sequence of ``max_len`` tokens over all layers."""
    _, kv_heads, head_dim = attention_shape(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * max_len * itemsize


def rows_within_budget(config, max_len: int, dtype: torch.dtype, max_rows: int, budget_gb: float | None) -> int:
    """How many sequences the preallocated cache holds: ``max_rows``, fewer if the memory budget
    says so. The cache never grows after start-up, so serving can never run out of KV memory."""
    if budget_gb is None:
        return max_rows
    rows = int(budget_gb * 2**30 // kv_bytes_per_row(config, max_len, dtype))
    if rows < 1:
        need = kv_bytes_per_row(config, max_len, dtype) / 2**30
        raise ValueError(f"kv_cache_memory_gb={budget_gb} is too small for one sequence of {max_len} tokens ({need:.3f} GiB)")
    return min(rows, max_rows)


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): there a bfloat16 GEMM
    is about 3x an fp32 one; without it torch emulates bfloat16 and is slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _bf16_head(model: torch.nn.Module) -> torch.Tensor | bool:
    """A bfloat16 copy of an fp32 model's LM head weight where bfloat16 is native, else False."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    if (not isinstance(head, torch.nn.Linear) or head.bias is not None or weight is None
            or weight.dtype != torch.float32 or not cpu_has_bf16_dot()):
        return False
    return weight.detach().to(torch.bfloat16)


class ModelRunner(StepRunner):
    """Owns the model and its KV cache of ``num_rows`` sequences of at most ``max_len`` tokens.

    The engine's calls (:class:`~tr_serve.runner.step_io.StepRunner`) are :meth:`prefill_step`
    and :meth:`verify_step`, which return token ids; :meth:`prefill` and :meth:`verify` are the
    logits they reduce (calibration, tests, studies).

    ``device``: where the step's tensors live, by default the model's; the sync audit passes its
    stand-in accelerator (runner/sync_audit.py). ``emits``: False on a tensor-parallel rank whose
    results nobody reads (every rank but 0): it runs the layers and skips the LM head."""

    def __init__(self, model: torch.nn.Module, num_rows: int, max_len: int, kernel_plan: KernelPlan | None = None,
                 tree_attention_enabled: bool = True, device: torch.device | str | None = None, emits: bool = True):
        cfg = model.config
        self.kernel_plan = kernel_plan  # faster fp32 CPU linears inside this runner's forwards only
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.emits = emits
        self.num_rows = num_rows
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = cfg.vocab_size
        self.max_len = max_len
        self.forwards = 0
        _, kv_heads, head_dim = attention_shape(cfg)
        self.cache = SlotKVCache(cfg.num_hidden_layers, num_rows, max_len, kv_heads, head_dim, self.dtype, self.device)
        self._draft_head: torch.Tensor | bool | None = None  # see draft_logits; built at first use
        # fp32 on CPU: attention through the native kernel, one call per layer for every row and width
        self.tree_attention = (tree_attention_enabled and on_host(self.device) and self.dtype == torch.float32
                               and tree_attention.supports(cfg.num_attention_heads, kv_heads, head_dim)
                               and tree_attention.available())
        # with it, each layer's norms, rotary embedding, cache writes and activation in native calls
        self.layer_ops = self.tree_attention and supports_layer_ops(model) and layer_ops.available()
        # without it (CUDA, bfloat16/float16, cpu_kernels "torch"): runner/step_attention.py's kernel
        self.step_backend = default_backend(self.device)

    def length(self, row: int) -> int:
        return int(self.cache.lens[row])

    def free(self, row: int) -> None:
        self.cache.set_length(row, 0)

    def reuse_prefix(self, row: int, source: int, length: int) -> None:
        self.cache.reuse_prefix(row, source, length)

    @torch.inference_mode()
    def forward(self, rows: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor, local: torch.Tensor,
                lengths: torch.Tensor | None = None, verifying: bool = False) -> torch.Tensor:
        """Hidden states of the real tokens, packed in row order: [sum(lengths), hidden] ([b * q,
        hidden] when ``lengths`` is None), for ``tokens`` [b, q] at positions lens[row] + depths
        [b or 1, q]; lengths [b]: real tokens per row, the first of each row (padding after them).

        Where the model's body runs here (plain Llama), the linear layers see only the real tokens.
        With the native CPU tree attention, attention runs there or per segment of rows of one
        width under the 4D mask (padded layout only for rows out of cache order); in every other
        runner (CUDA, bfloat16/float16, ``cpu_kernels: torch``) it is :mod:`.step_attention`'s: each
        row over its own slots, no 4D mask, no copies of the cache. Where transformers' forward
        runs, every position is computed and the real ones are kept.
        ``verifying``: a verify step, whose rows of several widths the native tree attention takes
        wider than a prefill's (``tree_attention.takes``)."""
        b, q = tokens.shape
        real = real_positions(lengths, q)
        self.forwards += 1
        starts = self.cache.begin_step(rows, q)
        positions = (starts[:, None] + depths).to(self.device)
        widths = lengths.tolist() if lengths is not None else None  # real tokens per row
        queries = mask = step = None
        if self.tree_attention:  # the native CPU path: tree attention, else torch's under the 4D mask
            body = body_for(self.model)  # plain Llama: its layers without transformers' wrappers, same arithmetic
            if body is not None and self.cache.step_runs is not None:  # rows ascending
                takes = body.c_loop_takes  # type: ignore[attr-defined]  # set by llama_body.body_for
                c_loop = (q > tree_attention.MAX_WIDTH and self.layer_ops
                          and takes(self.kernel_plan, self.cache, sum(widths) if widths else b * q))
                if tree_attention.takes(b, q, verify=verifying, c_loop=c_loop):
                    queries = tree_attention.step_queries(rows.tolist(), starts.tolist(), widths or [q] * b, local)
            if queries is None:
                mask = build_step_mask(starts, local, self.cache.step_kv_len, self.dtype, self.device)
        else:  # every other runner: each row over its own slots, no 4D mask, no K/V copies
            body = body_for(self.model)
            if body is not None or takes_step(self.model):
                step = StepAttention(self.cache.step_row_list, self.cache.step_start_list, widths or [q] * b, local, q,
                                     self.dtype, self.device, self.step_backend, cache_rows=self.cache.num_rows)
                self.cache.step_whole_buffers = body is None  # transformers' layers read the cache through update()
            else:  # an attention implementation the runner cannot take over: the 4D mask
                body = None
                mask = build_step_mask(starts, local, self.cache.step_kv_len, self.dtype, self.device)
        index = real.nonzero().flatten().to(self.device) if real is not None else None  # on the host: no sync
        with self._kernels(), runner_attention(self.model, step):
            if body is not None:
                return body(tokens.to(self.device), positions, mask, self.cache, index, widths, queries,
                            native=self.layer_ops, step=step)
            decoder = self.model.model
            out = decoder(input_ids=tokens.to(self.device), attention_mask=mask, position_ids=positions,
                          use_cache=True, **cache_kwargs(decoder, self.cache))
        if step is not None and step.calls != len(self.cache.layers):
            # a layer attended elsewhere, over the whole cache buffers and without a mask: wrong
            raise RuntimeError(f"{type(self.model).__name__}: {step.calls} of {len(self.cache.layers)} layers attended "
                               "through transformers' attention interface; the runner cannot serve it on this path")
        hidden = out.last_hidden_state.reshape(b * q, -1)
        return hidden if index is None else hidden.index_select(0, index)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._kernels():
            return self.model.lm_head(hidden).float()

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits that only ever feed drafts (prompt seeding: their top-k goes into the matrix, never
        into the output), so their precision costs speed, not correctness. An fp32 model's LM head
        runs in bfloat16 on a CPU with native bfloat16 dot products (measured here, 184 prompt
        positions with the top-k: 93 -> 32 ms); elsewhere these are :meth:`logits`."""
        if self._draft_head is None:
            self._draft_head = _bf16_head(self.model) if on_host(self.device) else False
        if self._draft_head is False:
            return self.logits(hidden)
        return torch.nn.functional.linear(hidden.to(torch.bfloat16), self._draft_head)

    def _kernels(self):
        return self.kernel_plan.active() if self.kernel_plan is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def prefill(self, rows: torch.Tensor, prompts: list[list[int]],
                logit_positions: list[list[int]] | None = None):
        """Write the prompts into empty ``rows`` (one right-padded forward).

        Returns (last_logits [b, V], per row the logits at its ``logit_positions`` [n_i, V], or
        None): the LM head runs over the last positions and the asked-for ones only.
        """
        b, lengths, tokens, local = _prefill_inputs(prompts)
        q = tokens.shape[1]
        hidden = self.forward(rows, tokens, torch.arange(q)[None], local, lengths)  # [sum(lengths), hidden]
        ends = lengths.cumsum(0)
        last_logits = self.logits(hidden[(ends - 1).to(self.device)])  # [b, V]
        picked = None
        if logit_positions is not None:
            starts = (ends - lengths).tolist()
            picked = [self.draft_logits(hidden[torch.tensor(pos, dtype=torch.long).add_(start).to(self.device)])
                      for start, pos in zip(starts, logit_positions)]
        for i, row in enumerate(rows.tolist()):
            self.cache.set_length(row, int(self.cache.lens[row]) + int(lengths[i]))
        return last_logits, picked

    @torch.inference_mode()
    def verify(self, rows: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor,
               lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the root plus every tree node; the cache lengths stay unchanged until
        :meth:`compact` keeps the accepted entries.

        tokens [b, q]; depths [q] (one tree for every row) or [b, q] (a tree per row); tree_mask
        [q, q] or [b, q, q], True where a node sees another (its ancestors and itself); lengths
        [b]: real nodes per row (root included), padding after them.

        Returns [b, q, V] when no row is padded, else the real nodes' logits packed in row order,
        [sum(lengths), V] (``DraftBatch.real_nodes`` says which): padding never reaches the LM head,
        and a 16-row step with one wide row does not allocate, fill and scan 16 wide rows of
        vocabulary-sized logits."""
        safe = tokens.clamp(min=0)  # EMPTY nodes run as token 0; they can never be accepted
        if depths.dim() == 1:
            depths = depths[None]
        if tree_mask.dim() == 2:
            tree_mask = tree_mask[None]
        b, q = tokens.shape
        if lengths is not None and not bool((lengths < q).any()):
            lengths = None  # no row is padded
        logits = self.logits(self.forward(rows, safe, depths, tree_mask, lengths, verifying=True))  # the real nodes only
        return logits.view(b, q, -1) if lengths is None else logits

    def compact(self, rows: torch.Tensor, keep: list[torch.Tensor]) -> None:
        self.cache.compact(rows, keep)

    # ---- the engine's calls: token ids back, not logits ---------------------------------------------
    @torch.inference_mode()
    def prefill_step(self, rows: torch.Tensor, prompts: list[list[int]], sampling: StepSampling,
                     seed_positions: list[list[int]] | None = None) -> PrefillOutput | None:
        """:meth:`prefill`, reduced on the device to each chunk's next token (and top-k) and the
        top-k at ``seed_positions``; one copy to the host. None where ``emits`` is False."""
        starts = [int(self.cache.lens[r]) for r in rows.tolist()]
        if not self.emits:
            self._prefill_hidden(rows, prompts)
            return None
        last_logits, picked = self.prefill(rows, prompts, logit_positions=seed_positions)
        k = sampling.recycle_k
        positions = np.array([s + len(p) for s, p in zip(starts, prompts)], dtype=np.int64)
        host = on_host(self.device)
        parts = [next_token_ids(last_logits, sampling, np.arange(len(prompts)), positions, host)]
        if picked is not None:
            parts += [torch.nn.functional.pad(top_ids(x, k, host), (1, 0)) for x in picked]  # column 0 unused
        ids = torch.cat(parts).cpu() if len(parts) > 1 else parts[0].cpu()  # the step's one copy to the host
        last = unpack(ids[: len(prompts)], k)
        seeds = None
        if picked is not None:
            ends = np.cumsum([len(prompts)] + [x.shape[0] for x in picked])
            seeds = [ids[a:b, 1:] for a, b in zip(ends[:-1], ends[1:])]
        return PrefillOutput(last, seeds)

    def _prefill_hidden(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        """:meth:`prefill` without the LM head (a rank whose logits nobody reads)."""
        b, lengths, tokens, local = _prefill_inputs(prompts)
        self.forward(rows, tokens, torch.arange(tokens.shape[1])[None], local, lengths)
        for i, row in enumerate(rows.tolist()):
            self.cache.set_length(row, int(self.cache.lens[row]) + int(lengths[i]))

    @torch.inference_mode()
    def verify_step(self, rows: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor, tree_mask: torch.Tensor,
                    lengths: torch.Tensor | None, sampling: StepSampling) -> NextTokens | None:
        """:meth:`verify`, reduced on the device to every real node's next token and top-k, packed
        in row order; one copy to the host. None where ``emits`` is False."""
        b, q = tokens.shape
        if lengths is not None and not bool((lengths < q).any()):
            lengths = None
        if not self.emits:
            self.forward(rows, tokens.clamp(min=0), depths if depths.dim() == 2 else depths[None],
                         tree_mask if tree_mask.dim() == 3 else tree_mask[None], lengths, verifying=True)
            return None
        node_rows = node_positions = None
        if sampling.any_sampled:  # which row each packed node is, and the position of the token after it
            starts = self.cache.lens[rows.long()].numpy()
            grid = np.broadcast_to(depths.numpy() if depths.dim() == 2 else depths.numpy()[None], (b, q))
            real = np.ones((b, q), dtype=bool) if lengths is None else np.arange(q)[None] < lengths.numpy()[:, None]
            node_rows = np.broadcast_to(np.arange(b)[:, None], (b, q))[real]
            node_positions = (starts[:, None] + grid + 1)[real]
        logits = self.verify(rows, tokens, depths, tree_mask, lengths)
        ids = next_token_ids(logits.reshape(-1, logits.shape[-1]), sampling, node_rows, node_positions,
                             on_host(self.device))
        return unpack(ids.cpu(), sampling.recycle_k)  # the step's one copy to the host


def _prefill_inputs(prompts: list[list[int]]):
    """(b, lengths [b], right-padded tokens [b, q], visibility [b, q, q]) of a ragged prefill."""
    b = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    q = int(lengths.max())
    tokens = torch.zeros(b, q, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    valid = torch.arange(q)[None, :] < lengths[:, None]  # [b, q]
    local = causal[None] & valid[:, None, :]
    local = local | torch.eye(q, dtype=torch.bool)[None]  # pad queries see themselves: no empty rows
    return b, lengths, tokens, local
