"""A preallocated, slot-addressed KV cache that a Hugging Face model writes into.

Every sequence owns one row of a ``[rows, kv_heads, max_len, head_dim]`` buffer per layer and a
length ``lens[row]``. A forward over ``q`` new tokens of the rows in a step writes them at slots
``lens[row] .. lens[row] + q - 1``; the caller's 4D mask (or, without it, runner/step_attention.py
from each row's length and tree mask) decides what each query sees, so rows of different lengths
share one forward without left padding. After verification, :meth:`compact`
moves the accepted tree nodes' entries next to the prefix, which makes the cache equal to the one
plain decoding would have built.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class Segment(NamedTuple):
    """Step rows batch_start..batch_end (cache rows first_row..end_row, consecutive), each with
    ``width`` real tokens, packed at offsets packed_start..packed_end of the step's real tokens."""

    batch_start: int
    batch_end: int
    first_row: int
    end_row: int
    width: int
    packed_start: int
    packed_end: int


class SlotLayer(CacheLayerMixin):
    """One layer's K/V buffers; writes go where the owning :class:`SlotKVCache` says."""

    is_sliding = False

    def __init__(self, owner: "SlotKVCache", keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.owner = owner
        self.keys = keys  # [rows, kv_heads, max_len, head_dim]
        self.values = values
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers are preallocated
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [b, kv_heads, q, head_dim] for the step's rows, in step order
        self.write(key_states, value_states)
        o = self.owner
        if o.step_whole_buffers:  # the step's attention reads each row's own slots (runner/step_attention.py)
            return self.keys, self.values
        if o.step_row_range is not None:  # consecutive rows: a view of the buffers, no gather
            first, end = o.step_row_range
            return self.keys[first:end, :, : o.step_kv_len], self.values[first:end, :, : o.step_kv_len]
        return self.keys[o.step_rows, :, : o.step_kv_len], self.values[o.step_rows, :, : o.step_kv_len]

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store the step's new entries [b, kv_heads, q, head_dim] at the rows' step slots."""
        o = self.owner
        if o.step_single is not None:  # one row: a slice copy, no index tensors
            row, start, q = o.step_single
            self.keys[row, :, start : start + q] = key_states[0]
            self.values[row, :, start : start + q] = value_states[0]
        else:
            k = key_states.transpose(1, 2)  # [b, q, kv_heads, head_dim]
            v = value_states.transpose(1, 2)
            self.keys[o.step_rows_col, :, o.step_slots] = k
            self.values[o.step_rows_col, :, o.step_slots] = v

    def write_packed(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store the step's real entries, packed [t, kv_heads, head_dim] in row order (row r's
        first widths[r] tokens), at their rows' step slots (:meth:`SlotKVCache.plan_segments`)."""
        o = self.owner
        if o.step_single is not None:
            row, start, _ = o.step_single
            t = key_states.shape[0]
            self.keys[row, :, start : start + t] = key_states.transpose(0, 1)
            self.values[row, :, start : start + t] = value_states.transpose(0, 1)
        else:
            self.keys[o.step_packed_rows, :, o.step_packed_slots] = key_states
            self.values[o.step_packed_rows, :, o.step_packed_slots] = value_states

    def view(self, first_row: int, end_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, kv_heads, step_kv_len, head_dim] of consecutive cache rows: views
        of the buffers, no copy."""
        kv = self.owner.step_kv_len
        return self.keys[first_row:end_row, :, :kv], self.values[first_row:end_row, :, :kv]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.step_kv_len, 0

    def get_seq_length(self) -> int:
        return int(self.owner.lens.max())

    def get_max_length(self) -> int:
        return self.owner.max_len


class SlotKVCache(Cache):
    """KV buffers for ``num_rows`` sequences of up to ``max_len`` tokens each."""

    def __init__(self, num_layers: int, num_rows: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.num_rows = num_rows
        self.max_len = max_len
        self.device = torch.device(device)
        # one allocation for all layers: [layers, rows, kv_heads, max_len, head_dim]
        self.k_all = torch.zeros(num_layers, num_rows, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v_all = torch.zeros_like(self.k_all)
        self.lens = torch.zeros(num_rows, dtype=torch.long)  # on CPU: small bookkeeping
        layers = [SlotLayer(self, self.k_all[i], self.v_all[i]) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.begin_step(torch.arange(1), 1)

    def begin_step(self, rows: torch.Tensor, q: int) -> torch.Tensor:
        """Prepare slots for a forward of ``q`` new tokens on ``rows``; returns each row's old length."""
        rows = rows.to(torch.long).cpu()
        starts = self.lens[rows]
        if int(starts.max()) + q > self.max_len:
            raise ValueError(f"KV cache row overflow: {int(starts.max())} + {q} > max_len {self.max_len}")
        self.step_rows = rows.to(self.device)
        self.step_num_rows = len(rows)
        first = int(rows[0])
        self.step_single = (first, int(starts[0]), q) if len(rows) == 1 else None
        self.step_rows_col = self.step_rows[:, None]
        self.step_slots = (starts[:, None] + torch.arange(q)).to(self.device)  # [b, q]
        self.step_kv_len = int(starts.max()) + q
        self._step_row_list, self._step_starts = rows.tolist(), starts.tolist()
        self.step_runs = _runs(self._step_row_list)
        one_run = self.step_runs is not None and len(self.step_runs) == 1
        self.step_row_range = self.step_runs[0][2:] if one_run else None  # consecutive rows: a view
        # set by the runner when the step's attention is runner/step_attention.py: update() then returns
        # the layer's whole buffers (no slice, no gather), which that attention reads row by row
        self.step_whole_buffers = False
        return starts

    @property
    def step_row_list(self) -> list[int]:
        """The step's cache rows, in step order."""
        return self._step_row_list

    @property
    def step_start_list(self) -> list[int]:
        """The step's rows' lengths before the step (where their new slots start), in step order."""
        return self._step_starts

    def plan_segments(self, widths: list[int]) -> list[Segment] | None:
        """Split the step's rows (``widths[i]`` real tokens each, the first of its row's slots) into
        segments of consecutive cache rows of one width, and index their real slots for
        :meth:`SlotLayer.write_packed`. None when the rows are not ascending.

        Why: padding every row to the widest row's width made attention, the mask and the cache
        writes of a 16-row step cost as if every row verified the longest tree (one row at 5
        tokens, 15 at 1: 101 ms against 58 for all at 1). A segment attends at its own width, over
        a view of its rows' cache."""
        if self.step_runs is None:
            return None
        out, p = [], 0
        for b0, b1, r0, _ in self.step_runs:
            i = b0
            while i < b1:
                j = i + 1
                while j < b1 and widths[j] == widths[i]:
                    j += 1
                w = widths[i]
                out.append(Segment(i, j, r0 + i - b0, r0 + j - b0, w, p, p + (j - i) * w))
                p += (j - i) * w
                i = j
        self.plan_packed(widths)
        return out

    def plan_packed(self, widths: list[int]) -> None:
        """Index the step's real slots for :meth:`SlotLayer.write_packed`: step row i's first
        ``widths[i]`` tokens, packed in row order, in any order of rows."""
        self._packed_widths = widths
        self.step_packed_rows = self.step_packed_slots = None
        if self.step_single is None:
            self.packed_targets()

    def packed_targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache row, slot) of each of the step's real tokens, packed in row order, as planned by
        :meth:`plan_segments` (int64 on the cache's device)."""
        if self.step_packed_rows is None:
            step_rows, starts, widths = self._step_row_list, self._step_starts, self._packed_widths
            self.step_packed_rows = torch.tensor([step_rows[i] for i, w in enumerate(widths) for _ in range(w)],
                                                 device=self.device)
            self.step_packed_slots = torch.tensor([starts[i] + j for i, w in enumerate(widths) for j in range(w)],
                                                  device=self.device)
        return self.step_packed_rows, self.step_packed_slots

    def compact(self, rows: torch.Tensor, keep_offsets: list[torch.Tensor]) -> None:
        """Keep, for each row, the step's new entries at ``lens[row] + keep_offsets[i]`` (ascending,
        first is 0) moved to ``lens[row] + 0..len-1``, then advance ``lens``.

        The moves are planned on the host (``lens`` and the offsets live there) and run as one
        gather and one scatter over all layers and rows at once, with the indices sent to the
        device: no wait for the device, two kernels whatever the batch. A row whose kept entries
        are already in place (a plain step, a chain accepted from its first node) moves nothing."""
        move_rows: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        for row, keep in zip(rows.tolist(), keep_offsets):
            start = int(self.lens[row])
            offsets = keep.tolist()
            for j, offset in enumerate(offsets):
                if offset != j:
                    move_rows.append(row)
                    src.append(start + offset)
                    dst.append(start + j)
            self.lens[row] = start + len(offsets)
        if move_rows:
            r = torch.tensor(move_rows).to(self.device, non_blocking=True)
            s = torch.tensor(src).to(self.device, non_blocking=True)
            d = torch.tensor(dst).to(self.device, non_blocking=True)
            # the right-hand side is gathered whole before the scatter: overlapping moves are safe
            self.k_all[:, r, :, d] = self.k_all[:, r, :, s]
            self.v_all[:, r, :, d] = self.v_all[:, r, :, s]

    def set_length(self, row: int, length: int) -> None:
        self.lens[row] = length

    def reuse_prefix(self, row: int, source: int, length: int) -> None:
        """``row`` starts with ``source``'s first ``length`` entries (copied on the device, every layer at once)."""
        if length > self.max_len:
            raise ValueError(f"a prefix of {length} tokens exceeds max_len {self.max_len}")
        if source != row:
            self.k_all[:, row, :, :length] = self.k_all[:, source, :, :length]
            self.v_all[:, row, :, :length] = self.v_all[:, source, :, :length]
        self.lens[row] = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lens.max())


def _runs(rows: list[int]) -> list[tuple[int, int, int, int]] | None:
    """(batch_start, batch_end, first_row, end_row) per run of consecutive cache rows, or None when
    ``rows`` is not ascending (then attention needs a gathered copy of the rows).

    Why: gathering the step's rows out of the cache copies every layer's K and V over the whole
    context; at 16 rows with one gap that was about half of a plain decode step. A run is a view.
    Every run attends over the step's kv length, as the gathered batch would: the same arithmetic."""
    if any(b <= a for a, b in zip(rows, rows[1:])):
        return None
    out, b0 = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            out.append((b0, i, rows[b0], rows[i - 1] + 1))
            b0 = i
    return out
