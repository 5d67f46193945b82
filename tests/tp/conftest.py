"""Tensor-parallel tests: a local Ray instance (auth and usage stats off, loopback only)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tp_testutil, whatever pytest's import mode
from tp_testutil import RAY_ENV  # noqa: E402

os.environ.update(RAY_ENV)  # before anything imports ray


@pytest.fixture(scope="module")
def ray_tp():
    """A local Ray instance for one test module: logical CPUs for one replica plus 3 workers
    (logical CPUs may exceed the physical ones; each worker runs one torch thread)."""
    from local_ray import local_ray

    with local_ray(num_cpus=4) as ray:
        yield ray
