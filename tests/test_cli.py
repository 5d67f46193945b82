"""``tr-serve generate`` end to end (a subprocess of the installed command)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("tr-serve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "tr_serve.cli"]


def test_cli_generate_bad_tree_exits_2():
    proc = subprocess.run(_cli() + ["generate", "--prompt", "hi", "--tree", "nonexistent"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1 and "unknown tree 'nonexistent'" in err


def test_cli_generate_prints_text_and_mat():
    # one torch thread, as the rest of the suite: the kernel plan measured for it is reused (a fresh
    # machine would otherwise measure one more plan, for torch's default of every core: about a minute)
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    proc = subprocess.run(_cli() + ["generate", "--prompt", "What is the capital of France?", "--max-tokens", "8",
                                    "--tree", "top4"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr
    text, _, stats = proc.stdout.partition("\n--- ")
    assert text.strip(), proc.stdout
    assert "MAT:" in stats and "verification steps:" in stats and "tokens/s:" in stats
    assert "tokens:             " in stats
