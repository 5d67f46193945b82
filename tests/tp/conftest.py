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


def pytest_collection_modifyitems(config, items):
    # Ray's own pydantic models emit deprecation warnings on import; they are not ours to fix
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
