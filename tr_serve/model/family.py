"""What each supported family adds to the Llama decoder, declared in one place.

Why a declaration: a feature the decoder does not apply (a sliding window, q/k norms, biases)
changes the model's output, so the load refuses a model whose features are not declared here
rather than serving it silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> whether the family may have q/k norms (Qwen3) and biases on q, k, v (Qwen2)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class FamilyFeatures:
    """The differences from plain Llama the decoder applies.

    qkv_bias      biases on the query, key and value projections (Qwen2; Llama's ``attention_bias``)
    o_bias        a bias on the output projection (Llama's ``attention_bias``)
    mlp_bias      biases on gate, up and down (Llama's ``mlp_bias``)
    qk_norm       an RMSNorm over each head of the queries and keys before the rotary embedding (Qwen3)
    windows       per layer, the sliding window (keys at most ``window - 1`` positions back), None: full
    tied          the LM head is the token embedding
    """

    model_type: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    windows: tuple[int | None, ...]
    tied: bool


def features_of(config: Any) -> FamilyFeatures:
    """The features of a transformers config of a supported family; a ValueError names anything else."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"the compact decoder serves {', '.join(SUPPORTED)} models, not {model_type!r}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{model_type}: hidden_act {act!r} is not supported (silu only)")
    layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        window = None
    if window is None:
        windows: tuple[int | None, ...] = (None,) * layers
    elif types is not None:
        windows = tuple(window if t == "sliding_attention" else None for t in types)
    else:
        windows = (int(window),) * layers  # Mistral: every layer
    attention_bias = bool(getattr(config, "attention_bias", False))
    return FamilyFeatures(
        model_type=model_type,
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        windows=windows,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )
