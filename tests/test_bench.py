"""scripts/bench.py end to end (one tiny run as a subprocess, every reported figure checked) and
its paired ratio of step times."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from arch import reference
from config import resolve
from sharding.mesh import make_mesh
from tests.helpers import one_device_env, tiny_config
from train.instruments.timing import paired_ratio
from train.optim import decay_mask, make_optimizer
from train.step import TrainProgram

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("tokens_per_sec", "step_time_s", "compile_time_s", "mfu", "peak_flops",
            "temp_bytes", "vs_reference", "reference_step_time_s")
BASELINE = ("baseline_step_time_s", "step_time_vs_baseline", "temp_bytes_vs_baseline",
            "temp_bytes_layers_1", "temp_bytes_layers_2", "temp_bytes_depth_ratio")


# The family of configs the PyTorch model implements (train/interop/torch_model.py).
TORCH_MODEL_FIELDS = dict(norm__name="layernorm", position__name="learned", ffn__name="mlp",
                          ffn__activation="gelu", head__name="untied", attention__num_kv_heads=4)
TORCH_MODEL = {field.removesuffix("__name"): value for field, value in TORCH_MODEL_FIELDS.items()}
TINY = ["--config", str(ROOT / "experiments" / "quickstart.py"), "--config.model.d_model=32",
        "--config.model.attention.num_heads=4", "--config.model.num_layers=2",
        "--config.seq_len=16", "--config.batch_size=4", "--json", "--block", "1"]


def one_device_program(config) -> TrainProgram:
    config = resolve(config, 1)  # tiny_config's mesh.data=1, on the first of conftest's devices
    return TrainProgram(config, make_mesh(config, jax.devices()[:1]))


def run_bench(*arguments: str) -> subprocess.CompletedProcess:
    env = one_device_env()
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *TINY, *arguments],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


COMPARE = ("step_time_s", "step_time_vs_config", "temp_bytes", "temp_bytes_vs_config",
           "decode_time_s", "decode_time_vs_config")


@pytest.fixture(scope="module")
def quickstart_bench() -> subprocess.CompletedProcess:
    """One bench run of the (tiny) quickstart with every option but --vs_unrolled: the JSON test
    and the --vs_torch refusal test read it (the quickstart is a config the PyTorch model does
    not implement), so the program compiles once."""
    env = one_device_env()
    env["JAX_PLATFORMS"] = "cpu"
    command = [sys.executable, str(ROOT / "scripts" / "bench.py"),
               "--config", str(ROOT / "experiments" / "quickstart.py"),
               "--config.model.d_model=32", "--config.model.attention.num_heads=4",
               "--config.model.num_layers=2", "--config.seq_len=16", "--config.batch_size=8",
               "--json", "--steps", "3", "--block", "1",
               "--baseline", "model.ffn.name=mlp", "--depth_memory", "1,2",
               "--compare", "model.attention.num_kv_heads=1;model.attention.window=4", "--decode",
               "--decode_steps", "4",
               "--data", "--data_batches", "3", "--vs_torch"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_bench_json_with_baseline_compare_decode_and_depth_memory(quickstart_bench):
    done = quickstart_bench
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)  # exactly one JSON object on stdout
    for key in REQUIRED + BASELINE + ("decode_time_s", "decode_time_vs_baseline",
                                      "loader_tokens_per_sec", "loader_sync_tokens_per_sec"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, result.get(key))
    # ratios are variant / benchmarked config
    variant = result["compare"]["attention.num_kv_heads=1"]
    for key in COMPARE:
        assert math.isfinite(variant[key]) and variant[key] > 0, (key, variant.get(key))
    assert result["loader_vs_step"] == result["loader_tokens_per_sec"] / result["tokens_per_sec"]
    assert variant["temp_bytes_vs_config"] == variant["temp_bytes"] / result["temp_bytes"]
    # the KV cache decoding allocates: 2 layers × 1 sequence × positions × (keys + values of
    # 2 KV heads of 8 float32 = 128 bytes); the window's ring holds 4 of the 16 positions (and
    # their int32 positions), the MQA variant 1 of 2 KV heads
    assert result["decode_cache_positions"] == 16
    assert result["decode_cache_bytes"] == 2 * 16 * 128
    assert variant["decode_cache_bytes"] == 2 * 16 * 128 // 2
    windowed = result["compare"]["attention.window=4"]
    assert windowed["decode_cache_positions"] == 4
    assert windowed["decode_cache_bytes"] == 2 * 4 * (128 + 4)
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


@pytest.mark.parametrize("overrides", [{}, {"head": "tied", "linear_bias": True,
                                            "norm__final": False}])
@pytest.mark.slow
def test_torch_model_trains_like_the_framework_from_its_parameters(overrides):
    pytest.importorskip("torch")
    from train.interop import torch_model
    config = tiny_config(**{**TORCH_MODEL, **overrides})
    config.batch_size, config.optimizer.warmup_steps = 4, 1  # learning rates 0, then 3e-3
    program = one_device_program(config)
    config = program.config
    assert torch_model.unsupported(config) is None
    state = program.init(config.seed)
    trainer = torch_model.TorchTrainer(
        config, nnx.to_pure_dict(state["params"]),
        nnx.to_pure_dict(decay_mask(config.optimizer, state["params"])))
    tokens = np.random.default_rng(0).integers(0, 256, (4, 17), dtype=np.int32)
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    expected = model(tokens[:, :-1], np.broadcast_to(np.arange(16), (4, 16)))
    np.testing.assert_allclose(trainer.logits(tokens[:, :-1]), expected, rtol=1e-4, atol=1e-5)
    batch, losses = program.put_batch(tokens), []
    for _ in range(3):  # the third loss follows one update at 3e-3 (the first is at rate 0)
        state, metrics = program.train_step(state, batch)
        losses.append((float(metrics["loss"]), trainer.step(tokens)))
    framework, eager = np.array(losses).T
    assert framework[2] < framework[0] - 0.1  # the update changed the model
    np.testing.assert_allclose(eager, framework, rtol=1e-5)  # float32, fused AdamW vs optax


def test_torch_model_refuses_what_it_does_not_implement_in_one_line():
    pytest.importorskip("torch")
    from train.interop import torch_model
    config = tiny_config(**{**TORCH_MODEL, "ffn": "swiglu"})
    reason = torch_model.unsupported(config)
    assert reason.startswith("the PyTorch model has no model.ffn.name='swiglu'; it models Pre-LN")
    assert "\n" not in reason
    config = tiny_config(**{**TORCH_MODEL, "attention__num_kv_heads": 2})
    assert "model.attention.num_kv_heads=2" in torch_model.unsupported(config)


@pytest.mark.slow
def test_unrolled_reference_step_equals_the_scanned_one():
    config = tiny_config(**TORCH_MODEL)
    program = one_device_program(config)
    params = program.init(config.seed)["params"]
    optimizer = make_optimizer(config.optimizer, config.steps,
                               mask=nnx.to_pure_dict(decay_mask(config.optimizer, params)))
    tokens = jax.numpy.asarray(np.random.default_rng(0).integers(0, 256, (8, 17), np.int32))
    results = []
    for unrolled in (False, True):
        pure = jax.tree.map(jax.numpy.copy, nnx.to_pure_dict(params))  # the step donates it
        step = reference.make_train_step(config.model, optimizer, unrolled)
        state = (pure, optimizer.init(pure))
        for _ in range(3):
            *state, loss = step(*state, tokens)
        results.append((state[0], loss))
    (scanned, scanned_loss), (unrolled, unrolled_loss) = results
    np.testing.assert_allclose(unrolled_loss, scanned_loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 unrolled, scanned)


@pytest.mark.slow
def test_bench_json_vs_torch_and_vs_unrolled_with_profiles():
    pytest.importorskip("torch")
    done = run_bench("--steps", "2", "--vs_torch", "--vs_unrolled", "--profile", "1",
                     *(f"--config.model.{field.replace('__', '.')}={value}"
                       for field, value in TORCH_MODEL_FIELDS.items()))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for key in ("torch_step_time_s", "vs_torch", "unrolled_step_time_s", "vs_unrolled"):
        assert math.isfinite(result[key]) and result[key] > 0, (key, result.get(key))
    assert "no PyTorch comparison" not in done.stderr
    # --profile covers every program timed, PyTorch's by operator (its self times: the largest
    # twelve sum to at most the total); the model's products are among them
    assert set(result["profile"]) == {"framework", "reference", "unrolled", "torch"}
    torch_profile = result["profile"]["torch"]
    assert 0 < sum(torch_profile["by_primitive"].values()) <= torch_profile["op_s"] * (1 + 1e-9)
    assert "aten::mm" in torch_profile["by_primitive"] and torch_profile["ops"] == []


@pytest.mark.slow
def test_bench_vs_torch_refuses_an_unsupported_config_in_one_line(quickstart_bench):
    pytest.importorskip("torch")
    done = quickstart_bench  # the quickstart: RMSNorm, RoPE, SwiGLU, GQA
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["torch_step_time_s"] is None and result["vs_torch"] is None
    refusals = [line for line in done.stderr.splitlines() if "no PyTorch comparison" in line]
    assert len(refusals) == 1
    assert refusals[0].startswith("no PyTorch comparison: the PyTorch model has no "
                                  "model.norm.name='rmsnorm'; it models Pre-LN")
    assert "vs_unrolled" not in result  # opt-in, as --vs_torch is
