"""Data files shipped inside the package (see README.md here for sources and licences)."""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
SPEC_BENCH_DEV = DATA_DIR / "spec_bench_dev.jsonl"  # Spec-Bench (hemingkx/Spec-Bench), Apache-2.0
PAPER_TREE_2_2_2 = DATA_DIR / "tr-paper-tree-2.2.2.json"  # Token Recycling paper's 80-node template
# the 2.2.2 nodes ordered by acceptance measured on dev questions (scripts/measure_tree_order.py)
PAPER_TREE_2_2_2_ORDER = DATA_DIR / "tree-order-2.2.2.json"
# the embedded SmolLM2-135M-Instruct's matrix prior (scripts/package_matrix_prior.py; runner/matrix_prior.py)
EMBEDDED_MATRIX_PRIOR = DATA_DIR / "matrix-prior-smollm2-135m-instruct.npz"
