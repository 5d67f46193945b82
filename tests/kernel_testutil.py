"""Marks for the tests of the compiled kernels (kernels/native.py).

A test that needs a kernel skips where the kernel is not available here (no C compiler, torch
without libgomp), except under ``TR_SERVE_REQUIRE_KERNELS=1`` (set by ``.ci/run``): there it runs,
and the kernel's :class:`~tr_serve.kernels.native.KernelUnavailable` fails it, so CI cannot pass
with no kernel at all."""

from __future__ import annotations

import pytest

from tr_serve.kernels import native


def kernel_missing(kernel: native.Kernel) -> bool:
    """Whether tests of ``kernel`` should skip: only where it is not available and not required. Loads
    it (at collection, as a test module's mark is made), so that its self-check runs before any test
    patches what the self-check calls."""
    try:
        return kernel.get() is None
    except native.KernelUnavailable:
        return False  # required: the tests run, and fail on it


def needs_kernel(kernel: native.Kernel, what: str = "no C compiler or torch without libgomp here"):
    """A skipif mark for tests of ``kernel`` (see the module docstring)."""
    return pytest.mark.skipif(kernel_missing(kernel), reason=what)
