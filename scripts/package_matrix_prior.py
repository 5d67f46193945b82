"""Compute the embedded model's matrix prior and write it into the package
(``tr_serve/data/matrix-prior-smollm2-135m-instruct.npz``): the top 8 tokens SmolLM2-135M-Instruct
(float32) predicts after [BOS, t] for every token t (runner/matrix_prior.py). About two minutes on
a 2-core CPU; rerun it when the embedded model, the prior's computation or its version changes.

    .venv/bin/python scripts/package_matrix_prior.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tr_serve.data import EMBEDDED_MATRIX_PRIOR
from tr_serve.model_loader import EMBEDDED_ALIAS, load_model
from tr_serve.runner.matrix_prior import first_token_top_k, packaged, save_packaged

K = 8  # the engine's default k; a packaged prior serves any k up to it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(EMBEDDED_MATRIX_PRIOR))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(EMBEDDED_ALIAS, dtype="float32")
    model, vocab = loaded.model, loaded.model.config.vocab_size
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    table = first_token_top_k(model, vocab, K, bos)
    out = Path(args.out)
    save_packaged(out, model, table, bos)
    assert torch.equal(packaged(model, vocab, K, bos, path=out), table)  # what the engine will read
    print(f"wrote {args.out}: [{vocab}, {K}] token ids, BOS {bos}")


if __name__ == "__main__":
    main()
