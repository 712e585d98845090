"""A study's sweep (docs/studies.md): its runs, each (cell, seed) of the arms asked for
(`plan`), and their launch: one after another here (`run_local`, resumable), or as commands for
a cluster (`print_commands`, `slurm`, `tpu`). The command line, which checks the study and its
arguments and records ROOT/study.json first: scripts/sweep.py. Imports no JAX: a sweep of many
runs starts each as its own `python -m train` process.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from config import ConfigError, cli
from config.cli import UsageError
from train import rundir
from train.studies import provenance
from train.studies import study as studies

LAUNCHES = ("local", "print", "slurm", "tpu")
SLURM_RUNS = "slurm_runs.txt"


@dataclasses.dataclass(frozen=True)
class Run:
    """One (cell, seed) of a sweep."""

    cell: str
    seed: int
    config: str  # the --config value: PATH:CELL,SCALE
    workdir: Path
    overrides: tuple[str, ...]
    note: str = ""  # what else the progress lines say of it, e.g. its learning rate

    def train_args(self) -> list[str]:
        """The arguments of `python -m train` for this run."""
        return ["--config", self.config, "--workdir", str(self.workdir), *self.flags()]

    def flags(self) -> list[str]:
        """The run's config overrides: its seed, then the sweep's overrides."""
        return [f"--config.seed={self.seed}", *self.overrides]

    def label(self) -> str:
        """The run as the progress lines name it."""
        return f"arm={self.cell} seed={self.seed}" + (f" {self.note}" if self.note else "")


def plan(study: studies.Study, root: str | Path, scale: str, cells: list[str], seeds: list[int],
         overrides: list[str]) -> list[Run]:
    """The runs of `cells` × `seeds`, cell by cell."""
    return [Run(cell, seed, study.config_arg(cell, scale), studies.run_dir(root, cell, seed),
                tuple(overrides)) for cell in cells for seed in seeds]


def run_config(run: Run):
    """The config the run trains with: its study's config with its seed and the overrides (no
    JAX)."""
    config = cli.load_experiment(run.config)
    cli.apply_overrides(config, cli.split_overrides(run.flags())[1])
    return config


class Interrupted(Exception):
    """A local sweep stopped by SIGINT or SIGTERM (exit status 128 + `signum`): the message
    names the run it stopped, if any, which saved its checkpoint, and how to resume."""

    def __init__(self, signum: int, run: Run | None, finished: int, total: int):
        self.signum = signum
        log = None if run is None else run.workdir / "train.log"
        stopped = ("between runs" if run is None else f"while running {run.label()} (its last "
                   f"line: {studies.last_line(log)!r}; log: {log})")
        super().__init__(
            f"interrupted by {signal.Signals(signum).name} {stopped}; {finished} of {total} "
            "runs finished: rerun the same command to resume (finished runs are skipped, a "
            "stopped one resumes from its checkpoint)")


def run_local(runs: list[Run]) -> int:
    """Run each of `runs` in turn as `python -m train` (output in WORKDIR/train.log), skipping
    those finished with the same config (one finished with another, e.g. after the study file
    changed, is reported as failed and kept); print one line per run and a summary. Each launch
    first appends its provenance (`train.studies.provenance`) to the run directory. Returns 0,
    or 1 if any failed. SIGINT or SIGTERM is passed on to the run in progress, which saves its
    checkpoint and stops; then `Interrupted` names it."""
    received: list[int] = []  # the signals, first one first
    running: list[subprocess.Popen] = []  # the run in progress

    def forward(signum, frame):
        received.append(signum)
        for child in running:
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        failures, finished = [], 0
        for index, run in enumerate(runs, 1):
            if received:
                raise Interrupted(received[0], None, finished, len(runs))
            print(f"[{index}/{len(runs)}] {run.label()} ", end="", flush=True)
            try:
                config = run_config(run)
            except UsageError as error:
                failures.append((run, f"bad config: {error}"))
                print(f"failed: {error}", flush=True)
                continue
            state, loss = studies.run_state(run.workdir, int(config.steps))
            if state == "finished":
                try:
                    rundir.check_resume(run.workdir, config, resolved=False)
                except ConfigError as error:
                    failures.append((run, f"stale: {error}"))
                    print(f"failed: finished with another config: {error}", flush=True)
                    continue
                finished += 1
                print(f"finished already (eval_loss {loss:.4f}): skipped", flush=True)
                continue
            run.workdir.mkdir(parents=True, exist_ok=True)
            log = run.workdir / "train.log"
            command = [sys.executable, "-m", "train", *run.train_args()]
            provenance.append(run.workdir, command)
            start = time.monotonic()
            with log.open("a") as output:
                running.append(subprocess.Popen(command, stdout=output,
                                                stderr=subprocess.STDOUT, env=os.environ))
                if received:  # a signal before the run started to be passed on
                    running[0].send_signal(received[0])
                status = running[0].wait()
                running.clear()
            if received:
                print("interrupted", flush=True)
                raise Interrupted(received[0], run, finished, len(runs))
            elapsed = time.monotonic() - start
            state, loss = studies.run_state(run.workdir, int(config.steps))
            if status == 0 and state == "finished":
                finished += 1
                print(f"done in {elapsed:.0f} s, eval_loss {loss:.4f}", flush=True)
            else:
                why = f"exit {status}" if status else state
                failures.append((run, f"{why}: {studies.last_line(log)} (log: {log})"))
                print(f"failed ({why}) after {elapsed:.0f} s: {studies.last_line(log)}",
                      flush=True)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print(f"{len(runs) - len(failures)} of {len(runs)} runs finished", flush=True)
    if failures:
        print(f"{len(failures)} failed:")
        for run, why in failures:
            print(f"  {run.label()}: {why}")
        return 1
    return 0


def print_commands(runs: list[Run]) -> None:
    """One shell-quoted `python -m train` command per run."""
    for run in runs:
        print(shlex.join(["python", "-m", "train", *run.train_args()]))


def slurm(runs: list[Run], root: str | Path, *, submit: bool = False) -> int:
    """Write ROOT/slurm_runs.txt, one run's scripts/slurm_train.sbatch arguments per line, and
    print the `sbatch --array` command whose task k runs line k + 1; with `submit`, run it
    (here, as the printed command would be run: from the repository root). Returns the exit
    status: sbatch's when submitting."""
    path = Path(root) / SLURM_RUNS
    path.write_text("".join(shlex.join([run.config, str(run.workdir), *run.flags()]) + "\n"
                            for run in runs))
    command = ["sbatch", f"--array=0-{len(runs) - 1}", "scripts/slurm_train.sbatch", "--runs",
               str(path)]
    print(shlex.join(command), flush=True)
    if not submit:
        return 0
    if shutil.which("sbatch") is None:
        print("error: --submit: sbatch is not on PATH; run the command above on the cluster's "
              "login node", file=sys.stderr)
        return 2
    return subprocess.run(command).returncode


def tpu(runs: list[Run]) -> None:
    """One scripts/launch_tpu_pod.sh command per run, for the TPU and ZONE of the shell."""
    for run in runs:
        rest = shlex.join(["--config", run.config, "--workdir", str(run.workdir), "--",
                           *run.flags()])
        print(f'scripts/launch_tpu_pod.sh --tpu "$TPU" --zone "$ZONE" {rest}')
