"""Static draft-tree templates and their compiled tensor form.

A template is a list of paths; a path is the list of child ranks from the root, e.g. ``(0, 1)`` is
the rank-1 candidate of the rank-0 candidate. The root (the last accepted token) is implicit and is
not part of the template. Nodes are kept in an order where every prefix is itself a valid tree
(parents first, more promising nodes first), so a tree budget can verify just the first ``n`` nodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

Path_ = tuple[int, ...]

# Children per parent of an 80-node tree reconstructed before the paper's template was published:
# the paper's level profile (8/21/25/15/8/3 nodes, depth 6), but 13 of its 80 paths differ. Kept as
# "2.2.2-recon" for comparison only (docs/benchmarks.md, "Draft templates").
_RECON_CHILDREN: dict[Path_, int] = {
    (): 8,
    (0,): 8, (1,): 5, (2,): 3, (3,): 2, (4,): 1, (5,): 1, (6,): 1,
    (0, 0): 8, (0, 1): 4, (0, 2): 2, (0, 3): 1, (1, 0): 4, (1, 1): 2, (2, 0): 2, (2, 1): 1, (3, 0): 1,
    (0, 0, 0): 6, (0, 0, 1): 3, (0, 0, 2): 1, (0, 1, 0): 2, (1, 0, 0): 2, (2, 0, 0): 1,
    (0, 0, 0, 0): 4, (0, 0, 0, 1): 1, (0, 0, 1, 0): 1, (0, 1, 0, 0): 1, (1, 0, 0, 0): 1,
    (0, 0, 0, 0, 0): 2, (0, 0, 0, 0, 1): 1,
}

# Prior probability that the rank-r candidate is the model's choice: the starting point of the
# online acceptance estimates (tr/acceptance_stats.py), and the order of a template with no measured order.
_RANK_PRIOR = (0.55, 0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02)


def _expand(children: dict[Path_, int]) -> list[Path_]:
    paths: list[Path_] = []
    frontier: list[Path_] = [()]
    while frontier:
        nxt: list[Path_] = []
        for parent in frontier:
            for rank in range(children.get(parent, 0)):
                nxt.append(parent + (rank,))
        paths.extend(nxt)
        frontier = nxt
    return paths


def path_prior(path: Sequence[int]) -> float:
    """Prior probability that a whole path is accepted (product of per-rank priors)."""
    p = 1.0
    for rank in path:
        p *= _RANK_PRIOR[rank] if rank < len(_RANK_PRIOR) else _RANK_PRIOR[-1] / 2
    return p


def order_by_prior(paths: Sequence[Sequence[int]]) -> list[Path_]:
    """Most promising first; a child always scores below its parent, so parents come first."""
    return sorted((tuple(p) for p in paths), key=lambda p: (-path_prior(p), len(p), p))


def order_by_rates(paths: Sequence[Sequence[int]], rates: Sequence[float]) -> list[Path_]:
    """Paths by descending path-acceptance rate (ties: shallower first, then template order). A
    node's path rate never exceeds its parent's, so every prefix of the result is a tree."""
    keyed = sorted(range(len(paths)), key=lambda i: (-rates[i], len(paths[i]), i))
    out = [tuple(paths[i]) for i in keyed]
    seen: set[Path_] = set()
    for p in out:  # a parent with an equal rate and depth ordering guarantees this; check anyway
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"rates order path {list(p)} before its parent")
        seen.add(p)
    return out


def _load_paper_tree() -> list[Path_]:
    from tr_serve.data import PAPER_TREE_2_2_2

    return [tuple(p) for p in json.loads(PAPER_TREE_2_2_2.read_text())]


def _load_measured_order(template: list[Path_]) -> list[Path_]:
    """The template ordered by acceptance measured on the dev questions
    (``tr_serve/data/tree-order-2.2.2.json``, written by ``scripts/measure_tree_order.py``); the
    prior order if the file is absent."""
    from tr_serve.data import PAPER_TREE_2_2_2_ORDER

    if not PAPER_TREE_2_2_2_ORDER.exists():
        return order_by_prior(template)
    order = [tuple(p) for p in json.loads(PAPER_TREE_2_2_2_ORDER.read_text())["order"]]
    if sorted(order) != sorted(template):
        raise ValueError(f"{PAPER_TREE_2_2_2_ORDER} does not list the paths of the 2.2.2 template")
    return order


# The paper's exact 80-node template, in its published level order.
DEFAULT_TREE = _load_paper_tree()
assert len(DEFAULT_TREE) == 80
# The same nodes by measured acceptance: its prefixes are the best small trees (``topN``).
DEFAULT_ORDER = _load_measured_order(DEFAULT_TREE)
RECON_TREE = order_by_prior(_expand(_RECON_CHILDREN))


def named_templates() -> dict[str, list[Path_]]:
    """Built-in templates: the paper's 80-node ``2.2.2``, its best ``n``-node subsets by measured
    acceptance (``topN``), a chain, and the earlier reconstruction."""
    out = {"2.2.2": DEFAULT_TREE}
    for n in (1, 2, 4, 6, 8, 12, 16, 32):
        out[f"top{n}"] = DEFAULT_ORDER[:n]
    out["chain4"] = [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    out["2.2.2-recon"] = RECON_TREE
    return out


class TreeTemplateError(ValueError):
    """A user template that cannot be compiled; the message says which path is wrong and why."""


def validate_template(paths: Sequence[Sequence[int]], k: int) -> list[Path_]:
    if len(paths) == 0:
        raise TreeTemplateError("tree template is empty: give at least one path such as [[0]]")
    seen: set[Path_] = set()
    out: list[Path_] = []
    for i, raw in enumerate(paths):
        if not isinstance(raw, (list, tuple)) or len(raw) == 0:
            raise TreeTemplateError(f"tree path #{i} must be a non-empty list of ranks, got {raw!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in raw):
            raise TreeTemplateError(f"tree path #{i} {list(raw)} must contain integers only")
        path = tuple(raw)
        if any(r < 0 or r >= k for r in path):
            raise TreeTemplateError(f"tree path #{i} {list(path)} has a rank outside 0..{k - 1} (k={k})")
        if path in seen:
            raise TreeTemplateError(f"tree path #{i} {list(path)} is listed twice")
        if len(path) > 1 and path[:-1] not in seen:
            raise TreeTemplateError(
                f"tree path #{i} {list(path)} comes before its parent {list(path[:-1])}: list every parent first"
            )
        seen.add(path)
        out.append(path)
    return out


def load_template(spec: str | Sequence[Sequence[int]], k: int) -> tuple[str, list[Path_]]:
    """Resolve a template name, a JSON file path, or a literal list of paths; returns (name, paths)."""
    if isinstance(spec, str):
        named = named_templates()
        if spec in named:
            return spec, validate_template(named[spec], k)
        p = Path(spec)
        if p.suffix == ".json" or p.exists():
            if not p.exists():
                raise TreeTemplateError(f"tree template file {spec} does not exist")
            try:
                data = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise TreeTemplateError(f"tree template file {spec} is not valid JSON: {e}") from e
            return p.stem, validate_template(data, k)
        raise TreeTemplateError(f"unknown tree {spec!r}: use one of {sorted(named)} or a .json file of paths")
    paths = validate_template(spec, k)
    return f"custom{len(paths)}", paths


@dataclass(frozen=True)
class CompiledTree:
    """Tensor form of a template with ``n`` nodes; index 0 is the root, nodes are 1..n.

    parents[i]  index of node i's parent (root: -1)          [n+1]
    ranks[i]    which candidate of the parent's matrix row   [n+1] (root: 0)
    depths[i]   position offset from the root                 [n+1]
    mask[i, j]  True where node i may attend to node j        [n+1, n+1] (ancestors and itself)
    paths[l]    node indices of each root-to-leaf path, padded with -1, root excluded [leaves, depth]
    level_slices[d] node index range (start, stop) of depth d+1 (nodes are sorted by depth in it)
    """

    name: str
    template: tuple[Path_, ...]
    parents: torch.Tensor
    ranks: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    paths: torch.Tensor
    level_order: torch.Tensor  # node indices sorted by depth (stable), root excluded [n]
    level_slices: tuple[tuple[int, int], ...]
    children: tuple[tuple[int, ...], ...]  # children[i]: node indices whose parent is i

    @property
    def num_nodes(self) -> int:
        return len(self.template)

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def prefix(self, n: int) -> "CompiledTree":
        """The first ``n`` nodes: still a valid tree because parents precede children."""
        return compile_tree(self.template[:n], name=f"{self.name}[:{n}]")


def compile_tree(paths: Sequence[Sequence[int]], name: str = "custom") -> CompiledTree:
    template = tuple(tuple(p) for p in paths)
    index = {(): 0}
    for i, p in enumerate(template, start=1):
        index[p] = i
    n = len(template) + 1
    parents = torch.full((n,), -1, dtype=torch.long)
    ranks = torch.zeros(n, dtype=torch.long)
    depths = torch.zeros(n, dtype=torch.long)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for i, p in enumerate(template, start=1):
        parents[i] = index[p[:-1]]
        ranks[i] = p[-1]
        depths[i] = len(p)
        mask[i] = mask[parents[i]]
        mask[i, i] = True
    has_child = set(p[:-1] for p in template)
    leaves = [p for p in template if p not in has_child]
    max_depth = max((len(p) for p in template), default=0)
    leaf_paths = torch.full((max(len(leaves), 1), max(max_depth, 1)), -1, dtype=torch.long)
    for li, leaf in enumerate(leaves):
        for d in range(1, len(leaf) + 1):
            leaf_paths[li, d - 1] = index[leaf[:d]]
    level_order = torch.argsort(depths[1:], stable=True) + 1
    sorted_depths = depths[level_order]
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        children[int(parents[i])].append(i)
    level_slices = []
    for d in range(1, max_depth + 1):
        idx = (sorted_depths == d).nonzero().flatten()
        level_slices.append((int(idx[0]), int(idx[-1]) + 1))
    return CompiledTree(
        name=name,
        template=template,
        parents=parents,
        ranks=ranks,
        depths=depths,
        mask=mask,
        paths=leaf_paths,
        level_order=level_order,
        level_slices=tuple(level_slices),
        children=tuple(tuple(c) for c in children),
    )
