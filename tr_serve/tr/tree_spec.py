"""What a ``tree`` setting means: one parser for the engine, the benches and the Serve config.

Grammar (case-sensitive template names, as in :func:`tr_serve.tr.tree.named_templates`):

* ``none``            plain decoding through the same runner (``off`` and ``""`` too)
* ``<template>``      Token Recycling with that static template (``2.2.2``, ``top8``, a ``.json`` file)
* ``<template>+ctx``  the hybrid: the template's matrix nodes plus, per row, a branch drafted from
                      the row's own context (prompt + output) where it has a match
* ``pld``             prompt lookup through the same runner: the context branch alone, no matrix
* ``auto``            the cost-aware budget over the default template plus the context branch
                      (each step verifies the nodes with the best expected tokens per second)
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_TEMPLATE = "2.2.2"
# the engine's default: the best configuration measured on the dev questions (docs/benchmarks.md)
DEFAULT_TREE_SETTING = "auto"
CONTEXT_SUFFIX = "+ctx"
PLAIN_NAMES = ("none", "off", "")


@dataclass(frozen=True)
class TreeSpec:
    template: str | None  # matrix template, None when the matrix drafts nothing
    context: bool  # a per-row context branch (prompt lookup) is drafted
    auto_budget: bool  # the cost-aware budget picks the verified nodes each step

    @property
    def plain(self) -> bool:
        """The tree is off: ``is_plain`` of the setting this spec was parsed from."""
        return self.template is None and not self.context

    @property
    def uses_matrix(self) -> bool:
        return self.template is not None

    @property
    def prices_branches(self) -> bool:
        """The cost-aware budget with a context branch: the one setting whose rows can take a
        branch from the cross-request suffix index, which the budget prices (``auto``)."""
        return self.auto_budget and self.context


def is_plain(spec: str) -> bool:
    """The one test of "this tree setting turns Token Recycling off" (plain decoding)."""
    return spec.strip().lower() in PLAIN_NAMES


def parse_tree_spec(spec: str, budget: str = "fixed") -> TreeSpec:
    """``budget="auto"`` (the older spelling, kept for configs) turns the cost-aware budget on for
    any template."""
    s = spec.strip()
    if is_plain(s):
        return TreeSpec(None, False, False)
    if s == "pld":
        return TreeSpec(None, True, False)
    if s == "auto":
        return TreeSpec(DEFAULT_TEMPLATE, True, True)
    context = s.endswith(CONTEXT_SUFFIX)
    if context:
        s = s[: -len(CONTEXT_SUFFIX)]
        if not s or is_plain(s) or s in ("pld", "auto"):
            raise ValueError(f"tree {spec!r}: '+ctx' follows a template name such as '2.2.2+ctx' or 'top8+ctx'")
    return TreeSpec(s, context, budget == "auto")


def validate_tree_spec(spec: str, k: int, budget: str = "fixed") -> TreeSpec:
    """Parse ``spec`` and load its template: a ValueError (TreeTemplateError for a bad template)
    that names the problem, before any engine is built."""
    from tr_serve.tr.tree import load_template

    parsed = parse_tree_spec(spec, budget)
    if parsed.template is not None:
        load_template(parsed.template, k)
    return parsed
