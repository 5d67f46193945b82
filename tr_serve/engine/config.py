"""Engine configuration, validated once when it is made: by ``LLM``, the benches, and the Serve
config (``engine_kwargs`` of ``tr_serve.serve.config.TRServeConfig`` is this dataclass)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tr_serve.model_loader import EMBEDDED_ALIAS
from tr_serve.tr.pair_table import DEFAULT_SLOTS
from tr_serve.tr.suffix_index import DEFAULT_CAPACITY
from tr_serve.tr.tree_spec import DEFAULT_TREE_SETTING, is_plain, parse_tree_spec

# the model tr_serve serves when none is named: the embedded SmolLM2-135M-Instruct (model_loader.py)
DEFAULT_MODEL = EMBEDDED_ALIAS
CPU_KERNEL_MODES = ("auto", "torch")  # measured kernel per token count (kernels/cpu_kernels.py), or F.linear
DECODERS = ("auto", "compact", "transformers")
DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")
# max_num_batched_tokens when none is set: a prefill chunk on a CPU (a chunk's tokens cost about the
# same each from a few dozen up); vLLM's default for chunked prefill on CUDA
DEFAULT_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
# prompt tokens a step that decodes prefills beside its trees: a forward of this many tokens costs
# little more than reading the weights once (FLOPs over memory bandwidth: ~10 tokens on a CPU, a
# few hundred on a GPU), so the step's prefill forward takes about what its verification does and
# a long prompt slows the streams beside it by about 2x instead of stalling them
MIXED_PREFILL_TOKENS = {"cpu": 8, "cuda": 256}


@dataclass(frozen=True)
class EngineConfig:
    """``tree`` is a tree setting (tr/tree_spec.py): ``auto`` (the cost-aware hybrid, default),
    a template name (``2.2.2``, ``top8``, ...) or JSON file of paths, ``<template>+ctx``, ``pld``,
    or ``none`` for plain decoding through the same runner. ``budget="auto"`` with a template
    verifies, each step, the nodes of it that maximise expected tokens per second (calibrated
    latency x online acceptance); ``"fixed"`` always verifies the whole template."""

    model: str = DEFAULT_MODEL
    tree: str = DEFAULT_TREE_SETTING
    k: int = 8
    max_num_seqs: int = 8
    max_model_len: int = 2048
    device: str = "cpu"
    dtype: str = "auto"
    # recycle the prompt's logits into the matrix at prefill: None = fixed templates do, "auto" does
    # not (measured: MAT +0.09-0.10 for fixed trees, none for "auto"; Speculator.seeds_prompts)
    prompt_seeding: bool | None = None
    # second-order rows keyed by (token before, token) beside the matrix (tr/pair_table.py): None =
    # the fixed hybrid templates (``<template>+ctx``) use them, ``auto`` and a bare template (the
    # paper's method) do not (Speculator.uses_pairs); pair_table_slots: the table's size, a power of two
    pair_table: bool | None = None
    pair_table_slots: int = DEFAULT_SLOTS
    # the cross-request suffix index (tr/suffix_index.py): other requests' prompts and outputs draft
    # a branch the budget prices beside the context's. None = ``auto`` uses it (Speculator.uses_suffix),
    # ``true``/``false`` force it (``auto`` only: the other trees have no budget to price it);
    # suffix_index_tokens: the tokens it holds per tenant, that tenant's oldest requests evicted past it
    suffix_index: bool | None = None
    suffix_index_tokens: int = DEFAULT_CAPACITY
    # the rows each named tenant's own text writes over the shared matrix (tr/tenant_rows.py), the
    # ones it wrote least recently evicted past it: k * 4 + 17 bytes a row, plus a 4-byte index per
    # vocabulary token for each tenant that has written one
    tenant_matrix_rows: int = 8192
    # start the matrix's empty rows from the model's own top-k after [BOS, token]
    # (runner/matrix_prior.py: computed once per model, then read from the user cache); in-process
    # runners only (a tensor-parallel replica starts from the fleet's snapshot)
    matrix_prior: bool = True
    # tokens one step's forwards take: its decode rows' tree nodes first, then chunks of pending
    # prompts (chunked prefill; beside decode rows MIXED_PREFILL_TOKENS at most);
    # None: the device's default (DEFAULT_BATCHED_TOKENS)
    max_num_batched_tokens: int | None = None
    kv_cache_memory_gb: float | None = None  # caps rows x max_model_len; None = max_num_seqs rows
    budget: str = "fixed"
    online_latency: bool = True  # budget "auto": correct the calibrated latency with measured steps
    # "auto": on CPU in float32, the fastest measured linear kernel per token count (kernels/cpu_kernels.py)
    # and the native tree attention (kernels/tree_attention.py); "torch": torch's own F.linear and attention
    cpu_kernels: str = "auto"
    # which model code runs the step (runner/factory.py): "compact", tr_serve's own decoder over bucketed
    # static shapes (tr_serve/model/decoder.py, runner/decoder_runner.py); "transformers", the loaded
    # model's layers (with the native CPU kernels where cpu_kernels allows); "auto": compact on CUDA,
    # transformers elsewhere (on a CPU the native kernels are faster)
    decoder: str = "auto"
    compile: bool = False  # the compact decoder's steps through torch.compile(fullgraph=True), one graph per bucket
    # automatic prefix caching (engine/prefix_cache.py): a prompt starting with full blocks of
    # block_size tokens that a row's KV holds for the same tenant skips their prefill
    enable_prefix_caching: bool = True
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.budget not in ("fixed", "auto"):
            raise ValueError(f"budget must be 'fixed' or 'auto', got {self.budget!r}")
        if self.cpu_kernels not in CPU_KERNEL_MODES:
            raise ValueError(f"cpu_kernels must be 'auto' or 'torch', got {self.cpu_kernels!r}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {self.decoder!r}")
        if self.compile and self.decoder == "transformers":
            raise ValueError("compile applies to the compact decoder: set decoder 'compact' or 'auto'")
        if self.pair_table_slots < 1 or self.pair_table_slots & (self.pair_table_slots - 1):
            raise ValueError(f"pair_table_slots must be a power of two, got {self.pair_table_slots}")
        if self.suffix_index_tokens < 1:
            raise ValueError(f"suffix_index_tokens must be >= 1, got {self.suffix_index_tokens}")
        if self.tenant_matrix_rows < 1:
            raise ValueError(f"tenant_matrix_rows must be >= 1, got {self.tenant_matrix_rows}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        try:
            spec = parse_tree_spec(self.tree, self.budget)
        except ValueError as e:
            raise ValueError(str(e)) from None
        if self.suffix_index and not spec.prices_branches:
            raise ValueError(f"suffix_index needs tree 'auto' (its branch is priced by the cost-aware budget), "
                             f"got tree {self.tree!r}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if isinstance(self.device, str) and not DEVICE.match(self.device):
            raise ValueError(f"unknown device {self.device!r}: use cpu, cuda, cuda:N or mps")
        import torch

        from tr_serve.model_loader import parse_dtype  # "auto": float32 on CPU (docs/kernels.md: bfloat16 on CPU)

        if not isinstance(self.dtype, torch.dtype):  # load_model takes a torch dtype too
            parse_dtype(self.dtype, self.device)  # ValueError for an unknown name

    @property
    def batched_tokens(self) -> int:
        """``max_num_batched_tokens``, or the device's default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_BATCHED_TOKENS[self._device_kind]

    @property
    def mixed_prefill_tokens(self) -> int:
        """Prompt tokens a step that decodes prefills beside its trees (MIXED_PREFILL_TOKENS)."""
        return MIXED_PREFILL_TOKENS[self._device_kind]

    @property
    def _device_kind(self) -> str:
        return "cuda" if str(self.device).startswith("cuda") else "cpu"

    @property
    def speculative(self) -> bool:
        return not is_plain(self.tree)
