"""The slot KV cache and the per-step attention mask, on tiny tensors; then the runner on the real
model against a plain full forward."""

from __future__ import annotations

import pytest
import torch

from tr_serve.runner.kv_cache import SlotKVCache
from tr_serve.runner.model_runner import ModelRunner, build_step_mask
from tr_serve.tr.tree import compile_tree

NEG = torch.finfo(torch.float32).min


def visible(mask: torch.Tensor) -> list:
    return (mask == 0).squeeze(1).int().tolist()


def test_step_mask_two_rows_with_different_starts():
    starts = torch.tensor([3, 1])
    causal = torch.ones(2, 2, dtype=torch.bool).tril()[None]
    mask = build_step_mask(starts, causal, kv_len=5, dtype=torch.float32)
    assert mask.shape == (2, 1, 2, 5)
    assert mask.dtype == torch.float32
    assert set(mask.unique().tolist()) == {0.0, NEG}
    assert visible(mask) == [
        # row 0: prefix slots 0..2, new slots 3, 4
        [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
        # row 1: prefix slot 0, new slots 1, 2; slots 3, 4 are not its own
        [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]],
    ]


def test_step_mask_with_tree_and_per_row_local():
    tree = compile_tree([[0], [1], [0, 0]])  # 1 = (0), 2 = (1), 3 = (0,0)
    starts = torch.tensor([0, 2])
    mask = build_step_mask(starts, tree.mask[None], kv_len=6, dtype=torch.bfloat16)
    assert mask.dtype == torch.bfloat16
    assert visible(mask) == [
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0]],
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]],
    ]
    # a different visibility pattern per row
    local = torch.stack([torch.eye(2, dtype=torch.bool), torch.ones(2, 2, dtype=torch.bool)])
    mask = build_step_mask(torch.tensor([1, 1]), local, kv_len=3, dtype=torch.float32)
    assert visible(mask) == [[[1, 1, 0], [1, 0, 1]], [[1, 1, 1], [1, 1, 1]]]


# ---- SlotKVCache ------------------------------------------------------------------------------
LAYERS, ROWS, MAX_LEN, HEADS, HD = 2, 3, 10, 2, 3


def new_cache() -> SlotKVCache:
    return SlotKVCache(LAYERS, ROWS, MAX_LEN, HEADS, HD, torch.float32, "cpu")


def tagged(layer: int, row: int, q: int, start: int, kind: float) -> torch.Tensor:
    """[1, heads, q, hd] states whose every entry encodes (kind, layer, row, slot)."""
    slots = torch.arange(start, start + q, dtype=torch.float32)
    base = kind * 10000 + layer * 1000 + row * 100 + slots  # [q]
    return base[None, None, :, None].expand(1, HEADS, q, HD).clone()


def write_step(cache: SlotKVCache, rows: list[int], q: int) -> torch.Tensor:
    """A forward of q new tokens on rows: each layer writes tagged K (kind 1) and V (kind 2)."""
    starts = cache.begin_step(torch.tensor(rows), q)
    for layer_idx, layer in enumerate(cache.layers):
        k = torch.cat([tagged(layer_idx, r, q, int(s), 1) for r, s in zip(rows, starts)])
        v = torch.cat([tagged(layer_idx, r, q, int(s), 2) for r, s in zip(rows, starts)])
        keys, values = layer.update(k, v)
        assert keys.shape == (len(rows), HEADS, int(starts.max()) + q, HD)
        # what attention sees for each row in the step: that row's own buffer
        for i, r in enumerate(rows):
            assert torch.equal(keys[i], cache.k_all[layer_idx, r, :, : int(starts.max()) + q])
            assert torch.equal(values[i], cache.v_all[layer_idx, r, :, : int(starts.max()) + q])
    return starts


def slot_tags(cache: SlotKVCache, layer: int, row: int, n: int, kind: str = "k") -> list[float]:
    buf = cache.k_all if kind == "k" else cache.v_all
    entries = buf[layer, row, :, :n]  # [heads, n, hd]
    assert bool((entries == entries[0:1, :, 0:1]).all()), "every head/dim of a slot holds the same tag"
    return entries[0, :, 0].tolist()


def test_update_writes_at_each_rows_own_slots():
    cache = new_cache()
    cache.set_length(0, 2)
    cache.set_length(2, 4)
    starts = write_step(cache, [2, 0], q=3)
    assert starts.tolist() == [4, 2]
    for layer in range(LAYERS):
        assert slot_tags(cache, layer, 2, 7)[4:] == [1000 * layer + 10000 + 200 + s for s in (4, 5, 6)]
        assert slot_tags(cache, layer, 0, 5, "v")[2:] == [1000 * layer + 20000 + s for s in (2, 3, 4)]
    assert bool((cache.k_all[:, 1] == 0).all()), "a row outside the step is untouched"
    assert cache.lens.tolist() == [2, 0, 4], "lengths only move on compact"


def test_compact_moves_accepted_entries_next_to_the_prefix():
    cache = new_cache()
    write_step(cache, [1], q=2)  # a 2-token prefix on row 1
    cache.compact(torch.tensor([1]), [torch.arange(2)])
    assert cache.lens.tolist() == [0, 2, 0]
    write_step(cache, [1], q=5)  # a 5-node tree at slots 2..6
    before_k = cache.k_all.clone()
    cache.compact(torch.tensor([1]), [torch.tensor([0, 2, 3])])
    assert cache.lens.tolist() == [0, 5, 0]
    for layer in range(LAYERS):
        for kind, tag in (("k", 10000), ("v", 20000)):
            got = slot_tags(cache, layer, 1, 5, kind)
            # prefix 0, 1 unchanged; new offsets 0, 2, 3 (slots 2, 4, 5) now at slots 2, 3, 4
            assert got == [tag + 1000 * layer + 100 + s for s in (0, 1, 2, 4, 5)]
    assert torch.equal(cache.k_all[:, 0], before_k[:, 0]) and torch.equal(cache.k_all[:, 2], before_k[:, 2])


def test_compact_two_rows_non_contiguous_and_contiguous():
    cache = new_cache()
    cache.set_length(0, 3)
    cache.set_length(2, 1)
    write_step(cache, [0, 2], q=4)  # row 0 new slots 3..6, row 2 new slots 1..4
    cache.compact(torch.tensor([0, 2]), [torch.tensor([0, 3]), torch.tensor([0, 1, 2])])
    assert cache.lens.tolist() == [5, 0, 4]
    for layer in range(LAYERS):
        assert slot_tags(cache, layer, 0, 5)[3:] == [10000 + 1000 * layer + s for s in (3, 6)]
        assert slot_tags(cache, layer, 2, 4, "v")[1:] == [20000 + 1000 * layer + 200 + s for s in (1, 2, 3)]
    # the next step of row 0 starts right after the kept entries
    assert cache.begin_step(torch.tensor([0]), 1).tolist() == [5]


def test_compact_keeps_only_root_on_rejection():
    cache = new_cache()
    write_step(cache, [0], q=4)
    cache.compact(torch.tensor([0]), [torch.tensor([0])])
    assert cache.lens.tolist() == [1, 0, 0]


def test_overflow_is_refused():
    cache = new_cache()
    cache.set_length(1, MAX_LEN - 2)
    cache.begin_step(torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="overflow"):
        cache.begin_step(torch.tensor([0, 1]), 3)


# ---- the runner on the real model ---------------------------------------------------------------
def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_runner_matches_a_plain_forward(loaded):
    """Ragged prefill of two rows, a tree step on each, compaction, then a plain step: every
    logit equals a full causal forward over the same sequence."""
    model = loaded.model
    runner = ModelRunner(model, num_rows=3, max_len=32)
    a = [1, 504, 2988, 314, 216, 36, 30]
    b = [1, 19556, 665]
    rows = torch.tensor([2, 0])
    last, _ = runner.prefill(rows, [a, b])
    torch.testing.assert_close(last[0], full_logits(model, a)[-1], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(last[1], full_logits(model, b)[-1], atol=2e-3, rtol=1e-3)
    assert runner.length(2) == len(a) and runner.length(0) == len(b)

    # tree step: root t, node 1 = (0), node 2 = (1), node 3 = (0,0)
    tree = compile_tree([[0], [1], [0, 0]])
    draft = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])
    logits = runner.verify(rows, draft, tree.depths, tree.mask)
    assert logits.shape == (2, 4, model.config.vocab_size)
    for i, seq in enumerate((a, b)):
        d = draft[i].tolist()
        for node, path in {0: [d[0]], 1: [d[0], d[1]], 2: [d[0], d[2]], 3: [d[0], d[1], d[3]]}.items():
            torch.testing.assert_close(logits[i, node], full_logits(model, seq + path)[-1], atol=2e-3, rtol=1e-3)

    # keep root -> node 1 -> node 3 on row 2, root -> node 2 on row 0
    runner.compact(rows, [torch.tensor([0, 1, 3]), torch.tensor([0, 2])])
    a2, b2 = a + [11, 12, 14], b + [21, 23]
    assert runner.length(2) == len(a2) and runner.length(0) == len(b2)
    plain = compile_tree([])
    nxt = torch.tensor([[31], [41]])
    logits = runner.verify(rows, nxt, plain.depths, plain.mask)
    torch.testing.assert_close(logits[0, 0], full_logits(model, a2 + [31])[-1], atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(logits[1, 0], full_logits(model, b2 + [41])[-1], atol=2e-3, rtol=1e-3)
