"""The compact Llama-family decoder: one step over a bucket of rows as one function of static shapes.

Per layer: residual add + RMSNorm, one QKV matmul, (q/k norms), the rotary embedding read from a
precomputed table, K/V written through a slot mapping into the rows' caches, attention under a
mask built in the graph from positions, one output matmul, residual add + RMSNorm, one gate/up
matmul, SiLU-and-multiply, one down matmul. Nothing in :meth:`CompactDecoder.step` reads a host
value or branches on data, so ``torch.compile(fullgraph=True)`` takes it whole and, on a GPU, a
bucket's step can be captured as one CUDA graph.

The cache is flat: ``[layers, slots, kv_heads, head_dim]`` for K and for V. The step writes each
query's K/V at its slot (the slot mapping) and each row reads the slots of its sequence in order
(``read_slots``): where those slots are is the allocator's business (a row of a contiguous range,
or blocks of a block table), not the model's. The writes are ``index_put_`` on the whole cache,
which Inductor keeps in place (a write through a view of a graph input is not: it copies the
cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tr_serve.model.family import FamilyFeatures, features_of
from tr_serve.model.vocab_parallel import VocabShard, ids_over_shards, logits_over_shards
from tr_serve.model_shape import attention_shape


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float


class CompactLayer(torch.nn.Module):
    """One decoder layer in fused layouts: ``qkv`` [(heads + 2 kv_heads) * head_dim, hidden],
    ``gate_up`` [2 intermediate, hidden]."""

    def __init__(self, shape: DecoderShape, features: FamilyFeatures, window: int | None):
        super().__init__()
        s = shape
        self.input_norm = torch.nn.Parameter(torch.ones(s.hidden))
        self.qkv = torch.nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=features.qkv_bias)
        self.o = torch.nn.Linear(s.heads * s.head_dim, s.hidden, bias=features.o_bias)
        self.q_norm = torch.nn.Parameter(torch.ones(s.head_dim)) if features.qk_norm else None
        self.k_norm = torch.nn.Parameter(torch.ones(s.head_dim)) if features.qk_norm else None
        self.post_norm = torch.nn.Parameter(torch.ones(s.hidden))
        self.gate_up = torch.nn.Linear(s.hidden, 2 * s.intermediate, bias=features.mlp_bias)
        self.down = torch.nn.Linear(s.intermediate, s.hidden, bias=features.mlp_bias)
        self.window = window


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm, op for op (float32 statistics, the weight in the input dtype)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_table(inv_freq: torch.Tensor, scaling: float, positions: int,
               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim] float32 as transformers computes them per forward: float32
    positions times ``inv_freq``, doubled, times the attention ``scaling``."""
    freqs = torch.arange(positions, dtype=torch.float32, device=device)[:, None] * inv_freq.float().to(device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` [..., head_dim] with ``cos``/``sin`` broadcast to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def step_mask(positions: torch.Tensor, prefix: torch.Tensor, local: torch.Tensor, kv_len: int,
              window: int | None, dtype: torch.dtype) -> torch.Tensor:
    """[R, 1, Q, kv_len] additive mask: query (r, i) sees the j-th slot its row reads when j holds the row's
    prefix (j < prefix[r]) or the step's column c = j - prefix[r] with local[r, i, c], and, under a
    sliding window, when the key's position is less than ``window`` behind the query's.

    positions [R, Q] int64, prefix [R] int64, local [R, Q, Q] bool.

    Example: prefix [2], local [[1,0],[1,1]] (a chain of 2), kv_len 4 -> query 0 sees slots 0, 1, 2;
    query 1 sees 0, 1, 2, 3."""
    r, q = positions.shape
    j = torch.arange(kv_len, device=positions.device)  # [kv_len]
    col = j[None, :] - prefix[:, None]  # [R, kv_len]: the step's column a slot holds, < 0 in the prefix
    in_step = (col >= 0) & (col < q)
    tree = torch.gather(local, 2, col.clamp(0, q - 1)[:, None, :].expand(r, q, kv_len))  # [R, Q, kv_len]
    visible = (col < 0)[:, None, :] | (tree & in_step[:, None, :])
    if window is not None:
        key_pos = torch.where(col < 0, j[None, :], torch.gather(positions, 1, col.clamp(0, q - 1)))  # [R, kv_len]
        visible = visible & (positions[:, :, None] - key_pos[:, None, :] < window)
    zero = torch.zeros((), dtype=dtype, device=positions.device)
    return torch.where(visible, zero, torch.finfo(dtype).min)[:, None]


def kv_heads_for_sdpa(keys: torch.Tensor, values: torch.Tensor, heads: int,
                      masked_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """keys/values [R, KV, kv_heads, D] as SDPA's fused kernels take them under a mask: as they are
    where the device's kernel does masked grouped-query attention (``masked_gqa``: CPU's flash
    kernel), else each KV head repeated for its query heads ([R, KV, heads, D]), which is what
    ``enable_gqa`` means (on CUDA, enable_gqa with a mask runs the math kernel)."""
    group = heads // keys.shape[2]
    if masked_gqa or group == 1:
        return keys, values
    return keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)


# The two halves of a layer, each a nested compile region: torch.compile compiles each once and
# reuses the code for every layer of the same shapes (the step still traces every layer, so a
# graph's compile grows with depth, but more slowly). The cache writes between them stay in the
# step, on the whole cache, in place.
@torch.compiler.nested_compile_region
def attention_inputs(x: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, Q, hidden] (normed) -> q [R, Q, heads, D], k and v [R, Q, kv_heads, D]: one QKV matmul,
    the q/k norms where the family has them, the rotary embedding of q and k."""
    r, q, _ = x.shape
    qkv = F.linear(x, qkv_w, qkv_b)
    d = qkv.shape[-1] // (heads + 2 * kv_heads)
    xq, xk, xv = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    xq, xk, xv = xq.view(r, q, heads, d), xk.view(r, q, kv_heads, d), xv.view(r, q, kv_heads, d)
    if q_norm is not None and k_norm is not None:
        xq, xk = rms_norm(xq, q_norm, eps), rms_norm(xk, k_norm, eps)
    # v is a copy, not a view of the QKV output: a region's output that aliases its intermediate
    # was read wrongly by the next region (a torch 2.13 miscompile the compiled-step test catches)
    return rotate(xq, cos, sin), rotate(xk, cos, sin), xv.contiguous()


@torch.compiler.nested_compile_region
def attention_and_mlp(xq: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      residual: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None, post_norm: torch.Tensor,
                      gate_up_w: torch.Tensor, gate_up_b: torch.Tensor | None, down_w: torch.Tensor,
                      down_b: torch.Tensor | None, next_norm: torch.Tensor, eps: float,
                      reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of xq [R, Q, heads, D] over keys/values [R, KV, kv_heads, D] under ``mask``
    [R, 1, Q, KV], the output matmul, the MLP (one gate/up matmul), each added to ``residual``
    [R, Q, hidden]; returns the residual and its norm under ``next_norm`` (the next layer's input).
    ``reduce``: under tensor parallelism, the sum over the ranks of the output and down matmuls'
    partial results (row-parallel layers), else None."""
    r, q, heads, d = xq.shape
    keys, values = kv_heads_for_sdpa(keys, values, heads, masked_gqa=keys.device.type == "cpu")
    out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask, scale=d ** -0.5, enable_gqa=heads != keys.shape[2])
    attended = F.linear(out.transpose(1, 2).reshape(r, q, heads * d), o_w, o_b)
    residual = residual + (attended if reduce is None else reduce(attended))
    gate, up = F.linear(rms_norm(residual, post_norm, eps), gate_up_w, gate_up_b).chunk(2, dim=-1)
    down = F.linear(F.silu(gate) * up, down_w, down_b)
    residual = residual + (down if reduce is None else reduce(down))
    return residual, rms_norm(residual, next_norm, eps)


class CompactDecoder(torch.nn.Module):
    """A Llama-family model in fused layouts; :meth:`step` is the whole forward of one step."""

    def __init__(self, shape: DecoderShape, features: FamilyFeatures, inv_freq: torch.Tensor,
                 rope_scaling: float, max_positions: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 vocab_shard: VocabShard | None = None):
        super().__init__()
        # a tensor-parallel rank's slice of the LM head (model/vocab_parallel.py); None: the whole head
        self.vocab_shard = vocab_shard
        # a tensor-parallel rank's sum over the ranks of its row-parallel partial results (its
        # heads' output matmul, its MLP slice's down matmul): 2 all-reduces a layer; None alone
        self.reduce = reduce
        self.shape, self.features = shape, features
        self.embed = torch.nn.Embedding(shape.vocab, shape.hidden)
        self.layers = torch.nn.ModuleList(CompactLayer(shape, features, w) for w in features.windows)
        self.norm = torch.nn.Parameter(torch.ones(shape.hidden))
        self.lm_head = None if features.tied else torch.nn.Linear(shape.hidden, shape.vocab, bias=False)
        # [max_positions, head_dim] float32 on the host: not buffers, so that casting the module keeps
        # them float32 (transformers computes them in float32 per forward); from_hf places them
        self.rope = (inv_freq, rope_scaling, max_positions)
        self.cos, self.sin = rope_table(inv_freq, rope_scaling, max_positions, inv_freq.device)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def new_cache(self, slots: int, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches [layers, slots, kv_heads, head_dim] for this decoder."""
        s = self.shape
        dtype = dtype or self.embed.weight.dtype
        device = device or self.embed.weight.device
        size = (s.layers, slots, s.kv_heads, s.head_dim)
        return torch.zeros(size, dtype=dtype, device=device), torch.zeros(size, dtype=dtype, device=device)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, read_slots: torch.Tensor,
             prefix: torch.Tensor, local: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, Q, hidden] after the final norm.

        tokens [R, Q] int64 (>= 0; padding runs as any id), positions [R, Q] int64 (rotary),
        slot_mapping [R, Q] int64 (the cache slot each query's K/V is written at), read_slots [R, KV]
        int64 (the slots of each row's sequence attention reads, in order: its prefix, then the step's
        columns, then anything masked off), prefix [R] int64 (the row's committed tokens, before the
        step's), local [R, Q, Q] bool (query i sees the step's column c), k_cache / v_cache as
        :meth:`new_cache` (written in place)."""
        s = self.shape
        r, q = tokens.shape
        kv_len = read_slots.shape[1]
        h = self.embed(tokens)  # [R, Q, hidden]
        cos = self.cos[positions][:, :, None].to(h.dtype)  # [R, Q, 1, head_dim]
        sin = self.sin[positions][:, :, None].to(h.dtype)
        residual = h
        x = rms_norm(h, self.layers[0].input_norm, s.eps)
        written = slot_mapping.reshape(-1)  # [R*Q]
        mask_of: dict[int | None, torch.Tensor] = {}
        for layer in self.layers:
            if layer.window not in mask_of:
                mask_of[layer.window] = step_mask(positions, prefix, local, kv_len, layer.window, h.dtype)
        for i, layer in enumerate(self.layers):
            xq, xk, xv = attention_inputs(x, layer.qkv.weight, layer.qkv.bias, layer.q_norm, layer.k_norm, cos, sin,
                                          s.heads, s.kv_heads, s.eps)
            at = torch.full_like(written, i)
            k_cache.index_put_((at, written), xk.reshape(r * q, s.kv_heads, s.head_dim))
            v_cache.index_put_((at, written), xv.reshape(r * q, s.kv_heads, s.head_dim))
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            residual, x = attention_and_mlp(xq, k_cache[i][read_slots], v_cache[i][read_slots], mask_of[layer.window],
                                            residual, layer.o.weight, layer.o.bias, layer.post_norm,
                                            layer.gate_up.weight, layer.gate_up.bias, layer.down.weight,
                                            layer.down.bias, nxt, s.eps, self.reduce)
        return x

    def step_ids(self, tokens: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 read_slots: torch.Tensor, prefix: torch.Tensor, local: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, top_k: int) -> torch.Tensor:
        """:meth:`step` reduced to ids on the device: [R, Q, 1 + top_k] int32, each query's argmax
        then its ``top_k`` most likely next tokens (best first): what the step copies back, once."""
        return self.ids_of(self.step(tokens, positions, slot_mapping, read_slots, prefix, local, k_cache, v_cache),
                           top_k)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [P, vocab] of ``hidden`` [P, hidden] (under a vocabulary split, gathered
        from every rank's slice: a collective every rank calls)."""
        shard = self.vocab_shard
        if shard is None:
            return F.linear(hidden, self.head_weight).float()
        return logits_over_shards(F.linear(hidden, self.head_weight[shard.start : shard.stop]).float(), shard)

    def ids_of(self, hidden: torch.Tensor, top_k: int) -> torch.Tensor:
        """[P, 1 + top_k] int32: the argmax after each of ``hidden`` [P, hidden], then its ``top_k``
        most likely next tokens (best first). Under a vocabulary split each rank reduces its slice
        and only the candidates are gathered (every rank calls it)."""
        shard = self.vocab_shard
        if shard is not None:
            local = F.linear(hidden, self.head_weight[shard.start : shard.stop]).float()
            return ids_over_shards(local, shard, top_k)
        logits = self.logits(hidden)
        best = logits.argmax(-1, keepdim=True)
        if top_k == 0:
            return best.to(torch.int32)
        return torch.cat((best, logits.topk(top_k, dim=-1).indices), dim=-1).to(torch.int32)


def from_hf(model: torch.nn.Module, max_positions: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
            vocab_shard: VocabShard | None = None) -> CompactDecoder:
    """A :class:`CompactDecoder` over the weights of ``model`` (a transformers ``*ForCausalLM`` of
    a supported family), on its device and in its dtype; a ValueError for anything the decoder
    would not compute as transformers does.

    No weight is held twice: the decoder shares the model's tensors, and the fused QKV and gate/up
    matrices replace the model's projections, which become views of them (the model still runs,
    e.g. as a reference or for the matrix prior), so the step's memory is the model's.

    A tensor-parallel rank's shard (tr_serve/tp/shard.py: its heads, kv heads and MLP slice, its
    config rewritten to them) becomes that rank's decoder; ``reduce`` sums the row-parallel partial
    results over the ranks. A row-parallel bias lives on rank 0 only: the others add zeros.
    ``vocab_shard``: the rank's slice of the LM head it computes (model/vocab_parallel.py)."""
    cfg = model.config
    features = features_of(cfg)
    heads, kv_heads, head_dim = attention_shape(cfg)
    shape = DecoderShape(cfg.num_hidden_layers, cfg.hidden_size, heads, kv_heads, head_dim, cfg.intermediate_size,
                         cfg.vocab_size, float(cfg.rms_norm_eps))
    inner = model.model
    rotary = inner.rotary_emb
    weight = inner.embed_tokens.weight
    with torch.device("meta"):  # a skeleton: every tensor below is the model's
        dec = CompactDecoder(shape, features, rotary.inv_freq.detach().cpu(), float(rotary.attention_scaling),
                             max_positions, reduce, vocab_shard)
    dec.cos, dec.sin = dec.cos.to(weight.device), dec.sin.to(weight.device)
    row_parallel_bias_elsewhere = getattr(cfg, "tp_rank", 0) > 0  # rank 0 adds the output and down biases
    with torch.no_grad():
        dec.embed.weight = weight
        if dec.lm_head is not None:
            dec.lm_head.weight = model.lm_head.weight
        elif model.lm_head.weight.data_ptr() != weight.data_ptr() and not torch.equal(model.lm_head.weight, weight):
            raise ValueError(f"{features.model_type}: tie_word_embeddings is set but the LM head differs from the embedding")
        dec.norm = inner.norm.weight
        for mine, theirs in zip(dec.layers, inner.layers):
            att, mlp = theirs.self_attn, theirs.mlp
            _check_bias(att.q_proj, features.qkv_bias, "q_proj")
            _check_bias(att.o_proj, features.o_bias, "o_proj", absent_ok=row_parallel_bias_elsewhere)
            _check_bias(mlp.gate_proj, features.mlp_bias, "gate_proj")
            if hasattr(att, "q_norm") != features.qk_norm:
                raise ValueError(f"{features.model_type}: q/k norms {'missing' if features.qk_norm else 'not declared'}")
            mine.input_norm = theirs.input_layernorm.weight
            mine.post_norm = theirs.post_attention_layernorm.weight
            mine.qkv.weight = _fused([att.q_proj, att.k_proj, att.v_proj], "weight")
            mine.qkv.bias = _fused([att.q_proj, att.k_proj, att.v_proj], "bias") if features.qkv_bias else None
            mine.o.weight = att.o_proj.weight
            mine.o.bias = _bias_or_zeros(att.o_proj, mine.o.out_features, weight) if features.o_bias else None
            if features.qk_norm:
                mine.q_norm, mine.k_norm = att.q_norm.weight, att.k_norm.weight
            mine.gate_up.weight = _fused([mlp.gate_proj, mlp.up_proj], "weight")
            mine.gate_up.bias = _fused([mlp.gate_proj, mlp.up_proj], "bias") if features.mlp_bias else None
            mine.down.weight = mlp.down_proj.weight
            mine.down.bias = _bias_or_zeros(mlp.down_proj, mine.down.out_features, weight) if features.mlp_bias else None
    left = [name for name, t in [*dec.named_parameters(), *dec.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{features.model_type}: the decoder found no weight for {left[:4]}")
    return dec.eval().requires_grad_(False)


def _fused(linears: list[torch.nn.Linear], name: str) -> torch.nn.Parameter:
    """One tensor of the ``name`` ("weight" or "bias") of ``linears`` stacked along the output
    features; each linear's own becomes a view of its part, so nothing is held twice."""
    fused = torch.nn.Parameter(torch.cat([getattr(lin, name) for lin in linears]), requires_grad=False)
    at = 0
    for lin in linears:
        n = getattr(lin, name).shape[0]
        setattr(lin, name, torch.nn.Parameter(fused[at : at + n], requires_grad=False))
        at += n
    return fused


def _bias_or_zeros(linear: torch.nn.Linear, size: int, like: torch.Tensor) -> torch.nn.Parameter:
    """A row-parallel bias: a tensor-parallel rank other than 0 has none and adds zeros."""
    if linear.bias is not None:
        return linear.bias
    return torch.nn.Parameter(torch.zeros(size, dtype=like.dtype, device=like.device), requires_grad=False)


def _check_bias(linear: torch.nn.Linear, declared: bool, name: str, absent_ok: bool = False) -> None:
    if (linear.bias is not None) != declared and not (declared and absent_ok):
        raise ValueError(f"{name}: a bias {'declared but absent' if declared else 'present but not declared'}")
