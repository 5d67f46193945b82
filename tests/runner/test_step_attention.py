"""The step attention of every runner without the native CPU tree attention (CUDA, bfloat16,
``cpu_kernels: torch``), run here on CPU in float32: equal to the runner's 4D-mask path, never
copies key/value heads or cache rows, and each row attends over its own slots only."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tr_serve.runner import model_runner, step_attention
from tr_serve.runner.model_runner import ModelRunner, build_step_mask
from tr_serve.runner.step_attention import FLEX_BLOCK, StepAttention

HEAD_DIM = 16  # FlexAttention's smallest head size
ROWS = [4, 0, 2]  # out of cache order, with gaps
CHUNKS = {4: [60, 60, 60], 0: [3], 2: [40]}  # prefill chunks per row (contexts 180, 3 and 40: across a 128 block)
WIDTHS = [4, 2, 3]  # real tree nodes per row in the ragged verify
TREES = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                      [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
                      [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]], dtype=torch.bool)
TOKENS = torch.tensor([[7, 9, 11, 13], [21, 22, 0, 0], [4, 5, 6, 0]])
DEPTHS = torch.tensor([[0, 1, 1, 2], [0, 1, 1, 1], [0, 1, 2, 2]])


def tiny(arch: str = "llama", heads: int = 4, kv_heads: int = 2, seed: int = 0) -> torch.nn.Module:
    """A 2-layer random model of head size 16 on ``sdpa``: Llama (the runner's own layer loop) or
    Qwen2 (transformers' forward, attention through the runner's attention function)."""
    torch.manual_seed(seed)
    cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = cls(vocab_size=300, hidden_size=heads * HEAD_DIM, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return model_cls(config).eval().requires_grad_(False)


def prefill(runner: ModelRunner) -> None:
    """Rows 4, 0, 2 to contexts 180, 3 and 40, in chunks (row 4 is written over three steps)."""
    for step in range(3):
        rows = [r for r in ROWS if step < len(CHUNKS[r])]
        prompts = [[(r * 37 + step * 11 + j) % 290 + 5 for j in range(CHUNKS[r][step])] for r in rows]
        runner.prefill(torch.tensor(rows), prompts)


def steps(runner: ModelRunner, garbage=None) -> list[torch.Tensor]:
    """Ragged prefill, a verify of rows of different widths (packed logits), a compaction, a verify
    at the full width, and a one-token step of one row. ``garbage(runner)`` runs before each verify."""
    prefill(runner)
    out = []
    for i, call in enumerate(("ragged", "full", "one")):
        if garbage is not None:
            garbage(runner, i)
        if call == "ragged":
            out.append(runner.verify(torch.tensor(ROWS), TOKENS, DEPTHS, TREES, torch.tensor(WIDTHS)))
            runner.compact(torch.tensor(ROWS), [torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0, 1, 2])])
        elif call == "full":
            out.append(runner.verify(torch.tensor(ROWS), TOKENS, DEPTHS, TREES))
        else:
            out.append(runner.verify(torch.tensor([0]), TOKENS[1:2, :1], DEPTHS[1:2, :1], TREES[1:2, :1, :1]))
    return out


@contextlib.contextmanager
def mask_path(mp: pytest.MonkeyPatch):
    """Today's path: transformers' forward under the runner's 4D mask [b, 1, q, longest row]."""
    with mp.context() as m:
        m.setattr(model_runner, "takes_step", lambda model: False)
        m.setattr(model_runner, "body_for", lambda model: None)
        yield


def runner_for(model, backend: str, fold: bool = False, layers: str = "body", mp: pytest.MonkeyPatch | None = None):
    runner = ModelRunner(model, 6, 320, tree_attention_enabled=False)
    assert not runner.tree_attention
    runner.step_backend = backend
    if fold:
        mp.setattr(model_runner, "StepAttention", functools.partial(StepAttention, fold=True))
    if layers == "transformers":
        mp.setattr(model_runner, "body_for", lambda model: None)
    return runner


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want) == 3
    assert got[0].shape == (sum(WIDTHS), 300)  # packed real nodes
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert torch.allclose(a, b, rtol=0, atol=2e-5), (a - b).abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


ROWS_CASES = [("llama", 4, 2, "body", False), ("llama", 4, 2, "body", True), ("llama", 4, 2, "transformers", False),
              ("llama", 4, 2, "transformers", True), ("llama", 4, 4, "body", False), ("llama", 4, 4, "transformers", True),
              ("qwen2", 4, 2, "transformers", False), ("qwen2", 6, 2, "transformers", True)]


@pytest.mark.parametrize("arch,heads,kv_heads,layers,fold", ROWS_CASES)
def test_rows_kernel_equals_the_mask_path_in_float32(arch, heads, kv_heads, layers, fold, monkeypatch):
    """Grouped (4 on 2, 6 on 2) and plain (4 on 4) heads, the runner's layer loop and transformers'
    forward, grouped heads by enable_gqa (CPU) or folded into the query axis (CUDA's way)."""
    model = tiny(arch, heads, kv_heads)
    with mask_path(monkeypatch):
        want = steps(ModelRunner(model, 6, 320, tree_attention_enabled=False))
    got = steps(runner_for(model, "rows", fold, layers, monkeypatch))
    assert_close(got, want)


@pytest.fixture
def flex_clean():
    step_attention.flex_failure = None
    yield
    failure, step_attention.flex_failure = step_attention.flex_failure, None
    assert failure is None, f"FlexAttention fell back: {failure}"


@pytest.mark.parametrize("heads,kv_heads,layers", [(4, 2, "body"), (4, 2, "transformers"), (4, 4, "body")])
def test_flex_kernel_equals_the_mask_path_in_float32(heads, kv_heads, layers, monkeypatch, flex_clean):
    """The CUDA kernel, compiled for this CPU (a graph per query bucket: 64 and 16 here)."""
    model = tiny("llama", heads, kv_heads)
    with mask_path(monkeypatch):
        want = steps(ModelRunner(model, 6, 320, tree_attention_enabled=False))
    got = steps(runner_for(model, "flex", layers=layers, mp=monkeypatch))
    assert_close(got, want)


# ---- no copies of key/value heads or of the cache -------------------------------------------------
class _Raise:
    def __init__(self, what: str):
        self.what = what

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"{self.what} called while a grouped-query model verifies a tree")


def forbid_expansion(mp: pytest.MonkeyPatch) -> None:
    """transformers' repeat_kv (every module that has one) and torch's repeat_interleave (what
    FlexAttention's uncompiled reference copies K/V with) raise."""
    import transformers.integrations.sdpa_attention as sdpa_integration
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen2.modeling_qwen2 as qwen2

    for module in (llama, qwen2, sdpa_integration):
        mp.setattr(module, "repeat_kv", _Raise(f"{module.__name__}.repeat_kv"))
    mp.setattr(torch, "repeat_interleave", _Raise("torch.repeat_interleave"))
    mp.setattr(torch.Tensor, "repeat_interleave", _Raise("Tensor.repeat_interleave"))


_ATTENTION_OPS = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention")


class CacheReads(TorchDispatchMode):
    """Every operation that takes a tensor aliasing the KV cache's memory: views of it, writes into
    it (in-place, the cache first) and attention calls (whose key lengths are recorded) pass; any
    other (a copy: clone, index, cat, repeat_interleave, an expanded view made contiguous, ...) raises."""

    def __init__(self, cache):
        super().__init__()
        self.storages = {cache.k_all.untyped_storage().data_ptr(), cache.v_all.untyped_storage().data_ptr()}
        self.key_lengths: list[int] = []
        self.query_shapes: list[tuple[int, ...]] = []

    def _aliases(self, x) -> bool:
        return torch.is_tensor(x) and x.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = list(args) + list(kwargs.values())
        if any(self._aliases(a) for a in flat):
            name = func.overloadpacket.__name__
            if name in _ATTENTION_OPS:
                self.key_lengths.append(args[1].shape[-2])
                self.query_shapes.append(tuple(args[0].shape))
            elif not func.is_view and not (name.endswith("_") and self._aliases(args[0])
                                           and not any(self._aliases(a) for a in flat[1:])):
                raise AssertionError(f"{func} read the KV cache into a new tensor")
        return func(*args, **kwargs)


@pytest.mark.parametrize("layers,fold", [("body", False), ("body", True), ("transformers", False), ("transformers", True)])
def test_rows_kernel_copies_no_kv_and_reads_each_row_at_its_length(layers, fold, monkeypatch):
    model = tiny("llama", 6, 2)  # 3 query heads per key/value head
    runner = runner_for(model, "rows", fold, layers, monkeypatch)
    prefill(runner)
    forbid_expansion(monkeypatch)
    spy = CacheReads(runner.cache)
    with spy:
        runner.verify(torch.tensor(ROWS), TOKENS, DEPTHS, TREES, torch.tensor(WIDTHS))
    contexts = [sum(CHUNKS[r]) for r in ROWS]
    per_layer = [p + w for p, w in zip(contexts, WIDTHS)]  # each row: its prefix and its own nodes
    assert spy.key_lengths == per_layer * model.config.num_hidden_layers
    heads = [(1, 2, 3 * w, HEAD_DIM) if fold else (1, 6, w, HEAD_DIM) for w in WIDTHS]  # folded: kv heads x (group * w)
    assert spy.query_shapes == heads * model.config.num_hidden_layers


def test_the_guards_catch_copying_attention(monkeypatch):
    """The checks above can fail: transformers' eager attention copies K/V per query head
    (repeat_kv), and today's CUDA path reads every row over the longest row's slots."""
    model = tiny("llama", 6, 2)
    runner = ModelRunner(model, 6, 320, tree_attention_enabled=False)
    prefill(runner)
    with monkeypatch.context() as m:
        forbid_expansion(m)
        m.setattr(model_runner, "body_for", lambda model: None)
        model.config._attn_implementation = "eager"
        try:
            with pytest.raises(AssertionError, match="repeat_kv"):
                runner.verify(torch.tensor(ROWS), TOKENS, DEPTHS, TREES, torch.tensor(WIDTHS))
        finally:
            model.config._attn_implementation = "sdpa"
    with monkeypatch.context() as m, pytest.raises(AssertionError, match="KV cache into a new tensor"):
        with mask_path(m), CacheReads(runner.cache):  # rows 4, 0, 2 are not one run: gathered
            runner.verify(torch.tensor(ROWS), TOKENS, DEPTHS, TREES, torch.tensor(WIDTHS))


def test_flex_kernel_runs_compiled_without_expansion(monkeypatch, flex_clean):
    """FlexAttention uncompiled copies K/V per query head (repeat_interleave): with that forbidden,
    a grouped-query verify through the compiled kernel still runs and agrees with the rows kernel."""
    model = tiny("llama", 6, 2)
    for layers in ("body", "transformers"):
        with monkeypatch.context() as m:
            warm = steps(runner_for(model, "flex", layers=layers, mp=m))  # compiles (tracing uses the reference)
            runner = runner_for(model, "flex", layers=layers, mp=m)
            prefill(runner)
            forbid_expansion(m)
            got = runner.verify(torch.tensor(ROWS), TOKENS, DEPTHS, TREES, torch.tensor(WIDTHS))
        assert torch.allclose(got, warm[0], rtol=0, atol=1e-5)


# ---- each row over its own length ------------------------------------------------------------------
def nan_past(bound):
    """garbage(runner, call): NaN into every layer's K and V of each step row from ``bound(prefix,
    width)`` on; attention that reads a slot of it, masked or not, turns NaN (0 x NaN)."""
    widths_per_call = {0: WIDTHS, 1: [4, 4, 4]}

    def garbage(runner, call):
        if call not in widths_per_call:
            return
        for row, w in zip(ROWS, widths_per_call[call]):
            start = bound(int(runner.cache.lens[row]), w)
            runner.cache.k_all[:, row, :, start:] = float("nan")
            runner.cache.v_all[:, row, :, start:] = float("nan")
    return garbage


def test_rows_of_different_lengths_attend_over_their_own(monkeypatch, flex_clean):
    """Rows of contexts 180, 3 and 40 in one step: NaN in every slot past a row's own (the rows
    kernel) or past the last 128-slot block it needs (FlexAttention's tile) leaves its logits
    exactly as they were. Today's 4D-mask path reads the short rows up to the longest and turns NaN."""
    model = tiny("llama", 4, 2)
    for backend, bound in (("rows", lambda p, w: p + w), ("flex", lambda p, w: -(-(p + w) // FLEX_BLOCK) * FLEX_BLOCK)):
        clean = steps(runner_for(model, backend, mp=monkeypatch))
        dirty = steps(runner_for(model, backend, mp=monkeypatch), nan_past(bound))
        for a, b in zip(dirty, clean):
            assert torch.equal(a, b), backend
    with mask_path(monkeypatch):
        old = steps(ModelRunner(model, 6, 320, tree_attention_enabled=False), nan_past(lambda p, w: p + w))
    assert old[0].isnan().any()


def test_block_mask_visits_each_rows_blocks_only():
    """The BlockMask of rows 4, 0, 2 (a batch of cache rows 0..4, rows 1 and 3 not in the step): the prefix as full
    blocks, the tree's blocks as partial ones, no block past a row's length; inside them the
    mask_mod sees what the 4D mask sees."""
    from torch.nn.attention.flex_attention import create_mask

    starts, widths, q, kv_len = [250, 3, 127], [4, 2, 3], 4, 384
    local = TREES & (torch.arange(q)[None, None, :] < torch.tensor(widths)[:, None, None])
    plan = step_attention._FlexPlan(StepAttention(ROWS, starts, widths, TREES, q, torch.float32, torch.device("cpu"),
                                                  "flex"))
    mask = plan.block_mask_for(kv_len)
    full = mask.full_kv_num_blocks[:, 0, 0].tolist()
    partial = mask.kv_num_blocks[:, 0, 0].tolist()
    # cache rows 0..4: row 0 (P 3), 1 (absent), 2 (P 127, crosses into block 1), 3 (absent), 4 (P 250)
    assert full == [0, 0, 0, 0, 1]
    assert partial == [1, 0, 2, 0, 1]
    assert mask.kv_indices[4, 0, 0, 0] == 1 and mask.kv_indices[2, 0, 0, :2].tolist() == [0, 1]
    dense = create_mask(mask.mask_mod, plan.batch, 1, plan.q_len, kv_len, device="cpu")[:, 0, :q]  # [rows, q, kv]
    want = build_step_mask(torch.tensor(starts), local, kv_len, torch.float32)[:, 0] == 0  # [b, q, kv]
    for i, row in enumerate(ROWS):
        end = starts[i] + widths[i]
        assert torch.equal(dense[row, : widths[i], :end], want[i, : widths[i], :end])  # real queries, own slots
        assert not dense[row, :, end:].any()  # nothing past its own slots


def test_a_flex_compile_failure_falls_back_to_the_rows_kernel(monkeypatch):
    from torch._dynamo.exc import BackendCompilerFailed

    def broken(*args, **kwargs):
        raise BackendCompilerFailed(lambda *a: None, RuntimeError("no triton"), None)

    model = tiny("llama", 4, 2)
    want = steps(runner_for(model, "rows", mp=monkeypatch))
    monkeypatch.setattr(step_attention, "compiled_flex", broken)
    monkeypatch.setattr(step_attention, "flex_failure", None)
    got = steps(runner_for(model, "flex", mp=monkeypatch))
    assert "no triton" in step_attention.flex_failure
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_default_backend(monkeypatch):
    monkeypatch.delenv(step_attention.ENV, raising=False)
    assert step_attention.default_backend(torch.device("cpu")) == "rows"
    assert step_attention.default_backend(torch.device("cuda")) == "flex"
    monkeypatch.setenv(step_attention.ENV, "rows")
    assert step_attention.default_backend(torch.device("cuda")) == "rows"
    monkeypatch.setenv(step_attention.ENV, "flex")
    assert step_attention.default_backend(torch.device("cpu")) == "flex"
    monkeypatch.setenv(step_attention.ENV, "math")
    with pytest.raises(ValueError, match="TR_SERVE_STEP_ATTENTION"):
        step_attention.default_backend(torch.device("cpu"))
    assert [step_attention.flex_query_length(q) for q in (1, 16, 17, 81, 128, 129, 300)] == [16, 16, 32, 128, 128, 256, 384]


def test_bfloat16_runner_takes_the_step_attention(monkeypatch):
    """A bfloat16 runner on CPU is on the step attention; its argmax agrees with the 4D-mask path."""
    model = tiny("llama", 4, 2).to(torch.bfloat16)
    runner = ModelRunner(model, 6, 320)
    assert not runner.tree_attention and runner.step_backend == "rows"
    got = steps(runner)
    with mask_path(monkeypatch):
        want = steps(ModelRunner(model, 6, 320))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=0, atol=0.1)


def test_a_layer_that_attends_elsewhere_is_refused(monkeypatch):
    """transformers' forward with the step: every layer must come to the step attention (the cache
    hands out its whole buffers and the model gets no mask, so any other attention would be wrong)."""
    model = tiny("qwen2", 4, 2)
    runner = runner_for(model, "rows", mp=monkeypatch)
    attn = model.model.layers[1].self_attn
    monkeypatch.setattr(attn, "forward", lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None))
    with pytest.raises(RuntimeError, match="1 of 2 layers attended"):
        prefill(runner)


def test_rows_masks_are_per_row_small_and_aligned():
    """The rows kernel's masks: one per row, [w, P + w] (the folded one [group * w, P + w]), built
    once per step, at a row stride CUDA's memory-efficient kernel takes without a padded copy."""
    starts, widths = [250, 3, 127], [4, 2, 3]
    step = StepAttention(ROWS, starts, widths, TREES, 4, torch.float32, torch.device("cpu"), fold=True)
    for i, (p, w) in enumerate(zip(starts, widths)):
        bias, folded = step._bias(i), step._folded_bias(i, 3)
        assert bias.shape == (w, p + w) and folded.shape == (3 * w, p + w)
        assert bias.stride(0) % step_attention.MASK_ALIGN == 0 and folded.stride(0) % step_attention.MASK_ALIGN == 0
        assert torch.equal(folded.view(3, w, p + w), bias.expand(3, w, p + w))
        assert not bias[:, :p].any()  # the prefix: all seen
        assert torch.equal(bias[:, p:] == 0, TREES[i, :w, :w])
    assert step._bias(1) is step._bias(1)
