"""Training tests: resume, re-sharded restore, corrupted checkpoints, NaN stop, bad input, CLI."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from arch.residual import RESIDUALS, MixingParam
from config import ConfigError, resolve
from tests.helpers import one_device_env, tiny_config, tiny_model
from train.checkpoint import Checkpointer
from train.data import in_memory
from train.loop import NonFiniteLoss, train
from train.optim import decay_mask, make_optimizer, schedule
from train.step import build_program, resolve_for_job

REPO = Path(__file__).resolve().parents[1]


def losses(workdir) -> dict[int, float]:
    records = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").open()]
    return {r["step"]: r["train_loss"] for r in records}


def data_parallel_config(**fields):
    config = tiny_config()
    config.mesh.data = -1
    config.update(fields)
    return config


@pytest.mark.slow
def test_resume_after_preemption_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
    uninterrupted = train(resolve_for_job(data_parallel_config()), tmp_path / "a")
    assert uninterrupted["step"] == 5 and not uninterrupted["preempted"]

    original_batch = in_memory.Dataset.batch

    def batch_then_sigterm(self, step, *args, **kwargs):
        if self.split == "train" and step == 3:  # preempted after the third step, while
            # the next batch is read (a step ahead, before the processes agree to stop)
            os.kill(os.getpid(), signal.SIGTERM)
        return original_batch(self, step, *args, **kwargs)

    monkeypatch.setattr(in_memory.Dataset, "batch", batch_then_sigterm)
    stopped = train(resolve_for_job(data_parallel_config()), tmp_path / "b")
    assert stopped == {"step": 3, "eval_loss": stopped["eval_loss"], "sample": "",
                       "preempted": True}
    with Checkpointer(tmp_path / "b") as checkpointer:
        assert checkpointer.latest_step() == 3
    monkeypatch.setattr(in_memory.Dataset, "batch", original_batch)
    with pytest.raises(ConfigError, match="holds a run with a different config \\(seed: 0 → 1\\)"):
        train(resolve_for_job(data_parallel_config(seed=1)), tmp_path / "b")
    resumed = train(resolve_for_job(data_parallel_config()), tmp_path / "b")
    assert resumed["step"] == 5
    assert list(losses(tmp_path / "b")) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(list(losses(tmp_path / "b").values()),
                               list(losses(tmp_path / "a").values()), rtol=1e-6)


# Orbax leaves a callback on its closed event loop after the failed restore: harmless noise.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow
def test_checkpoint_restores_onto_another_mesh_and_skips_a_corrupted_latest(tmp_path, caplog):
    train(resolve_for_job(data_parallel_config(steps=3, checkpoint_every=1)), tmp_path)
    restored = {}
    for mesh in ((8, 1, 1), (2, 2, 2), (1, 4, 2)):
        config = tiny_config()
        config.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
        program = build_program(resolve_for_job(config))
        with Checkpointer(tmp_path) as checkpointer:
            step, state, position = checkpointer.restore_latest(program.abstract_state())
        assert step == 3 and position == {"next_step": 3, "seed": 0, "skipped_steps": 0}
        restored[mesh] = jax.device_get(state["params"])
        leaves = jax.tree.leaves(state)
        assert all(x.sharding.mesh.shape == program.mesh.shape for x in leaves)
        assert [x.sharding for x in leaves] == jax.tree.leaves(program.state_shardings)
    jax.tree.map(np.testing.assert_array_equal, restored[(8, 1, 1)], restored[(2, 2, 2)])
    jax.tree.map(np.testing.assert_array_equal, restored[(8, 1, 1)], restored[(1, 4, 2)])

    state_dir = tmp_path / "checkpoints" / "3" / "state"
    for item in state_dir.iterdir():  # corrupt the newest checkpoint's array data
        if item.is_dir():
            shutil.rmtree(item)
    (tmp_path / "checkpoints" / "4").mkdir()  # a partial save: the directory and nothing else
    program = build_program(resolve_for_job(data_parallel_config()))
    with Checkpointer(tmp_path) as checkpointer:
        step, _, _ = checkpointer.restore_latest(program.abstract_state())
    assert step == 2
    assert "checkpoint at step 4 cannot be restored" in caplog.text
    assert "checkpoint at step 3 cannot be restored" in caplog.text


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    config = data_parallel_config(checkpoint_every=1)
    config.optimizer.update(learning_rate=1e30, warmup_steps=0)
    with pytest.raises(NonFiniteLoss, match=r"at step (\d)") as error:
        train(resolve_for_job(config), tmp_path)
    bad_step = int(re.search(r"at step (\d+)", str(error.value)).group(1))
    program = build_program(resolve_for_job(config))
    with Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.latest_step() == bad_step - 1
        _, state, _ = checkpointer.restore_latest(program.abstract_state())
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(state["params"])))


@pytest.mark.parametrize("overrides,message", [
    (dict(model=dict(attention=dict(num_kv_heads=3))),
     "model.attention.num_kv_heads=3 is invalid: must divide"),
    (dict(model=dict(attention=dict(head_dim=16))), "set model.attention.width=64"),
    (dict(model=dict(norm=dict(name="groupnorm"))),
     "valid norms: batchnorm, causal_batchnorm, dyt,"),
    (dict(model=dict(ffn=dict(name="conv"))), "valid ffns: geglu, glu, mlp, moe, reglu, swiglu"),
    (dict(mesh=dict(data=3)), "product 3 ≠ the 8 devices"),
    (dict(batch_size=6, mesh=dict(data=4, fsdp=2)), "batch_size=6 is invalid"),
    (dict(mesh=dict(data=1, tensor=8)),
     "model.attention.num_heads=4 is invalid: must be divisible by mesh"),
    (dict(model=dict(ffn=dict(d_ff=50)), mesh=dict(data=2, tensor=4)),
     "model.ffn.d_ff=50 is invalid"),
    (dict(mesh=dict(data=-1, fsdp=-1)), "only one mesh axis may be -1"),
], ids=lambda x: str(x)[:40])
def test_bad_config_is_one_clear_line(overrides, message):
    config = data_parallel_config()
    config.update(overrides)
    with pytest.raises(ConfigError) as error:
        config = resolve(config, 8)
    assert message in str(error.value) and "\n" not in str(error.value)


def cli(*args):
    env = one_device_env()
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


TINY_CLI = ["--config.steps=4", "--config.model.d_model=32", "--config.model.attention.num_heads=4",
            "--config.model.attention.num_kv_heads=2", "--config.model.num_layers=1",
            "--config.seq_len=16", "--config.batch_size=4", "--config.eval_every=2",
            "--config.eval_batches=1", "--config.log_every=1", "--config.sample_tokens=24",
            "--config.optimizer.warmup_steps=1"]


@pytest.mark.slow
def test_cli_trains_evaluates_and_samples(tmp_path):
    run = cli("-m", "train", "--config", "experiments/quickstart.py", "--workdir", str(tmp_path),
              *TINY_CLI)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "validation loss at step 4:" in run.stdout
    sample = run.stdout.split("sample:\n")[1]
    assert sample.startswith("And God said") and len(sample.encode()) >= len("And God said") + 20
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert {"train_loss", "tokens_per_sec", "mfu"} <= set(record)
        assert math.isfinite(record["train_loss"]) and record["tokens_per_sec"] > 0
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model"]["attention"]["head_dim"] == 8 and saved["steps"] == 4
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    generated = cli("-m", "train.generate", "--workdir", str(tmp_path), "--prompt", "In the",
                    "--num_tokens", "10", "--temperature", "0")
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert "[step 4]" in generated.stdout and "\nIn the" in generated.stdout


@pytest.mark.parametrize("args,message", [
    (["--config", "experiments/nope.py"], "error: --config=experiments/nope.py does not exist"),
    (["--config", "experiments/quickstart.py", "--config.model.attention.num_kv_heads=5"],
     "error: model.attention.num_kv_heads=5 is invalid"),
    (["--config", "experiments/quickstart.py", "--config.model.position.name=alibi"],
     "valid positions: learned, none, rope"),
], ids=["missing-file", "kv-heads", "unknown-position"])
def test_cli_bad_input_exits_2_with_one_line(tmp_path, args, message):
    run = cli("-m", "train", *args, "--workdir", str(tmp_path))
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_schedules():
    config = tiny_config()
    opt = config.optimizer
    opt.update(learning_rate=1.0, warmup_steps=10, final_lr_fraction=0.1, decay_fraction=0.2)
    cosine = schedule(opt, 100)
    assert float(cosine(0)) == 0 and float(cosine(10)) == pytest.approx(1.0)
    assert float(cosine(100)) == pytest.approx(0.1)
    assert float(cosine(55)) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-6)  # cosine midpoint
    opt.schedule = "wsd"
    wsd = schedule(opt, 100)
    assert [float(wsd(s)) for s in (5, 10, 50, 80)] == pytest.approx([0.5, 1, 1, 1])
    assert float(wsd(90)) == pytest.approx(0.55) and float(wsd(100)) == pytest.approx(0.1)


@pytest.mark.slow
def test_weight_decay_skips_norm_gains_biases_and_embeddings():
    from flax import nnx

    _, model = tiny_model(norm="layernorm", position="learned", head="untied")
    params = nnx.state(model, nnx.Param)
    opt = tiny_config().optimizer
    opt.update(warmup_steps=0, weight_decay=0.5, grad_clip=0.0)
    optimizer = make_optimizer(opt, steps=10)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
    flat_mask = nnx.to_flat_state(decay_mask(opt, params))
    for (path, update), (_, decayed) in zip(nnx.to_flat_state(updates), flat_mask, strict=True):
        name = path[-1]
        assert decayed.get_value() == (name == "kernel"), path
        assert bool(jnp.any(update[...] != 0)) == (name == "kernel"), path
    assert isinstance(optimizer, optax.GradientTransformation)


# The mixing weights each mechanism declares (`arch.residual.MixingParam`), by name.
MIXING_WEIGHTS = {
    "hc": {"static_read", "static_mixing", "static_write", "width_scale", "depth_scale"},
    "mhc": {"read_bias", "write_bias", "mixing_bias", "read_scale", "write_scale",
            "mixing_scale"},
    "width": {"branch_weights"},
    "attnres": {"pseudo_queries"},
}


@pytest.mark.parametrize("residual", sorted(RESIDUALS))
def test_weight_decay_skips_residual_mixing_parameters(residual):
    from flax import nnx

    _, model = tiny_model(residual=residual)
    params = nnx.state(model, nnx.Param)
    opt = tiny_config().optimizer
    mask = nnx.to_flat_state(decay_mask(opt, params))
    decayed = {path: flag.get_value() for path, flag in mask}
    mixing = {path for path, variable in nnx.to_flat_state(params)
              if isinstance(variable, MixingParam)}
    assert {path[-1] for path in mixing} >= MIXING_WEIGHTS.get(residual, set())
    assert not any(decayed[path] for path in mixing)
    assert any(decayed[path] for path in decayed if path[-1] == "kernel")
    opt.decay_mixing = True  # then only the name groups are kept out
    mask = dict(nnx.to_flat_state(decay_mask(opt, params)))
    assert all(mask[path].get_value() for path in mixing if path[-1] not in (
        "scale", "alpha", "bias", "embedding", "table"))


@pytest.mark.slow
def test_muon_updates_hidden_matrices_as_optax_muon_and_the_rest_as_adamw():
    from flax import nnx
    from optax.contrib import MuonDimensionNumbers

    from train.optim import muon_dimensions

    _, model = tiny_model(position="learned", head="untied", ffn="moe", moe__experts=2)
    params = nnx.state(model, nnx.Param)
    opt = tiny_config().optimizer
    opt.update(name="muon", warmup_steps=0, weight_decay=0.1, grad_clip=0.0)
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(x.size), x.shape), params)
    optimizer = make_optimizer(opt, steps=10)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)

    dims = dict(nnx.to_flat_state(muon_dimensions(params)))
    flat = dict(nnx.to_flat_state(params))
    flat_grads, flat_updates = dict(nnx.to_flat_state(grads)), dict(nnx.to_flat_state(updates))
    muon_paths = {path for path, d in dims.items() if d is not None}
    # The blocks' projections (a leading layers axis; experts too) and nothing else.
    assert {path[-1] for path in muon_paths} == {"kernel", "up", "down", "gate"}
    assert not any(path[0] in ("head", "embed", "position") for path in muon_paths)
    query = next(p for p in muon_paths if "query" in p)
    assert flat[query].shape == (2, 32, 4, 8) and dims[query] == MuonDimensionNumbers((1,), (2, 3))
    expert = next(p for p in muon_paths if p[-1] == "down")
    assert flat[expert][...].ndim == 4 and dims[expert] == MuonDimensionNumbers((2,), (3,))

    schedule_ = schedule(opt, 10)
    reference = optax.contrib.muon(schedule_, beta=opt.muon_momentum, eps=opt.eps,
                                   weight_decay=opt.weight_decay, consistent_rms=opt.muon_rms,
                                   muon_weight_dimension_numbers=dims[query])
    expected, _ = reference.update(flat_grads[query][...],
                                   reference.init(flat[query][...]), flat[query][...])
    np.testing.assert_allclose(flat_updates[query][...], expected, rtol=1e-5, atol=1e-7)

    adam_opt = opt.copy_and_resolve_references()
    adam_opt.name = "adamw"
    adamw = make_optimizer(adam_opt, steps=10)
    adam_updates, _ = adamw.update(grads, adamw.init(params), params)
    for path, update in nnx.to_flat_state(adam_updates):
        if path not in muon_paths:
            np.testing.assert_allclose(flat_updates[path][...], update[...], rtol=1e-6,
                                       err_msg=str(path))


@pytest.mark.slow
def test_muon_trains_and_a_sharded_step_equals_one_device():
    from sharding.mesh import make_mesh
    from tests.helpers import random_tokens
    from train.step import TrainProgram

    def run(devices, mesh):
        config = tiny_config()
        config.optimizer.update(name="muon", warmup_steps=0)
        config.mesh.update(mesh)
        config = resolve(config, devices)
        program = TrainProgram(config, make_mesh(config, jax.devices()[:devices]))
        state, tokens = program.init(0), program.put_batch(np.asarray(random_tokens((8, 17))))
        losses = []
        for _ in range(4):
            state, metrics = program.train_step(state, tokens)
            losses.append(float(metrics["loss"]))
        return losses, jax.device_get(state["params"])

    losses, params = run(1, dict(data=1))
    assert losses[-1] < losses[0] - 0.05, losses
    sharded_losses, sharded_params = run(8, dict(data=2, fsdp=2, tensor=2))
    np.testing.assert_allclose(sharded_losses, losses, rtol=2e-5)
    for a, b in zip(jax.tree.leaves(sharded_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
