"""The matrix prior: the model's own top-k after [BOS, token], computed once and cached."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_model import tiny_loaded
from tr_serve.engine.config import EngineConfig
from tr_serve.engine.engine import Engine
from tr_serve.runner import matrix_prior
from tr_serve.runner.matrix_prior import first_token_top_k, load_or_compute
from tr_serve.tr.matrix import EMPTY, AdjacencyMatrix


def _reference(model, vocab: int, k: int, bos: int | None) -> torch.Tensor:
    """The top-k logit values after [bos, t] (or [t]) for every t, from one plain forward each."""
    ids = torch.arange(vocab)[:, None]
    if bos is not None:
        ids = torch.cat([torch.full_like(ids, bos), ids], dim=1)
    with torch.inference_mode():
        return model(input_ids=ids).logits[:, -1]


@pytest.mark.parametrize("bos", [1, None])
def test_rows_are_the_models_top_k_after_bos_and_the_token(tokenizer, bos):
    loaded = tiny_loaded(tokenizer, seed=3)
    vocab, k = 512, 4
    rows = first_token_top_k(loaded.model, vocab, k, bos, batch=100)  # 6 batches, the last one short
    assert rows.shape == (vocab, k) and rows.dtype == torch.int32
    logits = _reference(loaded.model, vocab, k, bos)
    want = logits.topk(k, dim=-1).values
    got = logits.gather(1, rows.long())  # the logits of the chosen ids: the k largest, in order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (rows[:, 0].long() == logits.argmax(dim=-1)).float().mean() > 0.99  # (ties aside) the argmax first


def test_the_prior_is_computed_once_then_read_from_the_cache(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    loaded = tiny_loaded(tokenizer, seed=3)
    first = load_or_compute(loaded.model, "tiny", 512, 4, 1)
    assert len(list((tmp_path / "matrix_prior").glob("*.pt"))) == 1

    def fail(*a, **k):
        raise AssertionError("computed again")

    monkeypatch.setattr(matrix_prior, "first_token_top_k", fail)
    assert torch.equal(load_or_compute(loaded.model, "tiny", 512, 4, 1), first)
    with pytest.raises(AssertionError, match="computed again"):  # other weights under the same name
        load_or_compute(tiny_loaded(tokenizer, seed=4).model, "tiny", 512, 4, 1)


def test_a_cache_that_cannot_be_written_only_costs_the_computation(tokenizer, tmp_path, monkeypatch):
    loaded = tiny_loaded(tokenizer, seed=3)
    want = first_token_top_k(loaded.model, 512, 4, 1)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "file"))  # the folder cannot be made: OSError
    assert torch.equal(load_or_compute(loaded.model, "tiny", 512, 4, 1), want)

    def cannot_open(obj, f):  # how torch.save reports a file it cannot open
        raise RuntimeError(f"File {f} cannot be opened.")

    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torch, "save", cannot_open)
    assert torch.equal(load_or_compute(loaded.model, "tiny", 512, 4, 1), want)
    assert not list((tmp_path / "cache" / "matrix_prior").iterdir())


def test_a_malformed_cached_prior_is_computed_again(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    loaded = tiny_loaded(tokenizer, seed=3)
    first = load_or_compute(loaded.model, "tiny", 512, 4, 1)
    (path,) = (tmp_path / "matrix_prior").glob("*.pt")
    for bad in (b"not a tensor", None):
        if bad is None:
            torch.save(torch.full((512, 4), 600, dtype=torch.int32), path)  # ids past the vocabulary
        else:
            path.write_bytes(bad)
        assert torch.equal(load_or_compute(loaded.model, "tiny", 512, 4, 1), first)


def test_the_engine_seeds_a_fresh_matrix_only_where_it_drafts_from_one(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("TR_SERVE_CACHE", str(tmp_path))
    loaded = tiny_loaded(tokenizer, seed=3)

    def engine(tree: str, **kw) -> Engine:
        return Engine(loaded, EngineConfig(model="tiny", tree=tree, max_num_seqs=1, max_model_len=64, **kw))

    prior = load_or_compute(loaded.model, "tiny", 512, 8, tokenizer.bos_token_id)
    seeded = engine("top4").matrix
    assert torch.equal(seeded.table, prior)
    assert seeded.take_dirty_rows().numel() == 0  # nothing for the fleet to push
    assert engine("top4", matrix_prior=False).matrix.num_filled_rows() == 0
    assert engine("pld").matrix.num_filled_rows() == 0  # no matrix to draft from
    assert engine("none").matrix.num_filled_rows() == 0
    kept = AdjacencyMatrix(512, 8)
    kept.table[7] = torch.arange(8, dtype=torch.int32)
    e = Engine(loaded, EngineConfig(model="tiny", tree="auto", max_num_seqs=1, max_model_len=64), matrix=kept)
    assert e.matrix is kept and kept.table[7].tolist() == list(range(8))  # a learned row is kept
    assert torch.equal(kept.table[8:], prior[8:]) and (kept.table != EMPTY).all()


def test_a_packaged_prior_serves_only_the_weights_and_bos_it_was_computed_for(tokenizer, tmp_path):
    loaded = tiny_loaded(tokenizer, seed=3)
    table = first_token_top_k(loaded.model, 512, 8, 1)
    path = tmp_path / "prior.npz"
    matrix_prior.save_packaged(path, loaded.model, table, 1)
    assert torch.equal(matrix_prior.packaged(loaded.model, 512, 8, 1, path=path), table)
    assert torch.equal(matrix_prior.packaged(loaded.model, 512, 4, 1, path=path), table[:, :4])  # top-4 of top-8
    assert matrix_prior.packaged(loaded.model, 512, 16, 1, path=path) is None  # more columns than it holds
    assert matrix_prior.packaged(loaded.model, 512, 8, None, path=path) is None  # another BOS
    assert matrix_prior.packaged(tiny_loaded(tokenizer, seed=4).model, 512, 8, 1, path=path) is None  # other weights
    path.write_bytes(b"torn")
    assert matrix_prior.packaged(loaded.model, 512, 8, 1, path=path) is None


def test_the_packaged_prior_is_the_embedded_models_top_8(loaded):
    """Checked on a sample of 64 tokens: the packaged ids' logits after [BOS, t] are the model's 8
    largest, in order (ids may swap at exact ties only)."""
    vocab, bos = loaded.model.config.vocab_size, loaded.tokenizer.bos_token_id
    table = matrix_prior.packaged(loaded.model, vocab, 8, bos)
    assert table is not None and table.shape == (vocab, 8), "the packaged prior does not match the embedded model"
    sample = torch.linspace(0, vocab - 1, 64).long()
    ids = torch.stack([torch.full_like(sample, bos), sample], dim=1)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[:, -1].float()
    torch.testing.assert_close(logits.gather(1, table[sample].long()), logits.topk(8, dim=-1).values,
                               rtol=1e-4, atol=1e-4)


def test_the_engine_seeds_from_the_packaged_prior_without_computing(loaded, tmp_path, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("computed")

    monkeypatch.setattr(matrix_prior, "_cache_path", lambda key: tmp_path / f"{key}.pt")  # an empty user cache
    monkeypatch.setattr(matrix_prior, "first_token_top_k", fail)
    engine = Engine(loaded, EngineConfig(model="smollm2-135m-instruct", tree="top4", max_num_seqs=1, max_model_len=64))
    vocab = loaded.model.config.vocab_size
    assert torch.equal(engine.matrix.table, matrix_prior.packaged(loaded.model, vocab, 8, loaded.tokenizer.bos_token_id))
    assert not list(tmp_path.iterdir())  # nothing computed, nothing written
