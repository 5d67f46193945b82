"""Megatron-style tensor-parallel sharding of a Llama-architecture model, done by the project itself.

Why not transformers' own ``tp_plan``: that path expects a torchrun-style launch (it initialises
the default process group and a ``DeviceMesh`` itself from ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``)
and shards through DTensor while loading. Here Ray actors own the processes, the rendezvous is
ours (``tcp://ip:port`` passed by the driver), and the KV cache is the project's own
``SlotKVCache``, sized from ``model.config``. Slicing the weights of an already loaded model is a
few lines, works with gloo on CPU and NCCL on GPU, and keeps the model a plain ``nn.Module`` that
the runner drives exactly as it drives the unsharded one.

Layout of rank ``r`` of ``N`` (heads split, hidden states replicated):

* ``q_proj``: output rows of attention heads ``r*h/N .. (r+1)*h/N``; ``k_proj``/``v_proj``: output
  rows of kv heads ``r*kv/N .. (r+1)*kv/N`` (query head ``j`` reads kv head ``j // (h/kv)``, so
  every rank keeps whole GQA groups and ``num_key_value_groups`` is unchanged);
* ``o_proj``: the matching input columns; its output is a partial sum -> all-reduce (sum);
* MLP: ``gate_proj``/``up_proj`` output rows ``r*I/N .. (r+1)*I/N``, ``down_proj`` the matching
  input columns, then all-reduce (sum);
* embeddings, norms, rotary tables and ``lm_head``: replicated, so after the all-reduces every
  rank holds the same hidden states and computes the same logits.

A row-parallel layer's bias is kept on rank 0 only (it must be added once). ``model.config`` is
rewritten per rank (``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``; an
explicit ``head_dim``) so that the runner sizes the KV cache for this rank's kv heads only.
``LlamaAttention`` reshapes with ``-1`` heads and keeps ``head_dim`` / ``scaling`` /
``num_key_value_groups`` as attributes, none of which change.
"""

from __future__ import annotations

from torch import nn

from tr_serve.model_shape import attention_shape

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")  # same layer layout; qwen2 adds q/k/v biases


class ShardingError(ValueError):
    """The model cannot be split over this many ranks."""


def check_shardable(config, world_size: int) -> None:
    """Raise ShardingError naming the problem when ``config`` cannot be split ``world_size`` ways."""
    if world_size < 1:
        raise ShardingError(f"tensor_parallel_size must be >= 1, got {world_size}")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ShardingError(f"tensor parallelism supports the model types {list(SUPPORTED_MODEL_TYPES)}; this model's "
                            f"model_type is {model_type!r}")
    heads, kv_heads, _ = attention_shape(config)
    problems = []
    if heads % world_size:
        problems.append(f"num_attention_heads={heads}")
    if kv_heads % world_size:
        problems.append(f"num_key_value_heads={kv_heads}")
    if config.intermediate_size % world_size:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if problems:
        raise ShardingError(f"tensor_parallel_size={world_size} must divide {', '.join(problems)} of this model; "
                            f"choose a divisor of gcd(num_attention_heads, num_key_value_heads) = "
                            f"{_gcd(heads, kv_heads)}")


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _keep_rows(linear: nn.Linear, start: int, stop: int) -> None:
    """Column-parallel: keep output features start..stop (and their bias)."""
    linear.weight = nn.Parameter(linear.weight.data[start:stop].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def _keep_cols(linear: nn.Linear, start: int, stop: int, keep_bias: bool) -> None:
    """Row-parallel: keep input features start..stop; the bias stays on one rank only."""
    linear.weight = nn.Parameter(linear.weight.data[:, start:stop].clone(), requires_grad=False)
    if linear.bias is not None and not keep_bias:
        linear.bias = None
    linear.in_features = stop - start


def all_reduce_hook(group=None):
    """A forward hook that sums the module's output over the group, in place."""
    import torch.distributed as dist

    def hook(module, inputs, output):
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
        return output

    return hook


def shard_model(model: nn.Module, rank: int, world_size: int, group=None, reduce: bool = True) -> nn.Module:
    """Shard ``model`` (a ``LlamaForCausalLM``, ``MistralForCausalLM`` or ``Qwen2ForCausalLM``) in place for ``rank`` of ``world_size`` and return it.

    With ``reduce`` the row-parallel layers all-reduce their output over ``group`` (the default
    process group when None); without it they return partial sums (for tests without a group).
    """
    config = model.config
    check_shardable(config, world_size)
    if not 0 <= rank < world_size:
        raise ShardingError(f"rank {rank} is outside 0..{world_size - 1}")
    if world_size == 1:
        return model
    heads, kv_heads, head_dim = attention_shape(config)
    inter = config.intermediate_size
    h, kv, i = heads // world_size, kv_heads // world_size, inter // world_size
    q0, k0, i0 = rank * h * head_dim, rank * kv * head_dim, rank * i
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.q_proj, q0, q0 + h * head_dim)
        _keep_rows(attn.k_proj, k0, k0 + kv * head_dim)
        _keep_rows(attn.v_proj, k0, k0 + kv * head_dim)
        _keep_cols(attn.o_proj, q0, q0 + h * head_dim, keep_bias=rank == 0)
        _keep_rows(mlp.gate_proj, i0, i0 + i)
        _keep_rows(mlp.up_proj, i0, i0 + i)
        _keep_cols(mlp.down_proj, i0, i0 + i, keep_bias=rank == 0)
        if getattr(attn, "num_heads", None) is not None:  # older transformers kept per-module counts
            attn.num_heads = h
        if getattr(attn, "num_key_value_heads", None) is not None:
            attn.num_key_value_heads = kv
        if getattr(mlp, "intermediate_size", None) is not None:
            mlp.intermediate_size = i
        if reduce:
            attn.o_proj.register_forward_hook(all_reduce_hook(group))
            mlp.down_proj.register_forward_hook(all_reduce_hook(group))
    # per-rank config: the runner sizes the KV cache from it (head_dim made explicit first)
    config.head_dim = head_dim
    config.num_attention_heads = h
    config.num_key_value_heads = kv
    config.intermediate_size = i
    config.tp_rank = rank
    config.tp_world_size = world_size
    return model
