"""The throwaway local Ray instance of the benches that need actors (fleet, tensor parallelism)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def local_ray(num_cpus: int) -> Iterator[None]:
    """A local Ray with ``num_cpus`` logical CPUs, usage reporting and token auth off (nothing but
    this process reaches it), shut down on exit. One already running (a test's, a caller's) is
    used as it is and left running."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()
