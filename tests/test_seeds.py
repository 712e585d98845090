"""Study mode (`train.seeds`): seeds trained at once, vmapped, equal separate runs."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from config import resolve
from sharding.mesh import make_mesh
from tests.helpers import one_device_env, tiny_config
from train import rundir
from train.checkpoint import Checkpointer
from train.loop import train
from train.seeds import train_seeds
from train.step import TrainProgram, build_program, resolve_for_job
from train.studies import study as studies

REPO = Path(__file__).resolve().parents[1]


def records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").open()]


@pytest.mark.slow
def test_vmapped_seeds_equal_separate_runs(tmp_path):
    config = tiny_config()
    config.update(steps=6, eval_every=3, eval_batches=2, mesh=dict(data=-1))
    config.optimizer.ema_decay = 0.9  # the EMA rides along in the vmapped state
    losses = train_seeds(resolve(config, 1), tmp_path / "vmapped", [0, 3])
    for seed in (0, 3):
        separate = config.copy_and_resolve_references()
        separate.seed = seed
        result = train(resolve_for_job(separate), tmp_path / f"separate{seed}")
        together, alone = (records(d) for d in (tmp_path / "vmapped" / f"seed{seed}",
                                                 tmp_path / f"separate{seed}"))
        assert [r["step"] for r in together] == [r["step"] for r in alone] == list(range(1, 7))
        for key in ("train_loss", "grad_norm", "learning_rate"):
            np.testing.assert_allclose([r[key] for r in together], [r[key] for r in alone],
                                       rtol=2e-5, err_msg=key)
        np.testing.assert_allclose([r["eval_loss"] for r in together if "eval_loss" in r],
                                   [r["eval_loss"] for r in alone if "eval_loss" in r], rtol=2e-5)
        assert losses[seed] == pytest.approx(result["eval_loss"], rel=2e-5)
        assert studies.run_state(tmp_path / "vmapped" / f"seed{seed}") == ("finished",
                                                                           losses[seed])
        # Its final checkpoint restores as an ordinary run's, with the separate run's weights.
        program = build_program(resolve_for_job(separate))
        with Checkpointer(tmp_path / "vmapped" / f"seed{seed}", read_only=True) as saved, \
                Checkpointer(tmp_path / f"separate{seed}", read_only=True) as reference:
            (step, state, data), (_, expected, _) = (
                c.restore_latest(program.abstract_state()) for c in (saved, reference))
        assert (step, data["seed"]) == (6, seed)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                     state["params"], expected["params"])
    assert json.loads((tmp_path / "vmapped" / "seed3" / "config.json").read_text())["seed"] == 3


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0,x"], "--seeds=0,x is invalid: comma-separated integers, e.g. 0,1,2,3"),
    (["--seeds", "1,1"], "--seeds=1,1 is invalid: seeds must be distinct non-negative ints"),
    (["--seeds", "0,3000000000"], "--seeds=0,3000000000 is invalid: each seed must be at most "
     "2147483647 (the initialization's key is an int32)"),
    (["--seeds", "0,1", "--config.model.dropout.residual=0.1"],
     "model.dropout is invalid in train.seeds: dropout keys come from the config's one seed; "
     "train these seeds separately (python -m train)"),
])
@pytest.mark.slow
def test_bad_seed_mode_arguments_are_one_line(tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "train.seeds", "--config",
                           "experiments/quickstart.py", "--workdir", str(tmp_path), *args],
                          cwd=REPO, env=one_device_env(), capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stderr) == (2, f"error: {message}\n")
    assert not any(tmp_path.iterdir())  # nothing written (no seed3000000000/config.json)


SMALL = ["--config", "experiments/quickstart.py", *[
    f"--config.{field}={value}" for field, value in dict(
        steps=10, batch_size=8, seq_len=16, log_every=1, eval_every=1000, eval_batches=1,
        sample_tokens=0, **{"model.d_model": 32, "model.num_layers": 2,
                            "model.attention.num_heads": 4, "model.attention.num_kv_heads": 2,
                            "optimizer.warmup_steps": 2}).items()]]


def seeds_command(workdir: Path, seeds: str, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "train.seeds", *SMALL, *overrides, "--workdir", str(workdir),
            "--seeds", seeds]


def tree_hashes(root: Path) -> dict[str, str]:
    """Every file's and directory's relative path → its bytes' sha256 ("dir" for a directory)."""
    return {str(path.relative_to(root)): "dir" if path.is_dir() else
            hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(root.rglob("*"))}


def ordinary_run(directory: Path, steps: int = 20, **fields) -> None:
    """What `python -m train --config.seed=0 --config.steps=STEPS` leaves (JAX-free): its
    config.json, a metrics record per step and a checkpoint directory at its last step."""
    from train.seeds import parse, seed_config

    config, _, _ = parse(["train.seeds", *SMALL, "--workdir", "x", "--seeds", "0"])
    config.steps = steps
    for field, value in fields.items():
        config.model[field] = value
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(
        seed_config(resolve(config, 1), 0).to_json_best_effort(indent=2) + "\n")
    (directory / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "train_loss": 5.0 - s / 10}) + "\n"
                for s in range(1, steps + 1)))
    (directory / "checkpoints" / str(steps)).mkdir(parents=True)
    (directory / "checkpoints" / str(steps) / "_CHECKPOINT_METADATA").write_text("{}")


@pytest.mark.parametrize("case", ["run-past-steps", "other-config", "stray-files", "a-file",
                                  "locked", "different-steps"])
@pytest.mark.slow
def test_a_seed_directory_holding_anything_else_is_refused_and_left_byte_identical(
        tmp_path, case):
    """issue 61: given a workdir whose seed0/ held an ordinary run, train.seeds rewrote its
    metrics.jsonl and config.json. Now each seed directory's identity is checked before
    anything is written (not even a lock): one line, exit 2, every byte as it was."""
    from train.rundir import WorkdirLock

    root = tmp_path / "root"
    seed0 = root / "seed0"
    lock = None
    if case == "run-past-steps":  # the case: an ordinary run of 20 steps, seeds of 10
        ordinary_run(seed0)
        message = (f"{seed0} holds a checkpoint at step 20, past steps=10: raise steps to at "
                   "least 20 to resume it")
    elif case == "other-config":
        ordinary_run(seed0, steps=5, d_model=64)
        message = f"{seed0} holds another run (model.d_model: 64 → 32; "
    elif case == "stray-files":
        seed0.mkdir(parents=True)
        (seed0 / "notes.txt").write_text("my own notes\n")
        message = f"{seed0} holds files but no config.json: it is not a run of seed 0"
    elif case == "a-file":
        root.mkdir()
        (root / "seed1").write_text("not a directory\n")
        message = f"{root / 'seed1'} is a file, not a seed's run directory"
    elif case == "locked":  # a live trainer (this test) holds seed0
        lock = WorkdirLock(seed0).acquire()
        message = f"--workdir={seed0} is in use by pid"
    else:  # a group whose seeds were saved at different steps
        ordinary_run(seed0, steps=5)
        message = "its seed directories hold checkpoints of different steps (seed0: 5, seed1: "
    before = tree_hashes(root)
    try:
        done = subprocess.run(seeds_command(root, "0,1"), cwd=REPO, env=one_device_env(),
                              capture_output=True, text=True, timeout=120)
    finally:
        if lock is not None:
            lock.release()
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: "), done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
    if lock is not None:  # the test's own lock, released (emptied) since
        before["seed0/lock"] = hashlib.sha256(b"").hexdigest()
    assert tree_hashes(root) == before


@pytest.mark.slow
def test_ctrl_c_saves_every_seed_and_the_rerun_resumes_as_if_uninterrupted(tmp_path):
    """SIGINT: every seed's current step saved, one line, exit 130; the same command resumes
    the group, each step logged once, its losses and final parameters bit-equal to an
    uninterrupted group's."""
    from train.seeds import parse

    steps = ["--config.steps=300", "--config.checkpoint_every=1000"]
    root = tmp_path / "interrupted"
    interrupted = subprocess.Popen(seeds_command(root, "0,1", *steps), cwd=REPO,
                                   env=one_device_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    metrics = root / "seed1" / "metrics.jsonl"
    while not metrics.exists() or metrics.read_text().count("\n") < 3:
        assert interrupted.poll() is None and time.monotonic() < deadline, \
            interrupted.communicate()[1][-3000:]
        time.sleep(0.02)
    interrupted.send_signal(signal.SIGINT)
    _, stderr = interrupted.communicate(timeout=120)
    last = stderr.replace("\r", "\n").splitlines()[-1]  # after the progress bar's updates
    assert interrupted.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    match = re.fullmatch(rf"SIGINT: the checkpoint of step (\d+) is saved in each of "
                         rf"{root}/seed<k>; rerun the same command to resume", last)
    assert match and stderr.count("SIGINT") == 1, stderr[-3000:]
    saved = int(match[1])
    assert 3 <= saved < 300
    for seed in (0, 1):
        assert rundir.checkpoint_steps(root / f"seed{seed}") == [saved]

    done = subprocess.run(seeds_command(root, "0,1", *steps), cwd=REPO, env=one_device_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    config, _, _ = parse(["train.seeds", *SMALL, *steps, "--workdir", "x", "--seeds", "0,1"])
    train_seeds(resolve(config, 1), tmp_path / "uninterrupted", [0, 1])
    program = TrainProgram(resolve(config, 1), make_mesh(resolve(config, 1), jax.devices()[:1]))
    for seed in (0, 1):
        resumed, reference = (tmp_path / name / f"seed{seed}"
                              for name in ("interrupted", "uninterrupted"))
        assert [r["step"] for r in records(resumed)] == list(range(1, 301))  # each step once
        assert [r["train_loss"] for r in records(resumed)] == \
            [r["train_loss"] for r in records(reference)]
        with Checkpointer(resumed, read_only=True) as a, \
                Checkpointer(reference, read_only=True) as b:
            (_, state, _), (_, expected, _) = (c.restore_latest(program.abstract_state())
                                               for c in (a, b))
        jax.tree.map(np.testing.assert_array_equal, state["params"], expected["params"])


def test_a_seed_directory_holding_only_a_sweeps_provenance_is_a_new_run(tmp_path):
    """scripts/sweep.py --vmap_seeds appends each seed's provenance.jsonl before it launches
    train.seeds: such a directory is a new run, not another's."""
    from train.seeds import check_seed_directories, parse

    config, _, _ = parse(["train.seeds", *SMALL, "--workdir", "x", "--seeds", "0,1"])
    (tmp_path / "seed0").mkdir()
    (tmp_path / "seed0" / "provenance.jsonl").write_text('{"command": []}\n')
    before = tree_hashes(tmp_path)
    assert check_seed_directories(resolve(config, 1), tmp_path, [0, 1]) == 0
    assert tree_hashes(tmp_path) == before
