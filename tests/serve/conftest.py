"""Shared helpers for the Serve tests: Ray runs locally with auth and usage stats off, on loopback."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # serve_testutil, whatever pytest's import mode
from serve_testutil import SERVE_ENV  # noqa: E402

os.environ.update(SERVE_ENV)  # before anything imports ray


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for one test module (shut down at its end)."""
    from local_ray import local_ray

    with local_ray(num_cpus=2) as ray:
        yield ray


def pytest_collection_modifyitems(config, items):
    # Ray's own pydantic models emit deprecation warnings on import; they are not ours to fix
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
