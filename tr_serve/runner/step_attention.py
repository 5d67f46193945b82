"""Attention for a runner step wherever the native CPU tree attention does not run: CUDA, bfloat16
or float16 on any device, and ``cpu_kernels: torch``.

Each step row has a cache row, a prefix of ``P`` slots that all of its queries see, and ``w`` new
slots at ``P .. P + w - 1`` (this step's tokens, written into the cache before attention) that its
queries see as its tree mask [w, w] says. :class:`StepAttention` attends the step's queries over
the cache buffers as they are, under those three facts per row:

* grouped-query attention stays grouped: key/value heads are never copied per query head
  (transformers' ``repeat_kv`` under a 4D mask copies every row's K and V once per query head that
  reads them, in every layer: group x the step's K/V; only with one key/value head per device, as
  Llama-70B at tp=8, is it a view);
* each row attends over its own ``P + w`` slots, not the longest row's (a row with a 100-token
  context is not computed over another row's 8k slots);
* no gather of cache rows (the rows' keys and values are read where they are), and no 4D mask
  [rows, 1, queries, slots] (~40 MB in bfloat16 at 32 rows x 81 queries x 8k slots, every step):
  what travels to the device is the rows' prefix lengths, widths and small tree masks.

Two kernels compute it (:func:`default_backend` picks one):

* ``flex``: FlexAttention compiled by ``torch.compile``, one call per layer for every row. Its
  :class:`BlockMask` is built directly from the prefix lengths (full blocks: the prefix) and the
  widths (partial blocks: those holding the tree, where a ``mask_mod`` reads the tree mask), so
  blocks past a row's length are never visited; the kernel maps query heads to their key/value
  head itself. The queries are placed into a batch of every cache row (rows not in the step get no
  blocks and cost next to nothing), so the keys and values are the layer's buffers as they are, and
  every shape is fixed for the runner's life but the query length, padded to a few buckets: one
  compiled graph per bucket, no recompiling for the rows or the context a step has (a dynamic batch
  does not compile on CPU with torch 2.13, and fixed shapes are what CUDA graphs need).
  Without ``torch.compile``, FlexAttention is a slow reference that copies K/V per query head, so
  this kernel is only ever run compiled. The default on CUDA.
* ``rows``: one ``scaled_dot_product_attention`` per row over a view of that row's ``P + w`` slots,
  with a small per-row mask [w, P + w] built once per step. On CPU the fused kernel maps query
  heads to key/value heads natively (``enable_gqa``). On CUDA a masked call with ``enable_gqa``
  would fall back to the math kernel, which copies K/V; there the query heads that share a
  key/value head are folded into the query axis instead (``[1, kv_heads, group * w, d]`` against
  ``[1, kv_heads, P + w, d]``), which needs no copy of K/V (its mask repeats each row's [w, P + w]
  group times, once per step). The default on CPU, where compiling FlexAttention costs seconds to
  tens of seconds per query bucket and its compiled CPU kernel is slower than this one; on CUDA the
  fallback when FlexAttention cannot compile (one call per row and layer: launch-bound).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BACKENDS = ("flex", "rows")
# TR_SERVE_STEP_ATTENTION=flex|rows forces a kernel (e.g. to compare them on one machine); unset or
# "auto": flex on CUDA, rows elsewhere
ENV = "TR_SERVE_STEP_ATTENTION"
# FlexAttention's sparse block (keys and queries): 128 is its default, the tile its CUDA kernels use
FLEX_BLOCK = 128
# Query lengths the flex kernel is compiled for: a step's queries are padded up to the next of these
# (each is one compilation, tens of seconds; a dynamic query length does not compile on CPU with
# torch 2.13), and from FLEX_BLOCK on to the next multiple of FLEX_BLOCK.
FLEX_QUERY_BUCKETS = (16, 32, 64, FLEX_BLOCK)
# a mask's row stride, in elements, that CUDA's memory-efficient attention takes as it is
MASK_ALIGN = 8
# each query bucket, dtype and head layout is one compiled graph; torch's default limit (8) would
# quietly fall back to the uncompiled, K/V-copying reference once exceeded
FLEX_RECOMPILE_LIMIT = 64


def default_backend(device: torch.device) -> str:
    """The kernel for a runner on ``device``: :data:`ENV` if set, else flex on CUDA, rows elsewhere."""
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced in BACKENDS:
        return forced
    if forced not in ("", "auto"):
        raise ValueError(f"{ENV}={forced!r}: use one of {BACKENDS} or auto")
    return "flex" if device.type == "cuda" and flex_available() else "rows"


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_query_length(q: int) -> int:
    """The padded query length the flex kernel runs a step of ``q`` query tokens at."""
    for bucket in FLEX_QUERY_BUCKETS:
        if q <= bucket:
            return bucket
    return -(-q // FLEX_BLOCK) * FLEX_BLOCK


class StepAttention:
    """One step's attention plan (layer independent: built once per step, used by every layer).

    rows, starts, widths: per step row, its cache row, its prefix length P (the cache length before
    the step) and its real query tokens w (the first w of the row's q). local [b or 1, q, q] bool:
    which of the row's new slots each of its queries sees (the tree mask; prefill: causal).
    ``fold``: on the rows kernel, fold query heads into the query axis instead of ``enable_gqa``
    (default: on any device but CPU). ``cache_rows``: rows of the KV cache (the flex kernel's batch;
    default: one past the highest step row)."""

    def __init__(self, rows: list[int], starts: list[int], widths: list[int], local: torch.Tensor, q: int,
                 dtype: torch.dtype, device: torch.device, backend: str = "rows", fold: bool | None = None,
                 cache_rows: int | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown step attention backend {backend!r}")
        self.rows, self.starts, self.widths, self.q = rows, starts, widths, q
        self.cache_rows = cache_rows if cache_rows is not None else max(rows) + 1
        self.backend = backend
        self.device = torch.device(device)
        self.dtype = dtype
        self.fold = self.device.type != "cpu" if fold is None else fold
        b = len(rows)
        self.local = local.to(self.device).expand(b, q, q)  # [b, q, q] bool
        self.packed_offsets = [0]
        for w in widths:
            self.packed_offsets.append(self.packed_offsets[-1] + w)
        self._flex: _FlexPlan | None = None
        self._biases: list[torch.Tensor] | None = None
        self._folded: dict[int, list[torch.Tensor]] = {}
        self.calls = 0  # attention calls so far (one per layer): the runner checks every layer came here

    # ---- the two layouts the model gives queries in ------------------------------------------
    def attend_packed(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """query [t, heads, d]: the step's real tokens packed in row order (row i's widths[i] tokens,
        the first of its slots); keys/values [cache rows, kv_heads, max_len, d]: one layer's whole
        cache buffers, this step's entries written. Returns [t, heads, d]."""
        self.calls += 1
        if self._use_flex():
            plan = self._flex_plan()
            placed = query.new_zeros(plan.batch, query.shape[1], plan.q_len, query.shape[2])
            placed[plan.token_rows, :, plan.token_slots] = query
            out = plan.run(placed, keys, values, scale)
            if out is not None:
                return out[plan.token_rows, :, plan.token_slots]
        if len(self.rows) == 1:  # one row: its output is the result, no copy
            row, p, w = self.rows[0], self.starts[0], self.widths[0]
            return self._row(query.transpose(0, 1)[None], keys, values, 0, row, p, w, scale)[0].transpose(0, 1)
        out = torch.empty_like(query)
        for i, (row, p, w) in enumerate(zip(self.rows, self.starts, self.widths)):
            if w == 0:
                continue
            off = self.packed_offsets[i]
            o = self._row(query[off : off + w].transpose(0, 1)[None], keys, values, i, row, p, w, scale)
            out[off : off + w] = o[0].transpose(0, 1)
        return out

    def attend_padded(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """query [b, heads, q, d] (row i's real tokens first, padding after them); keys/values as
        for :meth:`attend_packed`. Returns [b, q, heads, d], transformers' attention output layout;
        padding positions are zeros (their outputs are never read)."""
        b, heads, q, d = query.shape
        self.calls += 1
        if self._use_flex():
            plan = self._flex_plan()
            placed = query.new_zeros(plan.batch, heads, plan.q_len, d)
            placed[plan.step_rows, :, :q] = query
            out = plan.run(placed, keys, values, scale)
            if out is not None:
                return out[plan.step_rows, :, :q].transpose(1, 2)
        out = query.new_zeros(b, q, heads, d)
        for i, (row, p, w) in enumerate(zip(self.rows, self.starts, self.widths)):
            if w == 0:
                continue
            o = self._row(query[i : i + 1, :, :w], keys, values, i, row, p, w, scale)
            out[i, :w] = o[0].transpose(0, 1)
        return out

    # ---- rows: one fused attention per row over its own slots --------------------------------
    def _row(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, i: int, row: int, p: int,
             w: int, scale: float) -> torch.Tensor:
        """query [1, heads, w, d] of step row i; returns [1, heads, w, d]."""
        heads, kv_heads = query.shape[1], keys.shape[1]
        k = keys[row : row + 1, :, : p + w]  # [1, kv_heads, P + w, d]: a view of the row's slots
        v = values[row : row + 1, :, : p + w]
        if heads == kv_heads:
            return F.scaled_dot_product_attention(query, k, v, attn_mask=self._bias(i), scale=scale)
        if not self.fold:  # CPU: the fused kernel maps query heads to key/value heads itself
            return F.scaled_dot_product_attention(query, k, v, attn_mask=self._bias(i), scale=scale, enable_gqa=True)
        group = heads // kv_heads
        folded = query.reshape(1, kv_heads, group * w, query.shape[3])  # query head h = kv * group + g
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=self._folded_bias(i, group), scale=scale)
        return out.view(1, heads, w, query.shape[3])

    def _bias(self, i: int) -> torch.Tensor:
        """Row i's additive mask [w, P + w]: 0 over its prefix and the new slots it sees."""
        if self._biases is None:
            low = torch.finfo(self.dtype).min
            self._biases = []
            for j, (p, w) in enumerate(zip(self.starts, self.widths)):
                bias = self._aligned(w, p + w)
                bias[:, p:].masked_fill_(~self.local[j, :w, :w], low)
                self._biases.append(bias)
        return self._biases[i]

    def _aligned(self, rows: int, cols: int) -> torch.Tensor:
        """zeros [rows, cols], a view of a buffer whose rows start every MASK_ALIGN elements: CUDA's
        memory-efficient kernel copies a mask with any other stride into a padded one, per call."""
        return torch.zeros(rows, -(-cols // MASK_ALIGN) * MASK_ALIGN, dtype=self.dtype, device=self.device)[:, :cols]

    def _folded_bias(self, i: int, group: int) -> torch.Tensor:
        """Row i's mask for the folded queries [group * w, P + w]: row g * w + j is query j's."""
        if group not in self._folded:
            self._bias(0)
            folded = []
            for bias in self._biases:
                w, cols = bias.shape
                out = self._aligned(group * w, cols)
                out.view(group, w, cols).copy_(bias)  # each query head of the group: the row's mask
                folded.append(out)
            self._folded[group] = folded
        return self._folded[group][i]

    # ---- flex: one compiled FlexAttention per layer ------------------------------------------
    def _use_flex(self) -> bool:
        return self.backend == "flex" and flex_failure is None

    def _flex_plan(self) -> "_FlexPlan":
        if self._flex is None:
            self._flex = _FlexPlan(self)
        return self._flex


class _FlexPlan:
    """The step's BlockMask and query placement over every cache row (the kernel's batch)."""

    def __init__(self, step: StepAttention):
        from torch.nn.attention.flex_attention import BlockMask

        device, q = step.device, step.q
        self.batch = step.cache_rows
        self.q_len = flex_query_length(q)
        # the only host-to-device traffic (one copy; the tree mask is already there): per row its cache
        # row, prefix and width, per real token its cache row and place in the row
        b, t = len(step.rows), sum(step.widths)
        host = torch.tensor(step.rows + step.starts + step.widths
                            + [r for r, w in zip(step.rows, step.widths) for _ in range(w)]
                            + [j for w in step.widths for j in range(w)], dtype=torch.long)
        meta = host.to(device)
        self.step_rows, starts, widths = meta[:b], meta[b : 2 * b], meta[2 * b : 3 * b]
        self.token_rows, self.token_slots = meta[3 * b : 3 * b + t], meta[3 * b + t :]
        prefix = torch.zeros(self.batch, dtype=torch.int32, device=device)
        width = torch.zeros(self.batch, dtype=torch.int32, device=device)
        prefix[self.step_rows] = starts.to(torch.int32)
        width[self.step_rows] = widths.to(torch.int32)
        slot = torch.arange(q, device=device)
        seen = step.local & (slot[None, None, :] < width[self.step_rows, None, None])  # [b, q, q]
        tree = torch.zeros(self.batch, self.q_len, self.q_len, dtype=torch.bool, device=device)
        tree[self.step_rows, :q, :q] = seen
        self.prefix, self.tree = prefix, tree
        self.block_mask_for = _block_mask_builder(BlockMask, prefix, width, tree, self.q_len)
        self._masks: dict[int, object] = {}

    def run(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor | None:
        """query [batch, heads, q_len, d]; keys/values [cache rows, kv_heads, max_len, d]. None when
        FlexAttention does not compile here (recorded in :data:`flex_failure`)."""
        global flex_failure
        k, v = keys, values
        kv_len = k.shape[2]
        mask = self._masks.get(kv_len)
        if mask is None:
            mask = self._masks[kv_len] = self.block_mask_for(kv_len)
        try:
            return compiled_flex(query, k, v, mask, scale, query.shape[1] != k.shape[1])
        except _compile_errors() as e:  # e.g. no Triton for this GPU: the rows kernel from now on
            flex_failure = f"{type(e).__name__}: {e}"[:2000]
            logger.warning("FlexAttention did not compile; step attention falls back to one fused attention "
                           "per row for this process: %s", flex_failure)
            return None


def _block_mask_builder(block_mask_cls, prefix: torch.Tensor, width: torch.Tensor, tree: torch.Tensor,
                        q_len: int) -> Callable[[int], object]:
    """BlockMask over keys of length kv_len for rows with ``prefix`` [batch] slots seen by every query
    (full blocks) and ``width`` [batch] new slots after them, seen as ``tree`` [batch, q_len, q_len]
    says (partial blocks: mask_mod decides within them). A row of width 0 gets no blocks."""

    def mask_mod(b, h, q_idx, kv_idx):
        rel = kv_idx - prefix[b]
        return (rel < 0) | ((rel < q_len) & tree[b, q_idx, rel.clamp(0, q_len - 1)])

    def build(kv_len: int):
        device = prefix.device
        kv_blocks = -(-kv_len // FLEX_BLOCK)
        q_blocks = -(-q_len // FLEX_BLOCK)
        batch = prefix.shape[0]
        full = (prefix // FLEX_BLOCK).to(torch.int32)  # blocks wholly inside the prefix
        first = prefix // FLEX_BLOCK
        last = (prefix + width - 1).div(FLEX_BLOCK, rounding_mode="floor")
        partial = torch.where(width > 0, last - first + 1, 0).to(torch.int32)
        index = torch.arange(kv_blocks, device=device, dtype=torch.int32)
        partial_index = (first[:, None] + index[None]).clamp(max=kv_blocks - 1).to(torch.int32)  # [batch, kv_blocks]
        full_index = index[None].expand(batch, kv_blocks)

        def per_q_block(x: torch.Tensor) -> torch.Tensor:  # [batch, ...] -> [batch, 1, q_blocks, ...]
            return x[:, None, None].expand(batch, 1, q_blocks, *x.shape[1:]).contiguous()

        return block_mask_cls.from_kv_blocks(per_q_block(partial), per_q_block(partial_index), per_q_block(full),
                                             per_q_block(full_index), BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
                                             mask_mod=mask_mod, seq_lengths=(q_len, kv_len), compute_q_blocks=False)

    return build


_compiled: Callable | None = None
# why FlexAttention could not compile in this process (then every step takes the rows kernel), or None
flex_failure: str | None = None


def _compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean torch.compile could not build the kernel (not a wrong input)."""
    errors: list[type[BaseException]] = []
    try:
        from torch._dynamo.exc import TorchDynamoException

        errors.append(TorchDynamoException)
    except ImportError:
        pass
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:
        pass
    return tuple(errors) or (RuntimeError,)


def compiled_flex(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask, scale: float,
                  gqa: bool) -> torch.Tensor:
    """FlexAttention, compiled once per process: a graph per shape (query bucket, dtype, head layout,
    cache rows and length), never a dynamic one."""
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    with torch._dynamo.config.patch(**_recompile_settings()):
        return _compiled(query, keys, values, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def _recompile_settings() -> dict:
    config = torch._dynamo.config
    out = {}
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):
            out[name] = max(getattr(config, name), FLEX_RECOMPILE_LIMIT)
    if hasattr(config, "fail_on_recompile_limit_hit"):
        out["fail_on_recompile_limit_hit"] = True  # never fall back to the K/V-copying reference quietly
    return out
