"""One local Ray instance for a test module: loopback only, shut down (with Serve) at the end."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def local_ray(num_cpus: int):
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        yield ray
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
