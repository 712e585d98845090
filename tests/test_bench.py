"""scripts/bench.py end to end (one tiny run as a subprocess, every reported figure checked) and
its paired ratio of step times."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import one_device_env
from train.instruments.timing import paired_ratio

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("tokens_per_sec", "step_time_s", "compile_time_s", "mfu", "peak_flops",
            "temp_bytes", "vs_reference", "reference_step_time_s")
BASELINE = ("baseline_step_time_s", "step_time_vs_baseline", "temp_bytes_vs_baseline",
            "temp_bytes_layers_1", "temp_bytes_layers_2", "temp_bytes_depth_ratio")


COMPARE = ("step_time_s", "step_time_vs_config", "temp_bytes", "temp_bytes_vs_config",
           "decode_time_s", "decode_time_vs_config")


@pytest.mark.slow
def test_bench_json_with_baseline_compare_decode_and_depth_memory():
    env = one_device_env()
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"),
               "--config", str(ROOT / "experiments" / "quickstart.py"),
               "--config.model.d_model=32", "--config.model.num_heads=4",
               "--config.model.num_layers=2", "--config.seq_len=16", "--config.batch_size=8",
               "--json", "--steps", "3", "--block", "1",
               "--baseline", "model.ffn=mlp", "--depth_memory", "1,2",
               "--compare", "model.num_kv_heads=1", "--decode", "--decode_steps", "4",
               "--data", "--data_batches", "3"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # exactly one JSON object on stdout
    for key in REQUIRED + BASELINE + ("decode_time_s", "decode_time_vs_baseline",
                                      "loader_tokens_per_sec", "loader_sync_tokens_per_sec"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, result.get(key))
    variant = result["compare"]["num_kv_heads=1"]  # ratios are variant / benchmarked config
    for key in COMPARE:
        assert math.isfinite(variant[key]) and variant[key] > 0, (key, variant.get(key))
    assert result["loader_vs_step"] == result["loader_tokens_per_sec"] / result["tokens_per_sec"]
    assert variant["temp_bytes_vs_config"] == variant["temp_bytes"] / result["temp_bytes"]
    assert 0 < result["mfu"] < 10  # loose: a noisy shared CPU can beat its measured "peak"
    assert result["devices"] == 1
    assert "compile_24_over_4" not in result  # the depth check is opt-in
    assert result["temp_bytes_layers_2"] == result["temp_bytes"]  # same program at 2 layers
    ratio = result["temp_bytes_layers_2"] / result["temp_bytes_layers_1"]
    assert result["temp_bytes_depth_ratio"] == ratio


def test_paired_ratio_cancels_a_change_of_machine_speed_between_rounds():
    # One step per block, ABBA order: config, variant | variant, config | config, variant | ...
    # The machine halves its speed after round 1's variant step; the variant takes 1.1x.
    times = {"config": [1.0, 2.0, 2.0, 2.0], "variant": [1.1, 1.1, 2.2, 2.2]}
    overall = statistics.median(times["variant"]) / statistics.median(times["config"])
    assert overall == pytest.approx(0.825)  # the unpaired ratio mixes the two speeds
    assert paired_ratio(times, "variant", "config", block=1) == pytest.approx(1.1)
    # Blocks of two: rounds of 1.1, 1.1, and one that straddles the change (0.825).
    times = {"config": [1.0, 1.0, 2.0, 2.0, 2.0, 2.0], "variant": [1.1, 1.1, 2.2, 2.2, 1.1, 2.2]}
    assert paired_ratio(times, "variant", "config", block=2) == pytest.approx(1.1)


def test_remat_policies_become_compare_variants_reported_as_ratios_to_the_first():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    assert bench.remat_policies("none, full,dots_saveable") == ["none", "full", "dots_saveable"]
    with pytest.raises(bench.UsageError, match="given twice"):
        bench.remat_policies("full,full")
    label = bench.parse_label(bench.REMAT_VARIANT.format("full"))
    result = {"temp_bytes": 100, "step_time_s": 2.0,
              "compare": {label: {"temp_bytes": 25, "step_time_s": 2.5,
                                  "temp_bytes_vs_config": 0.25, "step_time_vs_config": 1.25}}}
    ratios = bench.remat_policy_ratios(result, ["none", "full"])
    assert ratios["none"]["temp_bytes_vs_first"] == ratios["none"]["step_time_vs_first"] == 1.0
    assert ratios["full"] == {"temp_bytes": 25, "step_time_s": 2.5, "temp_bytes_vs_first": 0.25,
                              "step_time_vs_first": 1.25}
