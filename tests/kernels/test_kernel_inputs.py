"""Every compiled kernel's wrapper refuses bad inputs with a Python error: wrong shapes, dtypes and
strides, indices past the cache, empty batches (an empty batch used to reach a null function
pointer in the panel GEMM). The calls run in a subprocess (kernel_bad_inputs.py), so an input that
still reaches C and crashes fails the test instead of killing pytest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.kernel_bad_inputs import GROUPS

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("kernel_bad_inputs.py")
RUN_TIMEOUT_S = 180
REFUSALS = {"ValueError", "TypeError", "IndexError"}


def run_group(group: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HARNESS), group], capture_output=True, text=True, env=env,
                          timeout=RUN_TIMEOUT_S, cwd=ROOT)
    last_case = [line for line in proc.stderr.splitlines() if line.startswith("case: ")][-1:]
    assert proc.returncode == 0, f"{group}: exit {proc.returncode} at {last_case}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_each_bad_input_raises_a_python_error(group):
    out = run_group(group)
    if "unavailable" in out:  # (never under TR_SERVE_REQUIRE_KERNELS=1: the run fails instead)
        pytest.skip(f"{group}: {out['unavailable']}")
    cases = out["cases"]
    assert cases.pop("good") is None, "the valid call must return"
    assert len(cases) >= 4, cases
    accepted = {name: error for name, error in cases.items() if error not in REFUSALS}
    assert not accepted, f"{group}: not refused (None: returned): {accepted}"
