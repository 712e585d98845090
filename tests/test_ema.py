"""EMA of the parameters and self-distillation from it (train/step.py): a gradient boundary is not
a teacher update. Stop-gradient changes the backward path and not the forward value; a detached
branch that shares parameters still sends them gradients through the student path; the EMA
teacher changes only by its update rule. Then the EMA through the run: off by default (the state
and the numbers as without it), kept in checkpoints so a resumed run is bit-identical, evaluated
(`eval_loss_ema`) and sampled (`python -m train.generate --ema`), sharded like the parameters."""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from config import ConfigError, resolve
from config.validate import check_fields
from sharding.mesh import make_mesh
from tests.helpers import random_tokens, tiny_config, tiny_model, write_run
from train.checkpoint import Checkpointer
from train.data import in_memory
from train.generate import check_arguments
from train.generate import main as generate_main
from train.loop import _start_state, evaluate, load_splits, train
from train.restore import restore_for_analysis, restore_run, with_ema_params
from train.sampling import generate_text
from train.step import (
    TrainProgram,
    build_program,
    distillation_kl,
    next_token_loss,
    resolve_for_job,
)

STATE_KEYS = {"step", "params", "model_state", "opt_state"}


def ema_config(**fields):
    """The tiny config with an EMA (decay 0.5, so it moves visibly in a few steps) and
    distillation from it."""
    config = tiny_config()
    config.optimizer.update(ema_decay=0.5, warmup_steps=0, learning_rate=1e-2)
    config.objective.ema_distill_weight = 0.5
    config.update(fields)
    return config


def single_device_program(config, devices: int = 1, mesh: dict | None = None) -> TrainProgram:
    config.mesh.update(mesh or dict(data=1))
    config = resolve(config, devices)
    return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))


def logits_function(seed: int = 0):
    """(params, f) of a one-layer tiny model: f(params, tokens) = its logits, a pure function."""
    _, model = tiny_model(seed, num_layers=1)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return params, lambda params, tokens: nnx.merge(graphdef, params, rest)(tokens)


def tree_norm(tree) -> float:
    return float(jnp.sqrt(sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(tree))))


def assert_trees_equal(a, b) -> None:
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


# The distinctions --------------------------------------------------------------------------

@pytest.mark.slow
def test_stop_gradient_keeps_the_forward_value_and_cuts_the_teacher_path():
    """Distillation of a student θ_s from a teacher θ_t (another model): detaching the teacher's
    logits leaves the loss and the student's gradient unchanged (to float32 rounding: the two
    programs are compiled apart), and zeroes the teacher's gradient, which without the detach is
    not zero."""
    student, logits = logits_function(seed=0)
    teacher, _ = logits_function(seed=1)
    tokens = random_tokens((2, 8))

    def loss(student, teacher, detach):
        teacher_logits = logits(teacher, tokens)
        if detach:
            teacher_logits = jax.lax.stop_gradient(teacher_logits)
        return distillation_kl(logits(student, tokens), teacher_logits, temperature=2.0)

    value_and_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    detached, (student_grad, teacher_grad) = value_and_grads(student, teacher, True)
    attached, (student_grad_attached, teacher_grad_attached) = value_and_grads(student, teacher,
                                                                               False)
    assert float(detached) > 1e-3
    np.testing.assert_allclose(detached, attached, rtol=1e-6)  # the forward value is unchanged
    for leaf in jax.tree.leaves(teacher_grad):
        np.testing.assert_array_equal(leaf, np.zeros_like(leaf))  # the teacher path is cut
    assert tree_norm(teacher_grad_attached) > 1e-3  # ... and it would not be without the detach
    # The student path is the same, to the float32 rounding of another fusion (gradients ~1e-3).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8),
                 student_grad, student_grad_attached)


@pytest.mark.slow
def test_a_detached_branch_sharing_parameters_still_trains_them_through_the_student_path():
    """loss(θ) = CE(f_θ(x)) + w·KL(sg(f_θ(x')) ‖ f_θ(x)): the teacher branch reads the same θ.
    Its gradient is the gradient with the teacher's logits a constant (the student terms only),
    nonzero for θ, and differs from the gradient without the detach."""
    params, logits = logits_function()
    tokens = random_tokens((2, 9))
    inputs, targets, other_inputs = tokens[:, :-1], tokens[:, 1:], random_tokens((2, 8), seed=7)

    def loss(params, detach):
        teacher_logits = logits(params, other_inputs)  # the shared parameters
        if detach:
            teacher_logits = jax.lax.stop_gradient(teacher_logits)
        student_logits = logits(params, inputs)
        return (next_token_loss(student_logits, targets)
                + 0.5 * distillation_kl(student_logits, teacher_logits))

    constant_teacher = logits(params, other_inputs)

    def student_terms(params):
        student_logits = logits(params, inputs)
        return (next_token_loss(student_logits, targets)
                + 0.5 * distillation_kl(student_logits, constant_teacher))

    grads = jax.jit(jax.grad(loss), static_argnums=1)
    grad = grads(params, True)
    assert tree_norm(grad) > 1e-2
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 grad, jax.jit(jax.grad(student_terms))(params))
    difference = jax.tree.map(jnp.subtract, grad, grads(params, False))
    assert tree_norm(difference) > 1e-2  # the teacher branch would send gradient too


@pytest.mark.slow
def test_the_ema_teacher_changes_only_by_its_update_rule():
    """Four distillation steps (two accumulated microbatches each): the EMA equals the rule
    ema ← d·ema + (1 − d)·params applied to the sequence of parameters, exactly; the teacher
    takes no gradient step. The KL starts at 0 (teacher = student) and then grows."""
    decay = 0.5
    program = single_device_program(ema_config(accumulation_steps=2))
    state = program.init(0)
    params_0 = jax.device_get(state["params"])
    assert_trees_equal(state["ema"], params_0)
    expected = params_0
    kls = []
    for step in range(4):
        batch = program.put_batch(np.asarray(random_tokens((8, 17), seed=step)))
        state, metrics = program.train_step(state, batch)
        params = jax.device_get(state["params"])
        expected = jax.tree.map(
            lambda ema, param: np.float32(decay) * ema + np.float32(1 - decay) * param,
            expected, params)
        assert_trees_equal(state["ema"], expected)
        kls.append(float(metrics["distill_kl"]))
    assert abs(kls[0]) < 1e-6 and kls[-1] > 1e-3, kls
    distance = jax.tree.map(lambda a, b: a - b, jax.device_get(state["ema"]), params)
    assert tree_norm(distance) > 1e-2  # the EMA is not the parameters


@pytest.mark.slow
def test_without_ema_the_state_and_numbers_are_unchanged():
    """ema_decay=0 (the default): no "ema" in the state, its shardings or a checkpoint. An EMA
    without distillation is a passenger: the losses and the parameters are equal to float32
    rounding (the two programs are compiled apart, and XLA may fuse or sum a weight gradient in
    another order in each: one ulp in some elements)."""
    runs = {}
    for decay in (0.0, 0.5):
        config = tiny_config()
        config.optimizer.ema_decay = decay
        program = single_device_program(config)
        state = program.init(0)
        losses = []
        for step in range(3):
            batch = program.put_batch(np.asarray(random_tokens((8, 17), seed=step)))
            state, metrics = program.train_step(state, batch)
            losses.append(np.asarray(metrics["loss"]))
            assert "distill_kl" not in metrics
        runs[decay] = (program, state, losses)
    program, state, losses = runs[0.0]
    assert set(state) == set(program.state_shardings) == set(program.abstract_state()) \
        == STATE_KEYS
    assert set(runs[0.5][1]) == STATE_KEYS | {"ema"}
    np.testing.assert_allclose(losses, runs[0.5][2], rtol=1e-5)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7),
                 jax.device_get(state["params"]), jax.device_get(runs[0.5][1]["params"]))


@pytest.mark.slow
def test_a_sharded_step_with_ema_and_distillation_equals_one_device():
    def run(devices, mesh):
        program = single_device_program(ema_config(), devices, mesh)
        state = program.init(0)
        shardings = jax.tree.leaves(program.state_shardings["ema"])
        assert shardings == jax.tree.leaves(program.state_shardings["params"])
        assert [leaf.sharding for leaf in jax.tree.leaves(state["ema"])] == shardings
        losses = []
        for step in range(3):
            batch = program.put_batch(np.asarray(random_tokens((8, 17), seed=step)))
            state, metrics = program.train_step(state, batch)
            losses.append([float(metrics["loss"]), float(metrics["distill_kl"])])
        return np.array(losses), jax.device_get(state["ema"])

    losses, ema = run(1, dict(data=1))
    sharded_losses, sharded_ema = run(8, dict(data=2, fsdp=2, tensor=2))
    np.testing.assert_allclose(sharded_losses, losses, rtol=2e-5, atol=1e-7)
    # Per leaf, relative to its norm: Adam turns the rounding of a near-zero gradient (which
    # the reduction order changes) into a full-size update of that one element.
    for path, sharded, single in zip(jax.tree_util.tree_leaves_with_path(sharded_ema),
                                     jax.tree.leaves(sharded_ema), jax.tree.leaves(ema),
                                     strict=True):
        error = np.linalg.norm(sharded - single) / np.linalg.norm(single)
        assert error < 1e-4, (jax.tree_util.keystr(path[0]), error)


# Config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,message", [
    (dict(optimizer=dict(ema_decay=1.0)),
     "optimizer.ema_decay=1.0 is invalid: must be in [0, 1) (0: no EMA of the parameters; "
     "e.g. 0.999)"),
    (dict(optimizer=dict(ema_decay=-0.1)),
     "optimizer.ema_decay=-0.1 is invalid: must be in [0, 1) (0: no EMA of the parameters; "
     "e.g. 0.999)"),
    (dict(objective=dict(ema_distill_weight=0.5)),
     "objective.ema_distill_weight=0.5 is invalid: distillation needs an EMA teacher, but "
     "optimizer.ema_decay=0.0; set optimizer.ema_decay in (0, 1), e.g. 0.999"),
    (dict(objective=dict(ema_distill_weight=-1.0)),
     "objective.ema_distill_weight=-1.0 is invalid: must be a finite number ≥ 0 (0: off)"),
    (dict(optimizer=dict(ema_decay=0.9), objective=dict(ema_distill_temperature=0.0)),
     "objective.ema_distill_temperature=0.0 is invalid: must be a finite number > 0"),
], ids=["decay-1", "decay-negative", "distill-without-ema", "weight-negative", "temperature"])
def test_bad_ema_fields_are_one_line(fields, message):
    config = tiny_config()
    config.update(fields)
    with pytest.raises(ConfigError) as error:
        check_fields(config)
    assert str(error.value) == message


# Through a run -------------------------------------------------------------------------------

def run_config(**fields):
    """4 steps on the 8 simulated devices, a checkpoint every step, evaluation every 2."""
    return ema_config(steps=4, checkpoint_every=1, eval_every=2, mesh=dict(data=-1), **fields)


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory) -> tuple[Path, dict]:
    workdir = tmp_path_factory.mktemp("ema") / "run"
    return workdir, train(resolve_for_job(run_config()), workdir)


def final_state(workdir: Path):
    program = build_program(resolve_for_job(run_config()))
    with Checkpointer(workdir) as checkpointer:
        step, state, _ = checkpointer.restore_latest(program.abstract_state())
    return program, step, jax.device_get(state)


def records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").open()]


@pytest.mark.slow
def test_a_resumed_run_with_ema_is_bit_identical(ema_run, tmp_path, monkeypatch):
    workdir, _ = ema_run
    original_batch = in_memory.Dataset.batch

    def batch_then_sigterm(self, step, *args, **kwargs):
        if self.split == "train" and step == 2:  # preempted while the third step runs
            os.kill(os.getpid(), signal.SIGTERM)
        return original_batch(self, step, *args, **kwargs)

    monkeypatch.setattr(in_memory.Dataset, "batch", batch_then_sigterm)
    assert train(resolve_for_job(run_config()), tmp_path)["preempted"]
    monkeypatch.setattr(in_memory.Dataset, "batch", original_batch)
    assert train(resolve_for_job(run_config()), tmp_path)["step"] == 4
    _, step, resumed = final_state(tmp_path)
    _, uninterrupted_step, uninterrupted = final_state(workdir)
    assert step == uninterrupted_step == 4 and set(resumed) == STATE_KEYS | {"ema"}
    assert_trees_equal(resumed, uninterrupted)
    untimed = [[{k: v for k, v in record.items() if k not in ("tokens_per_sec", "mfu")}
                for record in records(run)] for run in (workdir, tmp_path)]
    assert untimed[0] == untimed[1]  # every logged number but the timings, bit for bit


def test_the_ema_is_evaluated_and_logged(ema_run):
    workdir, result = ema_run
    logged = records(workdir)
    assert all("distill_kl" in record for record in logged)
    evaluated = [record for record in logged if "eval_loss" in record]
    assert [record["step"] for record in evaluated] == [2, 4]
    assert all("eval_loss_ema" in record for record in evaluated)
    program, _, state = restore_run(workdir)
    _, validation = load_splits(program.config.data)
    np.testing.assert_allclose(result["eval_loss_ema"],
                               evaluate(program, state, validation, ema=True), rtol=1e-6)
    assert result["eval_loss_ema"] == evaluated[-1]["eval_loss_ema"] != result["eval_loss"]
    _, _, model, _ = restore_for_analysis(workdir, batch=8, ema=True)
    assert_trees_equal(nnx.state(model, nnx.Param), state["ema"])


def test_generate_samples_from_the_ema(ema_run, capsys):
    workdir, _ = ema_run
    arguments = ["--workdir", str(workdir), "--prompt", "In", "--num_tokens", "6",
                 "--temperature", "0"]
    assert generate_main([*arguments, "--ema"]) == 0
    printed = capsys.readouterr().out.splitlines()
    program, step, state = restore_run(workdir)
    assert printed == [f"[step {step}, EMA parameters]",
                       generate_text(program, with_ema_params(state), "In", 6, temperature=0)]


def test_generate_ema_of_a_run_without_ema_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(tiny_config().to_json_best_effort())
    with pytest.raises(ConfigError) as error:
        check_arguments(str(tmp_path), "In", 4, 0.8, 40, allow_extrapolation=False, ema=True)
    assert str(error.value) == (
        f"--ema is invalid: the run in --workdir={tmp_path} keeps no EMA of its parameters "
        "(optimizer.ema_decay=0.0); train one with --config.optimizer.ema_decay=0.999, say")
    with pytest.raises(ConfigError, match="^--ema is invalid: the run keeps no EMA"):
        with_ema_params({"params": {}})


@pytest.mark.parametrize("source_ema", [True, False], ids=["from-ema-run", "into-ema-run"])
def test_finetune_across_ema_settings_starts_the_ema_at_the_source_weights(
        ema_run, tmp_path, source_ema):
    """A fine-tune reads its source's checkpoint whether or not the source kept an EMA; with an
    EMA of its own, it starts at the weights it starts from."""
    if source_ema:
        source = ema_run[0]
        config = run_config(resume_mode="finetune", finetune_from=str(source))
        config.optimizer.ema_decay, config.objective.ema_distill_weight = 0.0, 0.0
    else:
        source = tmp_path / "source"
        source.mkdir()
        plain = run_config()
        plain.optimizer.ema_decay, plain.objective.ema_distill_weight = 0.0, 0.0
        write_run(plain, source, step=3)
        config = run_config(resume_mode="finetune", finetune_from=str(source))
    program = build_program(resolve_for_job(config))
    with Checkpointer(source, read_only=True) as checkpointer:
        source_abstract = program.abstract_state(ema=source_ema)
        _, source_state, _ = checkpointer.restore_latest(source_abstract)
    with Checkpointer(tmp_path / "new") as checkpointer:
        step, state, _ = _start_state(program, config, checkpointer, tmp_path / "new")
    assert step == 0 and set(state) == set(program.state_shardings)
    assert_trees_equal(state["params"], source_state["params"])
    if program.uses_ema:
        assert_trees_equal(state["ema"], source_state["params"])
