"""The step GPUs run: the compact decoder (tr_serve/model/decoder.py) over bucketed static shapes,
fed by one copy to the device and read by one copy back.

A step's rows, query tokens, the slots attention reads, the picked outputs and the KV moves left
by the last compaction are each rounded up to a bucket (:func:`bucket`), so a serving run meets a
few shapes, each one graph: compiled with ``torch.compile(fullgraph=True)`` where ``compile`` is
on (``torch.compile`` on CPU Inductor as on CUDA), eager otherwise. Every input of a step (tokens,
positions, the slot mapping, the picked outputs, the tree mask, the KV moves) is packed on the
host into one int32 buffer (pinned on CUDA), copied once; the step's ids (each picked output's
choice and top-k) come back in one copy. Padding writes its K/V into a sink row no request owns.

Compaction moves no data when it is called: the moves (the accepted nodes' slots to the row's
next slots) ride in the next step's buffer and run at the start of its graph.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from tr_serve.model.decoder import CompactDecoder
from tr_serve.runner.next_tokens import next_token_ids, on_host, unpack
from tr_serve.runner.step_io import NextTokens, PrefillOutput, StepRunner, StepSampling

MIN_PICKS = 8  # the smallest bucket of picked outputs and of KV moves (0 moves stays 0)


class StepCompileError(RuntimeError):
    """A bucket's step graph did not compile (torch.compile with ``fullgraph=True``)."""


def bucket(n: int, cap: int | None, least: int = 1) -> int:
    """The smallest power of two >= max(n, least), at most ``cap`` (n <= cap; None: no cap).

    Example: bucket(5, 64) -> 8; bucket(33, 40) -> 40; bucket(0, 64, 8) -> 8."""
    if cap is not None and n > cap:
        raise ValueError(f"{n} exceeds its bucket cap {cap}")
    size = 1 << (max(n, least, 1) - 1).bit_length()
    return size if cap is None else min(cap, size)


def token_bucket(n: int, cap: int | None, least: int = 1) -> int:
    """The smallest power of two or 1.5 times one >= max(n, least), at most ``cap``: the buckets
    of a step's token dimensions (query tokens, picked outputs), where a graph's padding is
    computed through every layer, so a third at most is padding, not half.

    Example: token_bucket(81, 1024) -> 96 (the 2.2.2 tree and its root); token_bucket(5, 64) -> 6;
    token_bucket(64, 64) -> 64; token_bucket(0, None, 8) -> 8."""
    if cap is not None and n > cap:
        raise ValueError(f"{n} exceeds its bucket cap {cap}")
    power = bucket(n, None, least)
    size = power * 3 // 4 if power >= 4 and power * 3 // 4 >= max(n, least) else power
    return size if cap is None else min(cap, size)


@dataclass(frozen=True)
class StepShape:
    """One graph's static shape: R rows of Q query tokens reading KV slots each, P picked outputs,
    M KV moves, top-k ids per output (k), ``causal`` (a prefill: the in-step mask is the lower
    triangle, not sent) and ``greedy`` (the ids are computed in the graph; else its hidden states
    come out for the sampler)."""

    rows: int
    queries: int
    kv: int
    picks: int
    moves: int
    k: int
    causal: bool
    greedy: bool

    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        """The step buffer's layout: (name, shape) in order."""
        r, q = self.rows, self.queries
        out = [("tokens", (r, q)), ("positions", (r, q)), ("slot_mapping", (r, q)), ("rows", (r,)),
               ("prefix", (r,)), ("picks", (self.picks,)), ("move_src", (self.moves,)), ("move_dst", (self.moves,))]
        if not self.causal:
            out.append(("local", (r, q, q)))
        return out


@functools.cache
def buffer_layout(shape: StepShape) -> tuple[tuple[str, int, tuple[int, ...]], ...]:
    """(name, offset, dims) of each field of the step buffer, and so its size: the last offset + size."""
    out, at = [], 0
    for name, dims in shape.fields():
        out.append((name, at, dims))
        at += math.prod(dims)
    out.append(("", at, ()))
    return tuple(out)


def unpack_fields(buffer: torch.Tensor, layout: tuple[tuple[str, int, tuple[int, ...]], ...]) -> dict[str, torch.Tensor]:
    """Views of the one step buffer [n] int32 by its :func:`buffer_layout` (static offsets)."""
    return {name: buffer[at : at + math.prod(dims)].view(dims) for name, at, dims in layout[:-1]}


class DecoderRunner(StepRunner):
    """A :class:`StepRunner` over a :class:`CompactDecoder`: ``num_rows`` KV rows of ``max_len``
    slots (plus the sink row), steps as static bucketed graphs (:class:`StepShape`)."""

    def __init__(self, decoder: CompactDecoder, num_rows: int, max_len: int, compile: bool = False,
                 device: torch.device | str | None = None, emits: bool = True):
        self.decoder = decoder
        self.device = torch.device(device) if device is not None else decoder.embed.weight.device
        self.dtype = decoder.embed.weight.dtype
        self.vocab_size = decoder.shape.vocab
        self.num_rows = num_rows
        self.max_len = max_len
        self.kernel_plan = None
        self.forwards = 0
        self.compiled = compile
        self.emits = emits
        self.sink = num_rows  # the cache row padding writes into
        # row r holds flat slots [r * max_len, (r + 1) * max_len) of the decoder's cache
        self.k_cache, self.v_cache = decoder.new_cache((num_rows + 1) * max_len, self.dtype, self.device)
        self.lens = np.zeros(num_rows, dtype=np.int64)
        self._moves: list[tuple[int, int]] = []  # (flat source slot, flat destination slot) for the next step
        self._graphs: dict[StepShape, Callable[..., torch.Tensor]] = {}
        self._compiles = 0  # graphs compiled: each one's function is named apart
        self.steps = 0

    @property
    def name(self) -> str:
        """What the latency calibration keys this runner's timings by."""
        return "compact-compiled" if self.compiled else "compact-eager"

    # ---- rows -----------------------------------------------------------------------------------
    def length(self, row: int) -> int:
        return int(self.lens[row])

    def free(self, row: int) -> None:
        # its pending moves stay: they complete the entries a later request may reuse
        self.lens[row] = 0

    def reuse_prefix(self, row: int, source: int, length: int) -> None:
        if length > self.max_len:
            raise ValueError(f"a prefix of {length} tokens exceeds max_len {self.max_len}")
        if source != row:
            self._apply_moves()  # the source's last accepted entries, before they are read
            s = self.max_len
            for cache in (self.k_cache, self.v_cache):
                cache[:, row * s : row * s + length] = cache[:, source * s : source * s + length]
        self.lens[row] = length

    def _apply_moves(self) -> None:
        """The pending compaction moves now, outside a step (a prefix copy is about to read them)."""
        if self._moves:
            moves = torch.tensor(self._moves, dtype=torch.long).to(self.device)
            move_entries(self.k_cache, self.v_cache, moves[:, 0], moves[:, 1])
            self._moves = []

    def compact(self, rows: torch.Tensor, keep: list[torch.Tensor]) -> None:
        """Keep the accepted nodes' KV entries: row r's kept columns go to the slots after its
        prefix, in order (moved by the next step's graph; none for a column already in place)."""
        s = self.max_len
        for row, kept in zip(rows.tolist(), keep):
            prefix = int(self.lens[row])
            for j, col in enumerate(kept.tolist()):
                if col != j:
                    self._moves.append((row * s + prefix + col, row * s + prefix + j))
            self.lens[row] = prefix + len(kept)

    # ---- the engine's calls ---------------------------------------------------------------------
    @torch.inference_mode()
    def prefill_step(self, rows: torch.Tensor, prompts: list[list[int]], sampling: StepSampling,
                     seed_positions: list[list[int]] | None = None) -> PrefillOutput | None:
        """Each prompt chunk into its row (after what the row holds), one causal step; the next
        token after each chunk and the top-k at ``seed_positions``."""
        b = len(prompts)
        q = max(len(p) for p in prompts)
        tokens = np.zeros((b, q), dtype=np.int64)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        depths = np.broadcast_to(np.arange(q)[None], (b, q))
        picks = [i * q + len(p) - 1 for i, p in enumerate(prompts)]
        seeds_at = []
        if seed_positions is not None:
            for i, pos in enumerate(seed_positions):
                seeds_at.append((len(picks), len(pos)))
                picks += [i * q + j for j in pos]
        prefix = self.lens[rows.numpy()].copy()
        ids = self._run(rows.numpy(), tokens, depths, None, lengths, picks, sampling,
                        positions_after=prefix[:, None] + depths + 1)
        self.lens[rows.numpy()] += lengths
        if ids is None:
            return None
        last = unpack(ids[:b], sampling.recycle_k)
        seeds = [ids[a : a + n, 1:] for a, n in seeds_at] if seed_positions is not None else None
        return PrefillOutput(last, seeds)

    @torch.inference_mode()
    def verify_step(self, rows: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor,
                    lengths: torch.Tensor | None, sampling: StepSampling) -> NextTokens | None:
        """One step over every row's tree; the real nodes' next tokens, packed in row order."""
        b, q = tokens.shape
        lens = lengths.numpy() if lengths is not None else np.full(b, q, dtype=np.int64)
        grid = np.broadcast_to(depths.numpy() if depths.dim() == 2 else depths.numpy()[None], (b, q))
        local = np.broadcast_to(mask.numpy() if mask.dim() == 3 else mask.numpy()[None], (b, q, q))
        picks = [r * q + c for r in range(b) for c in range(int(lens[r]))]
        prefix = self.lens[rows.numpy()]
        ids = self._run(rows.numpy(), np.maximum(tokens.numpy(), 0), grid, local, lens, picks, sampling,
                        positions_after=prefix[:, None] + grid + 1)
        return unpack(ids, sampling.recycle_k) if ids is not None else None

    # ---- one step -------------------------------------------------------------------------------
    def _run(self, rows: np.ndarray, tokens: np.ndarray, depths: np.ndarray, local: np.ndarray | None,
             lengths: np.ndarray, picks: list[int], sampling: StepSampling,
             positions_after: np.ndarray) -> torch.Tensor | None:
        """rows [b], tokens [b, q], depths [b, q], local [b, q, q] bool (None: causal), lengths [b],
        picks: flat indices (r * q + c) of the outputs wanted, positions_after [b, q]: the position
        of the token after each query (the sampler's key). Returns [len(picks), 1 + k] int32 on the host."""
        b, q = tokens.shape
        s = self.max_len
        greedy = not sampling.any_sampled
        rows_bucket, queries_bucket = bucket(b, self.num_rows), token_bucket(q, s)
        shape = StepShape(rows=rows_bucket, queries=queries_bucket, kv=bucket(int((self.lens[rows] + q).max()), s),
                          picks=token_bucket(len(picks), None, MIN_PICKS),  # a prefill's seeds repeat its last position
                          moves=bucket(len(self._moves), None, MIN_PICKS) if self._moves else 0,
                          k=sampling.recycle_k, causal=local is None, greedy=greedy)
        self.forwards += 1
        buffer = self._pack(shape, rows, tokens, depths, local, lengths, picks)
        device_buffer = buffer.to(self.device, non_blocking=True)  # the step's one copy to the device
        self._moves = []
        out = self._graph(shape)(device_buffer, self.k_cache, self.v_cache)
        self.steps += 1
        if not greedy:  # every rank: under a vocabulary split the ranks gather the logits together
            logits = self.decoder.logits(out[: len(picks)])
        if not self.emits:
            return None
        if not greedy:  # the sampler draws from the picked outputs' logits (runner/sampler.py)
            node_rows = np.asarray(picks) // q
            node_positions = positions_after.reshape(-1)[np.asarray(picks)]
            out = next_token_ids(logits, sampling, node_rows, node_positions, on_host(self.device))
        return out[: len(picks)].cpu()  # the step's one copy to the host

    def _pack(self, shape: StepShape, rows: np.ndarray, tokens: np.ndarray, depths: np.ndarray,
              local: np.ndarray | None, lengths: np.ndarray, picks: list[int]) -> torch.Tensor:
        """The step's inputs in one int32 host buffer (pinned on CUDA), laid out by ``shape``."""
        R, Q, S = shape.rows, shape.queries, self.max_len
        b, q = tokens.shape
        prefix = np.zeros(R, dtype=np.int64)
        prefix[:b] = self.lens[rows]
        cols = np.arange(Q)
        real = np.zeros((R, Q), dtype=bool)
        real[:b] = cols[None, :] < lengths[:, None]
        all_rows = np.full(R, self.sink, dtype=np.int64)
        all_rows[:b] = rows
        slot = np.where(real, all_rows[:, None] * S + prefix[:, None] + cols[None, :], self.sink * S + cols[None, :])
        fields = {
            "tokens": _padded(tokens, (R, Q)),
            "positions": prefix[:, None] + _padded(depths, (R, Q)),
            "slot_mapping": slot,
            "rows": all_rows,
            "prefix": prefix,
            "picks": _padded(np.asarray([(p // q) * Q + p % q for p in picks], dtype=np.int64), (shape.picks,)),
        }
        src = np.full(shape.moves, self.sink * S, dtype=np.int64)
        dst = src.copy()
        if self._moves:
            moves = np.asarray(self._moves, dtype=np.int64)
            src[: len(moves)], dst[: len(moves)] = moves[:, 0], moves[:, 1]
        fields["move_src"], fields["move_dst"] = src, dst
        if local is not None:
            full = np.zeros((R, Q, Q), dtype=bool)
            full[:b, :q, :q] = local
            full[:, cols, cols] = True  # padding sees itself: no query sees nothing
            fields["local"] = full
        layout = buffer_layout(shape)
        buffer = torch.empty(layout[-1][1], dtype=torch.int32, pin_memory=self.device.type == "cuda")
        view = buffer.numpy()
        for name, at, dims in layout[:-1]:
            view[at : at + math.prod(dims)] = fields[name].reshape(-1)
        return buffer

    def _graph(self, shape: StepShape) -> Callable[..., torch.Tensor]:
        """The step function of ``shape``: compiled at its first use where ``compile`` is on (a
        failure names the shape), eager otherwise."""
        graph = self._graphs.get(shape)
        if graph is not None:
            return graph
        decoder, max_len = self.decoder, self.max_len
        layout = buffer_layout(shape)

        def step(buffer: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            f = unpack_fields(buffer, layout)
            if shape.moves:  # the last compaction's moves, every layer at once, before this step writes
                move_entries(k_cache, v_cache, f["move_src"].long(), f["move_dst"].long())
            if shape.causal:
                local = torch.ones(shape.queries, shape.queries, dtype=torch.bool, device=buffer.device).tril()
                local = local[None].expand(shape.rows, shape.queries, shape.queries)
            else:
                local = f["local"].bool()
            read_slots = f["rows"].long()[:, None] * max_len + torch.arange(shape.kv, device=buffer.device)[None, :]
            hidden = decoder.step(f["tokens"].long(), f["positions"].long(), f["slot_mapping"].long(), read_slots,
                                  f["prefix"].long(), local, k_cache, v_cache)
            picked = hidden.reshape(shape.rows * shape.queries, -1).index_select(0, f["picks"].long())
            return decoder.ids_of(picked, shape.k) if shape.greedy else picked

        if not self.compiled:
            self._graphs[shape] = step
            return step
        # a code object of its own per shape: torch.compile keeps one cache of graphs per code
        # object (at most ``recompile_limit``), and each bucket is a graph of its own, not a recompile
        self._compiles += 1
        name = f"step_{self._compiles}"
        own = types.FunctionType(step.__code__.replace(co_name=name), step.__globals__, name, None, step.__closure__)
        compiled = torch.compile(own, fullgraph=True, dynamic=False)

        def first_call(*args: torch.Tensor) -> torch.Tensor:
            """torch.compile compiles at the first call: a failure names the bucket, and nothing
            runs in its place (``compile: false`` is the eager mode)."""
            try:
                out = compiled(*args)
            except Exception as e:
                del self._graphs[shape]
                raise StepCompileError(f"compiling the step of bucket {shape} failed "
                                       f"({type(e).__name__}: {e}); compile: false runs the steps eagerly") from e
            self._graphs[shape] = compiled
            return out

        self._graphs[shape] = first_call
        return first_call


def move_entries(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """K/V entries at flat slots ``src`` [m] copied to ``dst`` [m], every layer at once; the
    right-hand side is gathered whole before the scatter, so overlapping moves are safe."""
    for cache in (k_cache, v_cache):  # [layers, slots, kv_heads, head_dim]
        cache[:, dst] = cache[:, src]


def _padded(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` in the top-left corner of zeros of ``shape``."""
    out = np.zeros(shape, dtype=np.int64)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out
