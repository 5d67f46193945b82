"""Shared fixtures: the embedded model (loaded once per session) and small helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tr_serve.data import SPEC_BENCH_DEV

# The test machine has few cores shared with other work; several torch threads spin-waiting for
# each other under contention make CPU forwards many times slower than a single thread.
torch.set_num_threads(1)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SPEC_BENCH = SPEC_BENCH_DEV  # packaged with tr_serve (tr_serve/data)
RAY_TEST_DIRS = tuple(str(Path(__file__).parent / d) for d in ("serve", "tp"))
# every test that starts Ray (a local instance, or `tr-serve run` in a subprocess)
RAY_TESTS = RAY_TEST_DIRS + (str(Path(__file__).parent / "fleet" / "test_fleet_ray.py"),)


def pytest_collection_modifyitems(config, items):
    parallel = config.pluginmanager.hasplugin("xdist")
    for item in items:
        path = str(item.fspath)
        if path.startswith(RAY_TEST_DIRS):
            # Ray's own pydantic models emit deprecation warnings on import; they are not ours to fix
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
        if parallel:
            # `make test` runs two pytest workers (--dist loadgroup): a file's tests stay together (its
            # module fixtures are built once), and the Ray tests share one worker, one Ray instance at a time
            item.add_marker(pytest.mark.xdist_group("ray" if path.startswith(RAY_TESTS) else path))
    if parallel:
        # the Ray group first: it is by far the longest unit (its Serve and TP tests take minutes each), so
        # one worker starts it at once while the other takes every other file
        items.sort(key=lambda item: item.get_closest_marker("xdist_group").args[0] != "ray")  # stable


@pytest.fixture(scope="session")
def loaded():
    """The embedded SmolLM2-135M-Instruct model and tokenizer, shared by every test."""
    from tr_serve.model_loader import load_model

    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tokenizer(loaded):
    return loaded.tokenizer


@pytest.fixture(scope="session")
def spec_bench_rows() -> list[dict]:
    if not SPEC_BENCH.exists():
        pytest.fail(f"missing packaged data file {SPEC_BENCH} (tr_serve/data; is the package installed whole?)")
    return [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]
