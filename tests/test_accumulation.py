"""Gradient accumulation (`accumulation_steps`): one update from k microbatches equals the unsplit
batch's, on one device, a data×tensor mesh and an FSDP×sequence×tensor mesh (striped per
microbatch); MoE aux metrics are the microbatches' mean; a
resumed run reproduces the uninterrupted one; and the config errors."""

import functools
import json
import shutil
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from config import ConfigError, resolve
from sharding.mesh import make_mesh
from tests.helpers import random_tokens, tiny_config
from train import loop
from train.loop import train
from train.step import TrainProgram, resolve_for_job

BATCH = 16
MESHES = {"one_device": (1, dict(data=1)), "data4_tensor2": (8, dict(data=4, tensor=2)),
          "fsdp2_sequence2_tensor2": (8, dict(fsdp=2, sequence=2, tensor=2))}


def program_on(devices: int, mesh: dict, steps: int, batch_size: int = BATCH,
               **model) -> TrainProgram:
    config = tiny_config(**model)
    config.update(batch_size=batch_size, accumulation_steps=steps)
    config.mesh.update(mesh)
    config = resolve(config, devices)
    return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))


@functools.cache
def one_step(mesh_name: str, steps: int):
    """(new state, metrics) of one train step from the initial state, on host."""
    devices, mesh = MESHES[mesh_name]
    program = program_on(devices, mesh, steps)
    tokens = np.asarray(random_tokens((BATCH, 17)))
    state, metrics = program.train_step(program.init(0), program.put_batch(tokens))
    return jax.device_get(state), jax.device_get(metrics)


@pytest.mark.parametrize("mesh_name, steps", [
    *((mesh_name, 2) for mesh_name in MESHES), ("one_device", 4)])
@pytest.mark.slow
def test_accumulated_step_equals_the_unsplit_batch(mesh_name, steps):
    reference_state, reference = one_step(mesh_name, 1)
    state, metrics = one_step(mesh_name, steps)
    for name in ("loss", "grad_norm", "update_norm"):
        np.testing.assert_allclose(metrics[name], reference[name], rtol=1e-5)
    assert metrics["finite"]
    chex.assert_trees_all_close(state, reference_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh_name", ["data4_tensor2", "fsdp2_sequence2_tensor2"])
def test_sharded_unsplit_step_matches_one_device(mesh_name):
    """The meshes' references agree, so the accumulated steps agree across meshes."""
    chex.assert_trees_all_close(one_step(mesh_name, 1)[1]["loss"],
                                one_step("one_device", 1)[1]["loss"], rtol=1e-5)


@pytest.mark.slow
def test_moe_aux_metrics_are_the_microbatch_mean():
    """With k = 2, the loss, MoE aux loss and dropped fraction are the means of those of the two
    microbatches (rows i, k + i, ...) each run as an unsplit batch."""
    moe = dict(ffn="moe", moe__experts=4, moe__top_k=2)
    tokens = np.asarray(random_tokens((8, 17)))
    accumulated = program_on(1, dict(data=1), 2, batch_size=8, **moe)
    _, metrics = accumulated.train_step(accumulated.init(0), accumulated.put_batch(tokens))
    assert {"aux_loss", "moe_dropped_fraction"} <= set(metrics)
    single = program_on(1, dict(data=1), 1, batch_size=4, **moe)
    halves = [single.train_step(single.init(0), single.put_batch(tokens[i::2]))[1]
              for i in range(2)]
    for name in ("loss", "aux_loss", "moe_dropped_fraction"):
        np.testing.assert_allclose(metrics[name], np.mean([h[name] for h in halves]),
                                   rtol=1e-5, atol=1e-7)


def losses(workdir) -> dict[int, float]:
    records = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").open()]
    return {r["step"]: r["train_loss"] for r in records}


@pytest.mark.slow
def test_resumed_accumulating_run_reproduces_the_uninterrupted_one(tmp_path, monkeypatch):
    """4 steps with k = 2 on data=4 × tensor=2, checkpointing every 2; the step-2 checkpoint,
    resumed, reproduces steps 3 and 4. The losses also match k = 1's (same batches), also when
    the checkpoint resumes with k = 1."""
    monkeypatch.setattr(loop, "measure_matmul_peak", lambda: 1.0)  # MFU is not tested here
    config = tiny_config()
    config.update(steps=4, checkpoint_every=2, accumulation_steps=2)
    config.mesh.update(data=-1, tensor=2)
    uninterrupted = train(resolve_for_job(config), tmp_path / "a")
    assert uninterrupted["step"] == 4

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "4")
    (tmp_path / "b" / "metrics.jsonl").unlink()
    resumed = train(resolve_for_job(config), tmp_path / "b")
    assert list(losses(tmp_path / "b")) == [3, 4]
    np.testing.assert_allclose([losses(tmp_path / "b")[s] for s in (3, 4)],
                               [losses(tmp_path / "a")[s] for s in (3, 4)], rtol=1e-6)
    np.testing.assert_allclose(resumed["eval_loss"], uninterrupted["eval_loss"], rtol=1e-6)

    config.accumulation_steps = 1
    train(resolve_for_job(config), tmp_path / "c")
    np.testing.assert_allclose(list(losses(tmp_path / "a").values()),
                               list(losses(tmp_path / "c").values()), rtol=1e-5)

    # accumulation_steps may change on resume (a memory setting: the update is the same).
    shutil.copytree(tmp_path / "a", tmp_path / "d")
    shutil.rmtree(tmp_path / "d" / "checkpoints" / "4")
    (tmp_path / "d" / "metrics.jsonl").unlink()
    train(resolve_for_job(config), tmp_path / "d")
    np.testing.assert_allclose([losses(tmp_path / "d")[s] for s in (3, 4)],
                               [losses(tmp_path / "a")[s] for s in (3, 4)], rtol=1e-5)


@pytest.mark.parametrize("fields, mesh, message", [
    (dict(accumulation_steps=0), {}, "accumulation_steps=0 .*must be a positive integer"),
    (dict(accumulation_steps=3), {}, "accumulation_steps=3 .*must divide batch_size=8"),
    (dict(accumulation_steps=4), dict(data=-1),
     "accumulation_steps=4 .*microbatches of .* = 2 sequences.*mesh.expert = 8"),
    (dict(accumulation_steps=2), dict(fsdp=4, stage=2),
     "accumulation_steps=2 .*mesh.stage=2.*execution.pipeline.microbatches"),
])
def test_invalid_accumulation_is_one_line(fields, mesh, message):
    config = tiny_config()
    config.update(fields)
    config.mesh.update(mesh)
    with pytest.raises(ConfigError, match=message) as error:
        config = resolve(config, 8)
    assert "\n" not in str(error.value)
