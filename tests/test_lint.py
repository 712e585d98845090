"""The codebase stays ruff-clean (rules in pyproject.toml)."""

import subprocess
import sys
from pathlib import Path


def test_ruff_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "."], capture_output=True,
                         text=True, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stdout + run.stderr
