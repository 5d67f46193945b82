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
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        yield ray
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def pytest_collection_modifyitems(config, items):
    # Ray's own pydantic models emit deprecation warnings on import; they are not ours to fix
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
