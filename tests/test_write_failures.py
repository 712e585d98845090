"""Write failures and interrupts (docs/runs.md): a checkpoint that cannot be written stops the run
at that save with one line and exit status 3, the newest complete checkpoint is kept and a rerun
resumes from it as if nothing happened; the same for metrics.jsonl; too little space, or a file
where `checkpoints` goes, is refused before the first step; Ctrl-C saves the current step. The
other command lines that write a run or a report say a failed write in one line, exit 3.

Faults are injected into Orbax's own file operations at each stage of a save (making the step's
directory, writing its files, the rename that commits it), by replacing `checkpoints` with a
file mid-run, and by filling a small tmpfs (where mounting one is allowed), in a `python -m
train` subprocess (`DRIVER`). The subprocess timeouts only guard against a hang (the old
behaviour waited 300 s at close)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import one_device_env, tiny_config
from train import rundir
from train.loop import train
from train.step import resolve_for_job

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 40, 4
FAILED_SAVE = 8  # the save the injected faults break; the save of step 4 completes

# `python -c DRIVER FAULT DELAY ARGS...`: `python -m train ARGS...` with FAULT injected into the
# save of step FAILED_SAVE (mkdir, write, commit), metrics.jsonl's fifth record (metrics), or
# before step FAILED_SAVE (file: `checkpoints` replaced by a file; fill: the filesystem filled),
# sleeping DELAY s per train batch (none: no fault).
DRIVER = f"""
import errno, os, pathlib, sys, threading, time
from orbax.checkpoint._src.handlers import json_checkpoint_handler
from orbax.checkpoint._src.path import async_path
from train.data import in_memory
fault, delay, argv = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
marker = os.sep + "{FAILED_SAVE}.orbax-checkpoint-tmp"
failed = threading.Event()

def failing(original, code, path_argument):
    async def call(*args, **kwargs):
        if marker in str(args[path_argument]):
            failed.set()
            raise OSError(code, os.strerror(code), str(args[path_argument]))
        return await original(*args, **kwargs)
    return call

if fault == "mkdir":  # making the step's directory
    async_path.mkdir = failing(async_path.mkdir, errno.ENOSPC, 0)
elif fault == "write":  # writing its files (in the background)
    handler = json_checkpoint_handler.JsonCheckpointHandler
    handler._save_fn = failing(handler._save_fn, errno.ENOSPC, 2)  # (self, item, directory)
elif fault == "commit":  # the rename that commits it (in the background)
    async_path.rename = failing(async_path.rename, errno.EROFS, 0)
elif fault == "metrics":
    opened, open_ = [], pathlib.Path.open
    def metrics_open(self, mode="r", *args, **kwargs):
        if self.name == "metrics.jsonl" and mode == "a":
            opened.append(self)
            if len(opened) == 5:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return open_(self, mode, *args, **kwargs)
    pathlib.Path.open = metrics_open
batch = in_memory.Dataset.batch
def slow_batch(self, step, *args, **kwargs):
    if self.split == "train":
        time.sleep(delay)
        checkpoints = pathlib.Path(argv[argv.index("--workdir") + 1]) / "checkpoints"
        if fault in ("write", "commit") and step == {FAILED_SAVE} + 1:  # once Orbax's thread
            failed.wait()  # that failed in the background has ended: the next step sees it
            while any(thread.name == "save_finalize" for thread in threading.enumerate()):
                time.sleep(0.01)
        if fault in ("file", "fill") and step == {FAILED_SAVE} - 1:  # once step 4 committed
            while not (checkpoints / "4").exists():
                time.sleep(0.01)
            if fault == "file":
                checkpoints.rename(checkpoints.with_name("aside"))
                checkpoints.write_text("")
            else:  # fill the filesystem the run is on (a small one)
                try:
                    with open(checkpoints.parent.parent / "filler", "wb") as filler:
                        while True:
                            filler.write(bytes(4096))
                            filler.flush()
                except OSError:
                    pass
    return batch(self, step, *args, **kwargs)
in_memory.Dataset.batch = slow_batch
from train.__main__ import main
sys.exit(main(["python -m train", *argv]))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The text the runs train on (not a file of the repository, which others may edit)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(f"Line {i}: the quick brown fox jumps over {i * 7919 % 1009} lazy "
                            "dogs.\n" for i in range(3000)))
    return path


def train_args(workdir: Path, corpus: Path) -> list[str]:
    fields = dict(steps=STEPS, checkpoint_every=EVERY, batch_size=8, seq_len=16, log_every=1,
                  eval_every=1000, eval_batches=1, sample_tokens=0, mesh__data=1,
                  model__d_model=32, model__num_layers=2, model__attention__num_heads=4,
                  model__attention__num_kv_heads=2, optimizer__warmup_steps=2,
                  data__name="text", data__path=corpus)
    return ["--config", "experiments/quickstart.py", "--workdir", str(workdir),
            *[f"--config.{name.replace('__', '.')}={value}" for name, value in fields.items()]]


def driver(fault: str, workdir: Path, corpus: Path, delay: float = 0.0) -> list[str]:
    return [sys.executable, "-c", DRIVER, fault, str(delay), *train_args(workdir, corpus)]


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=one_device_env(), capture_output=True,
                          text=True, timeout=240)


def trainer(workdir: Path, corpus: Path) -> list[str]:
    return [sys.executable, "-m", "train", *train_args(workdir, corpus)]


def losses(workdir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    return {r["step"]: r["train_loss"] for r in records}


def the_line(run: subprocess.CompletedProcess) -> str:
    """The run's one `error:` line, which ends stderr; no traceback, no Orbax error record."""
    assert "Traceback" not in run.stderr and "ERROR:" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in re.split(r"[\r\n]", run.stderr) if line.strip()]
    assert [line for line in lines if line.startswith("error:")] == lines[-1:], lines[-5:]
    return lines[-1]


def assert_resumes_as_uninterrupted(workdir: Path, corpus: Path, kept: int,
                                    uninterrupted: Path) -> None:
    resumed = run(trainer(workdir, corpus))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from the checkpoint at step {kept} " in resumed.stderr
    assert losses(workdir) == losses(uninterrupted)  # the same program: bit for bit


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> Path:
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    finished = run(trainer(workdir, corpus))
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert list(losses(workdir)) == list(range(1, STEPS + 1))
    return workdir


@pytest.mark.slow
@pytest.mark.parametrize("fault,reason", [
    ("mkdir", "No space left on device"), ("write", "No space left on device"),
    ("commit", "Read-only file system"), ("file", "Not a directory")])
def test_a_failed_save_is_one_line_at_that_save_and_the_run_resumes(
        uninterrupted, corpus, tmp_path, fault, reason):
    workdir = tmp_path / "run"
    failed = run(driver(fault, workdir, corpus))
    assert failed.returncode == 3, failed.stderr[-3000:]
    line = the_line(failed)
    match = re.fullmatch(
        rf"error: cannot write the checkpoint of step (\d+) to {workdir}/checkpoints/\1: "
        rf"{reason}; the newest complete checkpoint, step (\d+), is kept; rerun the same "
        "command to resume from it once the directory is writable and has space", line)
    assert match, line
    failed_step, kept = int(match[1]), int(match[2])
    assert kept == failed_step - EVERY and failed_step <= FAILED_SAVE
    # stopped within a step of the failure (the background write failed by step 10), not at
    # the next save (step 12)
    assert max(losses(workdir)) <= FAILED_SAVE + 2
    if fault == "file":
        (workdir / "checkpoints").unlink()
        (workdir / "aside").rename(workdir / "checkpoints")
    assert rundir.checkpoint_steps(workdir)[-1] == kept  # the failed save is no step
    if fault in ("write", "commit"):  # the failed save left its files behind (a part, or all)
        assert_resumes_as_uninterrupted(workdir, corpus, kept, uninterrupted)


@pytest.mark.slow
def test_a_real_full_filesystem_is_one_line_and_the_run_resumes(uninterrupted, corpus,
                                                                 tmp_path):
    """On a 32 MiB tmpfs filled mid-run (needs the right to mount: skipped without it)."""
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(tmp_path)],
                             capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        workdir = tmp_path / "run"
        failed = run(driver("fill", workdir, corpus))
        assert failed.returncode == 3, failed.stderr[-3000:]
        line = the_line(failed)  # the checkpoint or metrics.jsonl, whichever is written first
        assert re.fullmatch(
            rf"error: cannot write ({workdir}/metrics.jsonl|the checkpoint of step 8 to "
            rf"{workdir}/checkpoints/8): No space left on device; the newest complete "
            "checkpoint, step 4, is kept.*", line), line
        (tmp_path / "filler").unlink()
        assert_resumes_as_uninterrupted(workdir, corpus, 4, uninterrupted)
    finally:
        subprocess.run(["umount", str(tmp_path)], check=True)


@pytest.mark.slow
def test_a_full_disk_while_writing_metrics_is_one_line(corpus, tmp_path):
    workdir = tmp_path / "run"
    failed = run(driver("metrics", workdir, corpus))
    assert failed.returncode == 3, failed.stderr[-3000:]
    assert the_line(failed) == (
        f"error: cannot write {workdir}/metrics.jsonl: No space left on device; the newest "
        f"complete checkpoint, step 4, is kept in {workdir}/checkpoints; rerun the same command "
        "once the directory is writable and has space")


def test_unretrieved_tensorstore_errors_are_dropped_and_other_errors_kept(caplog):
    """asyncio reports a TensorStore future nobody awaited after a failed save; its exception,
    set from C++, has no Python frames, only its `tensorstore_spec`. Other errors still show."""
    import asyncio
    import logging

    import train.checkpoint  # noqa: F401  (installs the filter on asyncio's logger)

    def never_retrieved(error: Exception) -> None:
        future = asyncio.new_event_loop().create_future()
        future.set_exception(error)
        del future  # asyncio logs "Future exception was never retrieved" here

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        never_retrieved(ValueError("RESOURCE_EXHAUSTED: Failed writing: No space left on "
                                   "device [tensorstore_spec='{\"driver\":\"zarr\"}']"))
        assert not caplog.records
        never_retrieved(ValueError("an error of someone else's"))
        assert [r.exc_info[1].args for r in caplog.records] == [("an error of someone else's",)]


def test_after_a_failed_save_its_abandoned_writes_are_not_reported(tmp_path):
    """Orbax's writes of a failed save may be coroutines nobody awaits: Python reports each
    when collected (at exit, after the one error line) unless the failure muted them."""
    import errno
    import types
    import warnings

    from train.checkpoint import Checkpointer

    async def write_fragment():
        pass

    checkpointer = Checkpointer.__new__(Checkpointer)  # the state a failed save reads
    checkpointer.saving, checkpointer.directory = 8, tmp_path
    checkpointer.manager = types.SimpleNamespace(latest_step=lambda: 4)
    with warnings.catch_warnings(record=True) as caught:  # restores the filters after
        warnings.simplefilter("always")
        write_fragment()  # collected at once, never awaited: reported
        error = checkpointer._write_error(OSError(errno.ENOSPC, "No space left on device"))
        write_fragment()  # after the failure: muted
    assert [str(w.message).split("'")[1] for w in caught] == [write_fragment.__qualname__]
    assert str(error).startswith(f"cannot write the checkpoint of step 8 to {tmp_path}/8: No "
                                 "space left on device; the newest complete checkpoint, step 4")


def test_too_little_space_or_a_file_for_checkpoints_is_refused_before_the_first_step(
        corpus, tmp_path, monkeypatch):
    config = tiny_config()
    config.mesh.data = -1  # over the simulated devices
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=100_000))
    with pytest.raises(rundir.WorkdirError, match=re.escape(
            f"--workdir={tmp_path}: its filesystem has 0.1 MiB free, less than one checkpoint "
            "of this run (0.4 MiB: the parameters and optimizer state)")) as error:
        train(resolve_for_job(config), tmp_path)
    assert "free space there or use another --workdir" in str(error.value)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before the first step

    (tmp_path / "checkpoints").rmdir()
    (tmp_path / "checkpoints").write_text("")
    refused = run(trainer(tmp_path, corpus))
    assert refused.returncode == 2 and refused.stderr == (
        f"error: --workdir={tmp_path}: {tmp_path}/checkpoints is a file, not the directory of "
        "the run's checkpoints; move it aside and rerun, or use a new --workdir\n")


@pytest.mark.slow
def test_ctrl_c_saves_the_current_step_and_the_resume_is_uninterrupted(
        uninterrupted, corpus, tmp_path):
    workdir = tmp_path / "run"
    interrupted = subprocess.Popen(driver("none", workdir, corpus, delay=0.2), cwd=REPO,
                                   env=one_device_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (workdir / "checkpoints" / str(EVERY)).exists():
        assert interrupted.poll() is None and time.time() < deadline, \
            interrupted.communicate()[1][-3000:]
        time.sleep(0.05)
    interrupted.send_signal(signal.SIGINT)
    _, stderr = interrupted.communicate(timeout=240)
    assert interrupted.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    match = re.search(rf"SIGINT: the checkpoint of step (\d+) is saved in {workdir}/checkpoints; "
                      "rerun the same command to resume\n$", stderr)
    assert match, stderr[-3000:]
    saved = int(match[1])
    assert EVERY < saved < STEPS and rundir.checkpoint_steps(workdir)[-1] == saved
    assert_resumes_as_uninterrupted(workdir, corpus, saved, uninterrupted)


def _no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, "No space left on device", "the/file")


def _checkpoint_fails(*args, **kwargs):
    from train.checkpoint import WriteError

    try:
        _no_space()
    except OSError as error:  # the chain a failed Checkpointer.save leaves
        raise WriteError("cannot write the checkpoint of step 0 to the/file: ...") from error


@pytest.mark.parametrize("command", ["import_hf", "quantize", "prune_heal", "prune_heads",
                                     "seeds"])
def test_the_other_commands_that_write_say_a_failed_write_in_one_line(command, tmp_path,
                                                                     monkeypatch, capsys):
    """Every command line that writes a run or a report (besides `python -m train`) turns a
    failed write, a checkpoint's `WriteError` or an OSError, into one line and exit status 3.
    The work itself is replaced: only the command line's handling is under test."""
    import importlib

    out = tmp_path / "out"
    saved = {"model": {"num_layers": 16}}
    if command == "seeds":
        import train.seeds as module

        monkeypatch.setattr(module, "train_seeds", _checkpoint_fails)
        argv = ["train.seeds", "--config", str(REPO / "experiments/quickstart.py"),
                "--workdir", str(out), "--seeds", "0,1"]
        expected = f"error: cannot write the runs in {out}: "
    else:
        module = importlib.import_module(f"scripts.{command}")
        work = {"import_hf": ("train.interop.import_hf", "import_checkpoint", _checkpoint_fails),
                "quantize": ("train.interop.quantize", "quantize_run", _checkpoint_fails),
                "prune_heal": ("train.instruments.pruning_report", "write_blocks", _no_space),
                "prune_heads": ("train.instruments.pruning_report", "write_heads", _no_space)}
        target, name, failing = work[command]
        monkeypatch.setattr(importlib.import_module(target), name, failing)
        for check, value in (("check_checkpoint", None), ("check_arguments", None),
                             ("saved_run", saved), ("check_analysis", None)):
            if hasattr(module, check):
                monkeypatch.setattr(module, check, lambda *args, value=value: value)
        for measure in ("measure_blocks", "measure_heads"):
            monkeypatch.setattr(importlib.import_module("train.instruments.pruning_report"),
                                measure, lambda *args, **kwargs: {})
        source = "--checkpoint" if command == "import_hf" else "--workdir"
        argv = [source, str(tmp_path / "source"),
                "--workdir" if command == "import_hf" else "--out", str(out),
                *(["--method", "int8"] if command == "quantize" else [])]
        expected = (f"error: cannot write the run into {out}: " if command == "import_hf" else
                    f"error: cannot write into --out={out}: ")
    assert module.main(argv) == 3
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and stderr.startswith(
        expected + "No space left on device; "), stderr
    assert "once the directory is writable and has space" in stderr
