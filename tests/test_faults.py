"""The fault suite of the run directory (docs/runs.md): each case asserts that nothing is lost.

The workdir lock, a config that differs from the run's, a corrupt newest checkpoint, a
non-finite state, metrics on resume, and every bad input answered by one line and exit status 2
before JAX is imported. In-process cases share one trained tiny run (copied per test)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from config import ConfigError
from tests.helpers import one_device_env, tiny_config
from train import rundir
from train.checkpoint import Checkpointer
from train.data import in_memory
from train.generate import check_arguments
from train.loop import NonFiniteLoss, _start_state, build_program, train
from train.step import resolve_for_job

REPO = Path(__file__).resolve().parents[1]
HEAVY_MODULES = ("jax", "orbax", "tensorboardX", "tensorflow_datasets", "grain", "flax")


def run_config(**fields):
    """The tiny config of the shared run: 4 steps over the 8 simulated devices, a checkpoint
    every step (the newest 3 kept), every step logged."""
    config = tiny_config()
    config.update(dict(steps=4, checkpoint_every=1, mesh=dict(data=-1)))
    config.update(fields)
    return config


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("run") / "run"
    assert train(resolve_for_job(run_config()), workdir)["step"] == 4
    return workdir


def copy_run(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    (target / rundir.LOCK_FILE).write_text("")  # copied as the fixture left it: released
    return target


def snapshot(workdir: Path) -> dict[str, str]:
    """Digest of every file of the run's checkpoints and config.json."""
    files = [workdir / "config.json", *(workdir / "checkpoints").rglob("*")]
    return {str(f.relative_to(workdir)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in files if f.is_file()}


def metric_steps(workdir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").open()]


def restored_params(config, workdir: Path):
    program = build_program(resolve_for_job(config))
    with Checkpointer(workdir) as checkpointer:
        step, state, _ = checkpointer.restore_latest(program.abstract_state())
    return step, jax.device_get(state["params"])


def cli(*args: str, module: str = "train") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=one_device_env(),
                          capture_output=True, text=True, timeout=300)


def assert_one_line(run: subprocess.CompletedProcess, message: str) -> None:
    assert run.returncode == 2, run.stderr[-2000:]
    assert message in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr


# 1. A different config never touches an existing run ---------------------------------------

@pytest.mark.slow
def test_a_different_config_is_refused_and_the_run_is_kept(trained_run, tmp_path):
    workdir = copy_run(trained_run, tmp_path / "run")
    before = snapshot(workdir)
    changed = run_config()
    changed.model.d_model = 64
    with pytest.raises(ConfigError) as error:
        train(resolve_for_job(changed), workdir)
    message = str(error.value)
    assert "holds a run with a different config (model.d_model: 32 → 64" in message
    assert "--config.resume_mode=finetune" in message and "\n" not in message
    assert snapshot(workdir) == before  # no checkpoint deleted, config.json not overwritten

    # The CLI refuses before JAX loads (quickstart's model differs from the tiny run's).
    run = cli("--config", "experiments/quickstart.py", "--workdir", str(workdir))
    assert_one_line(run, "holds a run with a different config (")
    assert "model.d_model: 32 → 192" in run.stderr
    assert snapshot(workdir) == before


def test_finetune_starts_a_new_run_from_the_weights(trained_run, tmp_path):
    config = run_config(resume_mode="finetune", finetune_from=str(trained_run), seed=3)
    config.optimizer.learning_rate = 1e-4
    program = build_program(resolve_for_job(config))
    with Checkpointer(tmp_path / "new") as checkpointer:
        step, state, position = _start_state(program, config, checkpointer, tmp_path / "new")
    assert step == 0 and position["next_step"] == 0 and int(state["step"]) == 0
    source_step, source_params = restored_params(run_config(), trained_run)
    assert source_step == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["params"]), source_params)
    with pytest.raises(ConfigError, match="is also finetune_from: a fine-tune starts a new run"):
        train(resolve_for_job(run_config(resume_mode="finetune",
                                         finetune_from=str(trained_run))), trained_run)


# 2 and 9. A corrupt newest checkpoint is moved aside; the run completes, logging each step once

@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's loop
@pytest.mark.slow
def test_a_truncated_newest_checkpoint_is_moved_aside_and_the_run_completes(
        trained_run, tmp_path, caplog):
    workdir = copy_run(trained_run, tmp_path / "run")
    # Every array-data file cut in half (which file holds which array depends on the timing of
    # orbax's writers, so cutting one alone may leave every array readable).
    step_dir = workdir / "checkpoints" / "4"
    data_files = [p for p in (step_dir / "state").rglob("d/*") if p.is_file()]
    for path in data_files:
        os.truncate(path, path.stat().st_size // 2)
    truncated = {path.relative_to(step_dir): path.read_bytes() for path in data_files}

    with caplog.at_level(logging.WARNING):
        assert train(resolve_for_job(run_config()), workdir)["step"] == 4
    moved = list((workdir / "checkpoints").glob("corrupt-4-*"))
    assert len(moved) == 1  # kept, never deleted
    assert {name: (moved[0] / name).read_bytes() for name in truncated} == truncated
    assert f"moved the checkpoint at step 4, which does not restore, to {moved[0]}" in caplog.text
    # Step 4 was retrained from step 3 and saved again: the same parameters as the first time.
    step, params = restored_params(run_config(), workdir)
    _, original = restored_params(run_config(), trained_run)
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, params, original)
    assert metric_steps(workdir) == [1, 2, 3, 4]


def run_without_array_data(trained_run: Path, workdir: Path) -> Path:
    """A copy of the trained run at `workdir` whose checkpoints (steps 2-4) lost their array
    data: none of them restores."""
    copy_run(trained_run, workdir)
    for step in (2, 3, 4):
        for item in (workdir / "checkpoints" / str(step) / "state").iterdir():
            if item.is_dir():  # the array data
                shutil.rmtree(item)
    return workdir


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's loop
def test_when_no_checkpoint_restores_nothing_is_moved(trained_run, tmp_path):
    workdir = run_without_array_data(trained_run, tmp_path / "run")
    before = snapshot(workdir)
    with pytest.raises(rundir.WorkdirError, match=r"no checkpoint restores \(step 4: .*\); "
                       "nothing was moved or deleted"):
        train(resolve_for_job(run_config()), workdir)
    assert snapshot(workdir) == before



@pytest.mark.slow
def test_generation_from_a_run_whose_checkpoints_all_fail_is_one_line(trained_run, tmp_path):
    """issue 61: train.generate printed the right line, then ~380 lines of Orbax's "Exception
    ignored in coroutine" at exit. Now the line alone, naming the newest checkpoint's error, and
    the run left as it was."""
    workdir = run_without_array_data(trained_run, tmp_path / "run")
    before = snapshot(workdir)
    done = subprocess.run([sys.executable, "-m", "train.generate", "--workdir", str(workdir),
                           "--num_tokens", "4"], cwd=REPO, env=one_device_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: --workdir={workdir} holds no restorable checkpoint "
                                  "(step 4: "), done.stderr
    assert snapshot(workdir) == before


def read_events(path: Path):
    """The Event protos of a TensorBoard event file (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    data, offset = path.read_bytes(), 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[offset + 12:offset + 12 + length])
        offset += 12 + length + 4
        yield event


@pytest.mark.slow
def test_a_resumed_run_logs_each_step_once(trained_run, tmp_path):
    workdir = copy_run(trained_run, tmp_path / "run")
    shutil.rmtree(workdir / "checkpoints" / "4")  # killed after logging step 4, before saving it
    event_files = set((workdir / "tensorboard").iterdir())
    # steps may change on resume
    assert train(resolve_for_job(run_config(steps=5)), workdir)["step"] == 5
    assert metric_steps(workdir) == [1, 2, 3, 4, 5]
    (new_file,) = set((workdir / "tensorboard").iterdir()) - event_files
    events = list(read_events(new_file))
    purge = [e.step for e in events if e.HasField("session_log")]
    assert purge == [4]  # TensorBoard drops the older files' events at steps ≥ 4
    assert sorted({e.step for e in events if e.HasField("summary")}) == [4, 5]


@pytest.mark.slow
def test_tensorboard_is_written_without_importing_torch_which_imports_later(tmp_path):
    """tensorboardX imports PyTorch where it is installed (about 2 s of every run's start) only
    to accept its tensors; the writer loads without it, and torch still imports afterwards."""
    code = ("import sys; from train.metrics import MetricsWriter\n"
            "with MetricsWriter(sys.argv[1]) as writer:\n"
            "    writer.write(3, {'train_loss': 2.5})\n"
            "print('torch' in sys.modules, end=' '); import torch; print(torch.__name__)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                          env=one_device_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "False torch\n", done.stderr[-3000:]
    (events,) = (tmp_path / "tensorboard").iterdir()
    [value] = [(e.step, v.tag, v.simple_value) for e in read_events(events)
               for v in e.summary.value]
    assert value == (3, "train_loss", 2.5)


# 3. keep_checkpoints ≥ 1, and 6-8: one line and exit 2 for every bad input, before JAX --------

@pytest.mark.parametrize("args,message", [
    (["--config.keep_checkpoints=0"], "keep_checkpoints=0 is invalid: must be a positive integer"),
    (["--config.top_k=300"], "top_k=300 is invalid: must be in [0, model.vocab_size=256]"),
    (["--config.data.name=text", "--config.data.path=README.md",
      "--config.data.validation_fraction=0"], "data.validation_fraction=0.0 is invalid"),
    (["--config.data.name=text", "--config.data.path={empty}"],
     "data.path='{empty}' is invalid: holds 0 bytes of text"),
    (["--config.optimizer.learning_rate=-0.001"], "optimizer.learning_rate=-0.001 is invalid"),
    (["--config.optimizer.learning_rate=nan"], "optimizer.learning_rate=nan is invalid"),
    (["--config.model.vocab_size=100"],
     "model.vocab_size=100 is invalid: data.tokenizer='byte' has 256 tokens"),
    (["--config.steps=30"], "optimizer.warmup_steps=30 is invalid: must be in [0, steps=30)"),
    (["--config.temperature=-1"], "temperature=-1.0 is invalid: must be a finite number ≥ 0"),
    (["--config.model.position.name=learned"],
     "sample_tokens=200 is invalid: the prompt (12 tokens)"),
    (["--config.model.no_such=1"], "--config.model.no_such: model has no field 'no_such'"),
    (["--config.steps=abc"], "flag --config.steps=abc: invalid literal for int()"),
], ids=["keep-0", "top-k", "validation-0", "empty-text", "lr-negative", "lr-nan", "vocab",
        "steps-eq-warmup", "temperature", "learned-context", "unknown-field", "type"])
def test_bad_field_is_one_line_before_jax(tmp_path, args, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    run = cli("--config", "experiments/quickstart.py", "--workdir", str(tmp_path / "w"),
              *(arg.replace("{empty}", str(empty)) for arg in args))
    assert_one_line(run, message.replace("{empty}", str(empty)))
    assert not (tmp_path / "w").exists()  # nothing created, let alone a checkpoint


def test_broken_config_files_and_workdirs_are_one_line(tmp_path):
    (tmp_path / "syntax.py").write_text("def get_config(:\n")
    (tmp_path / "no_get_config.py").write_text("CONFIG = 1\n")
    (tmp_path / "a_file").write_text("")
    cases = [
        (["--config", str(tmp_path / "syntax.py")], "has a syntax error at line 1"),
        (["--config", str(tmp_path / "no_get_config.py")], "defines no get_config(arg=None)"),
        (["--config", "experiments/quickstart.py", "--workdir", str(tmp_path / "a_file")],
         f"--workdir={tmp_path / 'a_file'} is a file, not a directory"),
    ]
    for args, message in cases:
        run = cli(*args, *(["--workdir", str(tmp_path / "w")] if "--workdir" not in args
                           else []))
        assert_one_line(run, message)


def test_a_read_only_workdir_is_one_line(tmp_path, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path
                        and real_access(path, mode))
    with pytest.raises(rundir.WorkdirError, match=f"--workdir={tmp_path / 'w'} is not writable "
                       f"\\({tmp_path} is where it would be created\\)"):
        rundir.check_workdir(tmp_path / "w")


@pytest.mark.parametrize("overrides,message", [
    (["--config.optimizer.learning_rate=-1"], "optimizer.learning_rate=-1.0 is invalid"),
    (["--config.model.attention.num_heads=5"], "model.attention.num_kv_heads=2 is invalid: must "
     "divide model.attention.num_heads=5"),
    (["--config.model.residual.name=attnres", "--config.model.attnres.heads=5"],
     "model.attnres.heads=5 is invalid: must divide model.d_model=192"),
    (["--config.model.reversible=True", "--config.model.residual.name=postnorm"],
     "model.reversible=True is invalid: reversible blocks need model.residual.name='prenorm'"),
    (["--config.execution.remat=some"], "execution.remat='some' is invalid"),
], ids=["optimizer", "heads", "mechanism", "reversible", "execution"])
def test_the_cli_reaches_a_config_error_without_importing_jax(tmp_path, overrides, message):
    script = (
        "import sys\n"
        "import config.validate, train.rundir, train.__main__ as cli\n"
        f"code = cli.main(['train', '--config', 'experiments/quickstart.py', '--workdir', "
        f"{str(tmp_path)!r}, *{overrides!r}])\n"
        f"print(code, sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=one_device_env(),
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["2", "[]"], run.stdout + run.stderr
    assert run.stderr.startswith(f"error: {message}") and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize("arguments,message", [
    (dict(num_tokens=-1), "--num_tokens=-1 is invalid: must be a non-negative integer"),
    (dict(temperature=-0.5), "--temperature=-0.5 is invalid: must be a finite number ≥ 0"),
    (dict(top_k=257), "--top_k=257 is invalid: must be in [0, model.vocab_size=256]"),
    (dict(top_k=-1), "--top_k=-1 is invalid"),
    (dict(num_tokens=20), "exceeds the trained context model.max_seq_len=16; generate fewer "
                          "tokens or pass --allow_extrapolation"),
    (dict(num_tokens=20, allow_extrapolation=True, position="learned"),
     "exceeds model.max_seq_len=16, the length of the learned position table"),
], ids=["negative-tokens", "temperature", "top-k-high", "top-k-negative", "context", "learned"])
def test_generation_arguments_are_checked_before_loading(tmp_path, arguments, message):
    config = run_config()
    config.model.max_seq_len = 16
    config.model.position.name = arguments.pop("position", "rope")
    (tmp_path / "config.json").write_text(config.to_json_best_effort())
    values = dict(num_tokens=4, temperature=0.8, top_k=40, allow_extrapolation=False)
    values.update(arguments)
    with pytest.raises(ConfigError) as error:
        check_arguments(str(tmp_path), "In", **values)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_rope_generates_past_the_context_when_asked(tmp_path):
    config = run_config()
    config.model.max_seq_len = 16
    (tmp_path / "config.json").write_text(config.to_json_best_effort())
    check_arguments(str(tmp_path), "In", 20, 0.8, 40, allow_extrapolation=True)


def test_generation_cli_exits_2_with_one_line(tmp_path):
    (tmp_path / "config.json").write_text(run_config().to_json_best_effort())
    run = cli("--workdir", str(tmp_path), "--num_tokens", "-3", module="train.generate")
    assert_one_line(run, "error: --num_tokens=-3 is invalid")


# 4. A non-finite state is never saved -------------------------------------------------------

def test_a_step_that_makes_the_state_non_finite_is_not_saved(tmp_path):
    # A learning rate that overflows float32: the step-1 loss and gradients are finite, the
    # updated parameters are not.
    config = run_config(steps=3)
    config.optimizer.update(learning_rate=1e39, warmup_steps=0)
    with pytest.raises(NonFiniteLoss) as error:
        train(resolve_for_job(config), tmp_path)
    message = str(error.value)
    assert message.startswith("non-finite state at step 1 (loss=")
    assert "the last finite checkpoint (none) is kept in" in message
    assert rundir.checkpoint_steps(tmp_path) == []


@pytest.mark.slow
def test_skip_policy_keeps_the_previous_state_and_counts_skipped_steps(tmp_path):
    config = run_config(steps=2, nonfinite_policy="skip")
    config.optimizer.update(learning_rate=1e39, warmup_steps=0)
    assert train(resolve_for_job(config), tmp_path)["step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [(r["step"], r["skipped_steps"]) for r in records] == [(1, 1), (2, 2)]
    step, params = restored_params(config, tmp_path)
    initial = jax.device_get(build_program(resolve_for_job(config)).init(config.seed)["params"])
    assert step == 2
    jax.tree.map(np.testing.assert_array_equal, params, initial)


# 5. One trainer per workdir -----------------------------------------------------------------

def test_a_second_trainer_is_refused_and_a_stale_lock_is_taken_over(tmp_path, caplog):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom train.rundir import WorkdirLock\n"
         "WorkdirLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(300)\n",
         str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        names = f"in use by pid {holder.pid} on host {socket.gethostname()}"
        with pytest.raises(rundir.WorkdirError, match=re.escape(names)):
            train(resolve_for_job(run_config()), tmp_path)
        run = cli("--config", "experiments/quickstart.py", "--workdir", str(tmp_path))
        assert_one_line(run, names)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The holder died without releasing: its lock file still names it, and is taken over.
    assert json.loads((tmp_path / "lock").read_text())["pid"] == holder.pid
    with caplog.at_level(logging.WARNING), rundir.WorkdirLock(tmp_path):
        assert json.loads((tmp_path / "lock").read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock of pid {holder.pid}" in caplog.text
    assert (tmp_path / "lock").read_text() == ""  # released

    # A lock naming another host cannot be checked from here: it is respected.
    (tmp_path / "lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(rundir.WorkdirError, match="in use by pid 1 on host elsewhere"):
        rundir.check_not_locked(tmp_path)


# A data error mid-run saves the last good state first ---------------------------------------

@pytest.mark.slow
def test_a_data_error_mid_run_saves_the_last_good_state_first(trained_run, tmp_path,
                                                              monkeypatch):
    original_batch = in_memory.Dataset.batch

    def batch_then_fail(self, step, *args, **kwargs):
        if self.split == "train" and step == 2:  # the batch of the third step cannot be read
            raise ValueError("document 7 of shard 3 is damaged")
        return original_batch(self, step, *args, **kwargs)

    monkeypatch.setattr(in_memory.Dataset, "batch", batch_then_fail)
    with pytest.raises(ValueError, match="document 7 of shard 3 is damaged"):
        train(resolve_for_job(run_config(checkpoint_every=1000)), tmp_path)
    assert rundir.checkpoint_steps(tmp_path) == [2]  # the state after the last good step
    monkeypatch.setattr(in_memory.Dataset, "batch", original_batch)
    assert train(resolve_for_job(run_config()), tmp_path)["step"] == 4
    assert metric_steps(tmp_path) == [1, 2, 3, 4]
    assert [json.loads(line)["train_loss"] for line in (tmp_path / "metrics.jsonl").open()] == \
        [json.loads(line)["train_loss"] for line in (trained_run / "metrics.jsonl").open()]
