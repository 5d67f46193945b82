"""The static type check `make test` runs: its config gates calls of functions and attributes that
do not exist and calls with arguments a function does not take (the class of a branch no test
reaches crashing at run time), and `make test` runs it before the tests."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parent.parent
GATED = ("attr-defined", "name-defined", "call-arg")


def test_make_test_runs_mypy_with_the_gated_codes_on():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert config["packages"] == ["tr_serve"]
    assert not set(GATED) & set(config.get("disable_error_code", []))
    recipe = re.search(r"^test:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert recipe.splitlines()[0].strip() == "$(PY) -m mypy"


def test_the_config_refuses_a_missing_function_a_missing_name_and_a_wrong_call(tmp_path):
    (tmp_path / "branch.py").write_text(
        "import math\n\n\n"
        "def cuda_only(n: int) -> float:\n"
        "    return math.sqrtt(n)\n\n\n"  # as torch.cuda.getdevice_name was
        "def other() -> float:\n"
        "    return cuda_only(1, 2) + undefined_name\n")
    out, _, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--no-incremental",
                              str(tmp_path / "branch.py")])
    assert status == 1
    for code in GATED:
        assert f"[{code}]" in out, out
