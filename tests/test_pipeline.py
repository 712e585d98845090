"""Pipeline parallelism (sharding/pipeline.py) equals one device: GPipe and circular schedules,
the plain stream and multi-stream residual states; its config errors; training, resuming and
restoring across layouts."""

import functools
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from config import ConfigError, resolve
from sharding.mesh import make_mesh
from sharding.pipeline import bubble_fraction, stage_transfer_bytes
from tests.helpers import random_tokens, tiny_config
from train import loop
from train.loop import train
from train.step import TrainProgram, compile_train_step, next_token_loss, resolve_for_job

LAYERS = 8  # 8 layer-scan units: 4 stages × 2 virtual stages


def program_on(devices: int, mesh: dict, **model) -> TrainProgram:
    config = tiny_config(num_layers=LAYERS, **model)
    config.mesh.update(mesh)
    config = resolve(config, devices)
    return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))


def logits_loss_and_grads(program: TrainProgram, state, tokens):
    """(logits, loss, parameter gradients) of one batch, from one jitted function."""
    def run(params, model_state, tokens):
        def loss(params):
            logits = nnx.merge(program.graphdef, params, model_state)(tokens[:, :-1])
            return next_token_loss(logits, tokens[:, 1:]), logits

        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return logits, value, grads

    with jax.set_mesh(program.mesh):
        params = jax.device_put(state["params"], program.state_shardings["params"])
        model_state = jax.device_put(state["model_state"],
                                     program.state_shardings["model_state"])
        return params, jax.device_get(jax.jit(run)(params, model_state,
                                                   program.put_batch(tokens)))


@functools.cache
def single_device(residual: str):
    """Random parameters (N(0, 0.2²) everywhere: non-degenerate mixing, and no initializer to
    compile), tokens and (logits, loss, gradients) of the model on one device."""
    program = program_on(1, dict(data=1), residual=residual, attnres__block_size=3)
    abstract = program.abstract_state()
    rng = np.random.default_rng(0)
    state = {"params": jax.tree.map(lambda x: rng.normal(0, 0.2, x.shape).astype(x.dtype),
                                    abstract["params"]),
             "model_state": jax.tree.map(lambda x: np.zeros(x.shape, x.dtype),
                                         abstract["model_state"])}
    tokens = np.asarray(random_tokens((8, 17)))
    return state, tokens, logits_loss_and_grads(program, state, tokens)[1]


CASES = {  # residual, mesh, pipeline fields (block_attnres: the cached transfer, the default);
    # GPipe with prenorm: the training test below
    "block_attnres-circular-stage4-data2-V2": (
        "block_attnres", dict(data=2, stage=4),
        dict(execution__pipeline__schedule="circular", execution__pipeline__virtual_stages=2)),
    "gated_residual-gpipe-stage2-data2-tensor2": ("gated_residual",
                                                  dict(data=2, tensor=2, stage=2), {}),
    "mhc-circular-stage2-fsdp2-tensor2-V2": (
        "mhc", dict(fsdp=2, tensor=2, stage=2),
        dict(execution__pipeline__schedule="circular", execution__pipeline__virtual_stages=2)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_pipeline_matches_single_device(case):
    residual, mesh, fields = CASES[case]
    state, tokens, (logits_1, loss_1, grads_1) = single_device(residual)
    program = program_on(8, dict(data=1) | mesh, residual=residual, attnres__block_size=3,
                         **fields)
    params, (logits, loss, grads) = logits_loss_and_grads(program, state, tokens)
    kernel = params["blocks"]["attention"]["query"]["kernel"][...]
    assert kernel.sharding.spec[0] == "stage"  # layers are stacked per stage
    np.testing.assert_allclose(logits, logits_1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, loss_1, rtol=1e-6)
    scale = max(np.abs(g).max() for g in jax.tree.leaves(grads_1))  # sums in another order
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale),
                 grads, grads_1)


@pytest.mark.slow
def test_attnres_stage_transfer_sends_only_new_slots():
    """The cached transfer (AttnRes report): each stage keeps its own copy of every microbatch's
    source buffer and is sent only the slots written in the P − 1 chunks since it last held it,
    not the whole buffer. Counted in the compiled train step's stage-to-stage
    collective-permutes (forward, and the cotangents backward)."""
    sent = {}
    for transfer in ("full", "cached"):
        program = program_on(8, dict(data=2, stage=4), residual="block_attnres",
                             attnres__block_size=3, execution__pipeline__schedule="circular",
                             execution__pipeline__virtual_stages=2,
                             execution__pipeline__transfer=transfer)
        sent[transfer] = stage_transfer_bytes(compile_train_step(program)[1].as_text())
    # 16 sublayers in blocks of 3: 1 + 6 slots of 32 features and a 1/rms each, for microbatches
    # of 1 row × 16 tokens; the lag, P − 1 = 3 chunks of 2 sublayers, touches ⌈5/3⌉ + 1 = 3 slots
    slot_bytes = 16 * (32 + 1) * 4
    full = 2 * (7 * slot_bytes + 17 * 32 * 4) + 4  # buffer and query table both ways; counter
    assert sent == {"full": full, "cached": 2 * 3 * slot_bytes + 4}


def test_bubble_fraction():
    assert bubble_fraction(1, 1, 8) == 0
    assert bubble_fraction(4, 1, 4) == 3 / 7  # GPipe: (P − 1)/(M + P − 1)
    assert bubble_fraction(4, 2, 4) == 3 / 11  # circular: (P − 1)/(V·M + P − 1)


@pytest.mark.parametrize("overrides,message", [
    (dict(model=dict(num_layers=6), mesh=dict(data=2, stage=4)),
     "model.num_layers=6 is invalid: its 6 layers must split evenly into mesh.stage × "
     "execution.pipeline.virtual_stages = 4×1 = 4 pipeline chunks"),
    (dict(model=dict(num_layers=4, ffn=dict(name="moe"), moe=dict(every=2)), mesh=dict(data=2,
                                                                                       stage=4)),
     "model.num_layers=4 is invalid: its 2 layer groups (num_layers / moe.every) must split "
     "evenly into mesh.stage × execution.pipeline.virtual_stages = 4×1 = 4 pipeline chunks"),
    (dict(execution=dict(pipeline=dict(schedule="circular", virtual_stages=2)),
          mesh=dict(data=2, stage=4)),
     "model.num_layers=4 is invalid: its 4 layers must split evenly into mesh.stage × "
     "execution.pipeline.virtual_stages = 4×2 = 8 pipeline chunks"),
    (dict(execution=dict(pipeline=dict(microbatches=2)), mesh=dict(data=2, stage=4)),
     "execution.pipeline.microbatches=2 is invalid: must be at least mesh.stage=4 (every stage "
     "needs a microbatch in flight)"),
    (dict(execution=dict(pipeline=dict(microbatches=3)), mesh=dict(data=4, stage=2)),
     "execution.pipeline.microbatches=3 is invalid: must divide the 2 rows of each data shard "
     "(batch_size=8 over mesh.data×mesh.fsdp×mesh.expert = 4)"),
    (dict(execution=dict(pipeline=dict(virtual_stages=2)), mesh=dict(data=4, stage=2)),
     "execution.pipeline.virtual_stages=2 is invalid: gpipe runs one chunk per device; use 1 or "
     "execution.pipeline.schedule='circular'"),
    (dict(execution=dict(pipeline=dict(schedule="1f1b"))),
     "execution.pipeline.schedule='1f1b' is invalid: valid schedules: gpipe, circular"),
    (dict(execution=dict(pipeline=dict(transfer="some"))),
     "execution.pipeline.transfer='some' is invalid: valid: cached, full"),
    (dict(execution=dict(pipeline=dict(microbatches=0))),
     "execution.pipeline.microbatches=0 is invalid: must be a positive integer"),
    (dict(model=dict(reversible=True), execution=dict(pipeline=dict(microbatches=2)),
          mesh=dict(data=4, stage=2)),
     "model.reversible=True is invalid: reversible blocks are not pipelined; use mesh.stage=1 "
     "(got mesh.stage=2)"),
    (dict(model=dict(norm=dict(name="batchnorm")), execution=dict(pipeline=dict(microbatches=2)),
          mesh=dict(data=4, stage=2)),
     "model.norm.name='batchnorm' is invalid: batch statistics of a microbatch differ from the "
     "batch's under mesh.stage=2; use a per-token norm or mesh.stage=1"),
], ids=lambda x: str(x)[:48])
def test_bad_pipeline_config_is_one_clear_line(overrides, message):
    config = tiny_config(num_layers=4)
    config.mesh.data = 8
    config.update(overrides)
    with pytest.raises(ConfigError) as error:
        config = resolve(config, 8)
    assert str(error.value) == message


def losses(workdir) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    return {r["step"]: r["train_loss"] for r in records}


@pytest.mark.slow
def test_pipelined_training_resumes_on_one_stage(tmp_path, monkeypatch):
    """Train 3 steps with stage=2 × fsdp=4 (GPipe; checkpoints every step; a sample at the end:
    KV-cache decoding falls back to the sequential layer scan). Resume its step-1 checkpoint on
    one stage (data=8): steps 2 and 3 reproduce the pipelined run's losses and evaluation, so
    the pipelined forward pass, gradients and updates equal the ordinary ones."""
    monkeypatch.setattr(loop, "measure_matmul_peak", lambda: 1.0)  # MFU is not tested here
    config = tiny_config(num_layers=2)
    config.update(steps=3, checkpoint_every=1, sample_tokens=4)
    config.mesh.update(fsdp=4, stage=2)
    config.execution.pipeline.microbatches = 2
    pipelined = train(resolve_for_job(config), tmp_path / "a")
    assert pipelined["sample"].startswith(config.sample_prompt)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").open()]
    assert [r["pipeline_bubble_fraction"] for r in records] == [1 / 3] * 3  # (2−1)/(2+2−1)

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    for step in (2, 3):
        shutil.rmtree(tmp_path / "b" / "checkpoints" / str(step))
    (tmp_path / "b" / "metrics.jsonl").unlink()
    config.mesh.update(data=8, fsdp=1, stage=1)
    config.sample_tokens = 0
    resumed = train(resolve_for_job(config), tmp_path / "b")
    assert list(losses(tmp_path / "b")) == [2, 3]
    np.testing.assert_allclose([losses(tmp_path / "b")[s] for s in (2, 3)],
                               [losses(tmp_path / "a")[s] for s in (2, 3)], rtol=1e-5)
    np.testing.assert_allclose(resumed["eval_loss"], pipelined["eval_loss"], rtol=1e-5)
