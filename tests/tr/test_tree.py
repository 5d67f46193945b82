"""Tree templates: compiled buffers, prefixes, the default template, and validation errors."""

from __future__ import annotations

import json

import pytest
import torch

from tr_serve.tr.tree import (
    DEFAULT_ORDER,
    DEFAULT_TREE,
    TreeTemplateError,
    compile_tree,
    load_template,
    named_templates,
    validate_template,
)

# node 1 = (0), 2 = (1), 3 = (0,0), 4 = (0,1), 5 = (0,0,0)
SMALL = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def ancestors_or_self(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_small_template_buffers():
    t = compile_tree(SMALL, name="small")
    assert t.num_nodes == 5
    assert t.max_depth == 3
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert t.ranks.tolist() == [0, 0, 1, 0, 1, 0]
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 3]

    expected_mask = torch.tensor(
        [
            # 0  1  2  3  4  5
            [1, 0, 0, 0, 0, 0],  # root sees itself only
            [1, 1, 0, 0, 0, 0],  # (0)
            [1, 0, 1, 0, 0, 0],  # (1)
            [1, 1, 0, 1, 0, 0],  # (0,0)
            [1, 1, 0, 0, 1, 0],  # (0,1): not its sibling (0,0)
            [1, 1, 0, 1, 0, 1],  # (0,0,0)
        ],
        dtype=torch.bool,
    )
    assert torch.equal(t.mask, expected_mask)

    # leaves (1), (0,1), (0,0,0) in template order, root excluded, padded with -1
    assert t.paths.tolist() == [[2, -1, -1], [1, 4, -1], [1, 3, 5]]
    assert t.level_order.tolist() == [1, 2, 3, 4, 5]
    assert t.level_slices == ((0, 2), (2, 4), (4, 5))


def test_level_order_when_template_is_not_sorted_by_depth():
    # 1 = (0) d1, 2 = (0,0) d2, 3 = (1) d1, 4 = (0,0,0) d3, 5 = (1,0) d2
    t = compile_tree([[0], [0, 0], [1], [0, 0, 0], [1, 0]])
    assert t.parents.tolist() == [-1, 0, 1, 0, 2, 3]
    assert t.depths.tolist() == [0, 1, 2, 1, 3, 2]
    assert t.level_order.tolist() == [1, 3, 2, 5, 4]
    assert t.level_slices == ((0, 2), (2, 4), (4, 5))
    for d, (lo, hi) in enumerate(t.level_slices, start=1):
        assert all(int(t.depths[i]) == d for i in t.level_order[lo:hi])
    assert t.paths.tolist() == [[1, 2, 4], [3, 5, -1]]


def check_valid_tree(t) -> None:
    """Structural invariants every compiled tree must satisfy."""
    n = t.num_nodes
    parents = t.parents.tolist()
    assert len(parents) == n + 1 and parents[0] == -1
    for i in range(1, n + 1):
        assert 0 <= parents[i] < i, f"node {i}: parent {parents[i]} does not precede it"
        assert int(t.depths[i]) == int(t.depths[parents[i]]) + 1
        assert t.template[i - 1][-1] == int(t.ranks[i])
        assert len(t.template[i - 1]) == int(t.depths[i])
    for i in range(n + 1):
        visible = set(t.mask[i].nonzero().flatten().tolist())
        assert visible == ancestors_or_self(parents, i)
    # every node lies on exactly the leaf paths through it; every leaf path is a root-to-leaf chain
    covered = set()
    for row in t.paths.tolist():
        nodes = [x for x in row if x >= 0]
        assert row[len(nodes):] == [-1] * (len(row) - len(nodes)), "padding only at the end"
        if n == 0:
            continue
        assert parents[nodes[0]] == 0
        for a, b in zip(nodes, nodes[1:]):
            assert parents[b] == a
        assert nodes[-1] not in parents, "a path must end at a leaf"
        covered.update(nodes)
    assert covered == set(range(1, n + 1))
    sizes = [hi - lo for lo, hi in t.level_slices]
    assert sum(sizes) == n
    assert sorted(t.level_order.tolist()) == list(range(1, n + 1))


@pytest.mark.parametrize("template", [SMALL, DEFAULT_TREE, DEFAULT_ORDER], ids=["small", "2.2.2", "measured-order"])
def test_every_prefix_is_a_valid_tree(template):
    full = compile_tree(template, name="t")
    for n in range(1, full.num_nodes + 1):
        p = full.prefix(n)
        assert p.num_nodes == n
        assert p.template == full.template[:n]
        check_valid_tree(p)
        # node indices are kept: the prefix is the top-left corner of the full tree
        assert torch.equal(p.parents, full.parents[: n + 1])
        assert torch.equal(p.depths, full.depths[: n + 1])
        assert torch.equal(p.mask, full.mask[: n + 1, : n + 1])


def test_default_template_shape():
    name, paths = load_template("2.2.2", k=8)
    assert name == "2.2.2"
    assert len(paths) == 80 == len(DEFAULT_TREE)
    t = compile_tree(paths, name=name)
    check_valid_tree(t)
    assert t.max_depth == 6
    depth_counts = [int((t.depths == d).sum()) for d in range(1, 7)]
    assert depth_counts == [8, 21, 25, 15, 8, 3]
    assert [hi - lo for lo, hi in t.level_slices] == [8, 21, 25, 15, 8, 3]
    assert all(0 <= r < 8 for p in paths for r in p)
    assert len(set(paths)) == 80


def test_2_2_2_is_the_papers_published_template():
    """The published file, path for path, in its published (level) order."""
    from tr_serve.data import PAPER_TREE_2_2_2

    published = [tuple(p) for p in json.loads(PAPER_TREE_2_2_2.read_text())]
    assert load_template("2.2.2", 8)[1] == published
    assert [len(p) for p in published] == sorted(len(p) for p in published)


def test_named_templates_are_prefixes_of_the_measured_order():
    named = named_templates()
    assert sorted(DEFAULT_ORDER) == sorted(DEFAULT_TREE)  # the same 80 nodes, another order
    for n in (1, 2, 4, 6, 8, 12, 16, 32):
        assert named[f"top{n}"] == DEFAULT_ORDER[:n]
        check_valid_tree(compile_tree(load_template(f"top{n}", 8)[1]))
    assert load_template("chain4", 8)[1] == [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]
    chain = compile_tree(named["chain4"])
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3]
    assert chain.paths.tolist() == [[1, 2, 3, 4]]


def test_empty_compiled_tree_is_plain_decoding():
    t = compile_tree([], name="none")
    assert t.num_nodes == 0
    assert t.parents.tolist() == [-1]
    assert t.mask.tolist() == [[True]]
    assert t.level_slices == ()


# ---- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "paths, k, fragment",
    [
        ([], 8, "empty"),
        ([[0], [0, 1, 0]], 8, "comes before its parent [0, 1]"),
        ([[0, 0], [0]], 8, "comes before its parent [0]"),
        ([[0], [1], [0]], 8, "#2 [0] is listed twice"),
        ([[0], [4]], 4, "rank outside 0..3 (k=4)"),
        ([[0], [0, -1]], 8, "rank outside 0..7"),
        ([[0], [1.0]], 8, "integers only"),
        ([[0], ["1"]], 8, "integers only"),
        ([[True]], 8, "integers only"),
        ([[0], []], 8, "non-empty list"),
        ([0, 1], 8, "non-empty list"),
    ],
)
def test_validation_errors(paths, k, fragment):
    with pytest.raises(TreeTemplateError) as e:
        validate_template(paths, k)
    assert fragment in str(e.value)
    assert isinstance(e.value, ValueError)


def test_rank_limit_follows_k():
    assert validate_template([[0], [3]], 4) == [(0,), (3,)]
    with pytest.raises(TreeTemplateError, match=r"k=2"):
        load_template("2.2.2", k=2)  # the default template uses ranks up to 7


def test_unknown_name():
    with pytest.raises(TreeTemplateError, match=r"unknown tree 'bogus'.*2\.2\.2"):
        load_template("bogus", 8)


def test_missing_json_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(TreeTemplateError, match="does not exist"):
        load_template(str(missing), 8)


def test_bad_json_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [1,")
    with pytest.raises(TreeTemplateError, match="not valid JSON"):
        load_template(str(bad), 8)


def test_json_file_with_invalid_template(tmp_path):
    f = tmp_path / "orphan.json"
    f.write_text(json.dumps([[0], [1, 0, 0]]))
    with pytest.raises(TreeTemplateError, match="before its parent"):
        load_template(str(f), 8)


def test_valid_json_file_loads(tmp_path):
    f = tmp_path / "mytree.json"
    f.write_text(json.dumps(SMALL))
    name, paths = load_template(str(f), 8)
    assert name == "mytree"
    assert paths == [tuple(p) for p in SMALL]
    t = compile_tree(paths, name=name)
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 3]


def test_literal_list_template():
    name, paths = load_template([[0], [0, 0]], 8)
    assert name == "custom2"
    assert paths == [(0,), (0, 0)]
