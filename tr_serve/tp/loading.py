"""Per-rank sharded loading: each tensor-parallel rank reads only its own slices of the checkpoint.

``load_model`` followed by ``shard_model`` costs every rank a full copy of the weights in host memory
(eight ranks of a 141 GB Llama-3.1-70B: about 1.1 TB) and reads the checkpoint once per rank in full.
Here each rank instead

1. builds the model skeleton on the ``meta`` device (no storage at all) from ``config.json``;
2. applies ``shard_model`` to the skeleton, so every parameter already has this rank's shape and the
   row-parallel layers their all-reduce hooks;
3. walks the ``*.safetensors`` files and reads, per tensor, ``safe_open(...).get_slice(name)[rows]``
   (column-parallel: ``q/k/v_proj``, ``gate/up_proj`` and the q/k/v biases of Qwen2) or
   ``[:, cols]`` (row-parallel: ``o_proj``, ``down_proj``), and replicated tensors (embeddings,
   norms, ``lm_head``) whole; each slice is converted to the serving dtype on its own and placed on
   the target device before the next one is read, so the host never holds more than this rank's
   shard plus one slice;
4. rebuilds what the checkpoint does not hold (the rotary tables, recomputed from the config) and
   re-ties ``lm_head`` to the embeddings when the config ties them.

Each file is reopened for every tensor: ``safe_open`` maps the file, and pages of a mapping stay
resident (and count in the process's RSS) until it is closed, so one long-lived handle per file
would hold every page this rank touched until the end of the file.

A GGUF model (or the embedded alias) goes through ``model_loader``'s cached safetensors conversion
first; the conversion runs once (a file lock keeps concurrent ranks from doing it together). Model
families: those of ``shard.SUPPORTED_MODEL_TYPES`` (Llama, Mistral, Qwen2); any other model type is
refused with its name before anything is read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from tr_serve.tp.shard import ShardingError, check_shardable, shard_model

logger = logging.getLogger(__name__)

# parameter-name suffix -> how rank r of N slices it ("rows": dim 0, "cols": dim 1, "first": rank 0 only)
_COLUMN_PARALLEL = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.bias")
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_ROW_PARALLEL_BIAS = ("self_attn.o_proj.bias", "mlp.down_proj.bias")


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded shard by shard (no safetensors, missing or unexpected tensors)."""


def resolve_checkpoint(model: str) -> Path:
    """The local directory with ``config.json`` and ``*.safetensors`` files for ``model``: a
    directory, a ``.gguf`` file or the embedded alias (through the cached safetensors conversion),
    or a hub id already in the local hub cache."""
    from tr_serve.model_loader import EMBEDDED_ALIAS, embedded_gguf_path, ensure_gguf_safetensors

    path = Path(model).expanduser()
    if model == EMBEDDED_ALIAS:
        return ensure_gguf_safetensors(embedded_gguf_path())
    if path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return ensure_gguf_safetensors(path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download  # a hub id: its safetensors files, downloaded once

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))


def _files_by_tensor(folder: Path) -> dict[str, Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors files: per-rank sharded loading reads safetensors only")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                out[name] = f
    return out


def slice_spec(name: str, rank: int, world_size: int, shape: tuple[int, ...]) -> tuple[str, int, int] | None:
    """How rank ``rank`` of ``world_size`` reads tensor ``name`` of full shape ``shape``:
    ``("rows" | "cols", start, stop)``, ``("whole", 0, n)`` or None (not on this rank)."""
    if world_size == 1:
        return ("whole", 0, shape[0] if shape else 0)
    if name.endswith(_COLUMN_PARALLEL):
        n = shape[0] // world_size
        return ("rows", rank * n, (rank + 1) * n)
    if name.endswith(_ROW_PARALLEL):
        n = shape[1] // world_size
        return ("cols", rank * n, (rank + 1) * n)
    if name.endswith(_ROW_PARALLEL_BIAS):  # added once, after the all-reduce
        return ("whole", 0, shape[0]) if rank == 0 else None
    return ("whole", 0, shape[0] if shape else 0)


def read_slice(file: Path, name: str, spec: tuple[str, int, int]) -> torch.Tensor:
    """Only the bytes of ``spec`` from ``file`` (the file is mapped for this read only)."""
    from safetensors import safe_open

    kind, start, stop = spec
    with safe_open(str(file), framework="pt") as handle:
        sl = handle.get_slice(name)
        if kind == "rows":
            return sl[start:stop]
        if kind == "cols":
            return sl[:, start:stop]
        return sl[:]


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise CheckpointError(f"the checkpoint holds {name!r}, which the model has no parameter or buffer for")


def _rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    """Recompute the non-persistent buffers (rotary tables) that the meta skeleton left empty."""
    for name, module in list(model.named_modules()):
        meta_buffers = [b for b, t in module._buffers.items() if t is not None and t.is_meta]
        if not meta_buffers:
            continue
        if "rotary" not in type(module).__name__.lower():
            raise CheckpointError(f"buffer(s) {meta_buffers} of {name} ({type(module).__name__}) are neither in "
                                  "the checkpoint nor rebuildable")
        fresh = type(module)(config=module.config).to(device)
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, fresh)


def load_sharded(folder: str | Path, rank: int, world_size: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu", reduce: bool = True, group=None) -> nn.Module:
    """This rank's shard of the causal LM in ``folder`` (``config.json`` + safetensors), built on
    the meta device and filled slice by slice; row-parallel layers all-reduce over ``group`` when
    ``reduce`` (needs an initialised process group at forward time). ``world_size == 1`` loads the
    whole model through the same path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    device = torch.device(device)
    config = AutoConfig.from_pretrained(folder)
    check_shardable(config, world_size)  # names an unsupported model type before anything is read
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    shard_model(model, rank, world_size, group=group, reduce=reduce)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    if tied:
        expected.discard("lm_head.weight")
    if world_size > 1 and rank != 0:  # row-parallel biases live on rank 0 only (shard_model dropped them)
        expected = {n for n in expected if not n.endswith(_ROW_PARALLEL_BIAS)}
    files = _files_by_tensor(folder)
    loaded: set[str] = set()
    for name, file in files.items():
        if tied and name == "lm_head.weight":
            continue
        from safetensors import safe_open

        with safe_open(str(file), framework="pt") as handle:
            shape = tuple(handle.get_slice(name).get_shape())
        spec = slice_spec(name, rank, world_size, shape)
        if spec is None:
            continue
        if name not in expected:
            raise CheckpointError(f"the checkpoint holds {name!r}, which this {config.model_type} model does not have")
        value = read_slice(file, name, spec).to(device=device, dtype=dtype)  # one slice converted at a time
        _set_tensor(model, name, value)
        loaded.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise CheckpointError(f"{folder} lacks {len(missing)} tensor(s) of the model, e.g. {missing[:5]}")
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    _rebuild_rotary(model, device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"tensors left unloaded: {left[:5]}")
    return model


def load_sharded_model(model: str, rank: int, world_size: int, dtype: torch.dtype, device: str = "cpu",
                       reduce: bool = True, group=None):
    """``LoadedModel`` of this rank's shard of ``model`` (a directory, ``.gguf``, the embedded alias
    or a cached hub id), with the tokenizer and end-of-sequence ids of the full model."""
    from transformers import AutoTokenizer

    from tr_serve.model_loader import LoadedModel, eos_ids

    folder = resolve_checkpoint(model)
    hf_model = load_sharded(folder, rank, world_size, dtype, device, reduce=reduce, group=group)
    try:
        from transformers import GenerationConfig

        hf_model.generation_config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError):
        pass
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return LoadedModel(hf_model, tokenizer, model, eos_ids(hf_model, tokenizer))


__all__ = ["CheckpointError", "ShardingError", "load_sharded", "load_sharded_model", "resolve_checkpoint",
           "slice_spec"]
