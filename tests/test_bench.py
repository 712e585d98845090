"""Tests for scripts/bench.py: one tiny run end to end, as a subprocess."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("tokens_per_sec", "step_time_s", "compile_time_s", "mfu", "peak_flops",
            "temp_bytes", "vs_reference", "reference_step_time_s")


def test_bench_json_tiny_model():
    # One CPU device: conftest's XLA_FLAGS (8 simulated devices) is dropped from the child's env.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"),
               "--config", str(ROOT / "experiments" / "quickstart.py"),
               "--config.model.d_model=32", "--config.model.num_heads=4",
               "--config.model.num_layers=2", "--config.seq_len=16", "--config.batch_size=8",
               "--json", "--steps", "3"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # exactly one JSON object on stdout
    assert set(REQUIRED) <= set(result), sorted(set(REQUIRED) - set(result))
    assert all(math.isfinite(result[k]) for k in REQUIRED)
    for key in ("tokens_per_sec", "step_time_s", "compile_time_s", "peak_flops",
                "vs_reference", "reference_step_time_s"):
        assert result[key] > 0, (key, result[key])
    assert 0 < result["mfu"] < 10  # loose: a noisy shared CPU can beat its measured "peak"
    assert result["temp_bytes"] >= 0
    assert result["devices"] == 1
    assert "compile_24_over_4" not in result  # the depth check is opt-in
