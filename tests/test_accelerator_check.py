"""scripts/accelerator_check.sh on CPU: one JSON line, blocked attention checked against the
explicit path, every accelerator part skipped with its reason."""

import json
import subprocess
from pathlib import Path

from tests.helpers import one_device_env

ROOT = Path(__file__).resolve().parents[1]


def test_accelerator_check_runs_on_cpu_with_accelerator_parts_skipped():
    env = one_device_env()
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([str(ROOT / "scripts" / "accelerator_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    assert result["backend"] == "cpu"
    blocked = result["attention"]["blocked"]
    assert blocked["ok"] and blocked["max_rel_diff"] <= 1e-5, blocked
    assert "NVIDIA GPU" in result["attention"]["cudnn"]["skipped"]
    assert "TPU" in result["attention"]["splash"]["skipped"]
    for part in ("mfu", "attnres", "memory_8k"):
        assert result[part]["skipped"].startswith("CPU"), result[part]
