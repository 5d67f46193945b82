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
