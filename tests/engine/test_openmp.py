"""Releasing a thread's OpenMP workers: the workers exit, and torch still computes afterwards."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from tr_serve.engine.openmp import _loaded_openmp_libraries, release_thread_openmp_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_release_frees_the_calling_threads_workers():
    assert _loaded_openmp_libraries(), "torch's OpenMP runtime should be mapped"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(512, 512)
        want = torch.mm(a, a)  # a parallel region: this thread now owns a team with a worker
        with_workers = _threads()
        assert release_thread_openmp_pool()
        deadline = time.monotonic() + 5
        while _threads() >= with_workers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _threads() < with_workers
        torch.testing.assert_close(torch.mm(a, a), want)  # and the thread computes again afterwards
    finally:
        torch.set_num_threads(before)
