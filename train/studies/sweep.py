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


def vmap_groups(runs: list[Run]) -> list[list[Run]]:
    """`runs` in order, consecutive runs that can train as one vmapped program (`python -m
    train.seeds`) grouped: the seeds of one cell with the same config and overrides, in sibling
    directories `seed<k>` that hold no run yet (a started run resumes alone, as `python -m
    train`); every other run alone."""
    groups: list[list[Run]] = []
    for run in runs:
        fresh = (run.workdir.name == f"seed{run.seed}"
                 and not (run.workdir / "metrics.jsonl").exists())
        last = groups[-1][-1] if groups else None
        if (fresh and last is not None and last.workdir.parent == run.workdir.parent
                and (last.cell, last.config, last.overrides, last.workdir.name)
                == (run.cell, run.config, run.overrides, f"seed{last.seed}")
                and not (last.workdir / "metrics.jsonl").exists()):
            groups[-1].append(run)
        else:
            groups.append([run])
    return groups


def _command(group: list[Run]) -> list[str]:
    """The command that trains `group`: `python -m train` for one run, `python -m train.seeds`
    for several seeds of one cell (`vmap_groups`). `-P` keeps the working directory off the
    trainer's sys.path, so that with `environment`'s PYTHONPATH it runs this sweep's checkout
    (the commit its provenance line names), not a `train` package in the working directory."""
    if len(group) == 1:
        return [sys.executable, "-P", "-m", "train", *group[0].train_args()]
    first = group[0]
    return [sys.executable, "-P", "-m", "train.seeds", "--config", first.config, "--workdir",
            str(first.workdir.parent), "--seeds", ",".join(str(run.seed) for run in group),
            *first.overrides]


def environment(compile_cache: str | Path | None = None) -> dict[str, str]:
    """The trainers' environment: this one, with the checkout this code runs from
    (`provenance.REPOSITORY`) first on PYTHONPATH, and with `compile_cache`, JAX's persistent
    compilation cache in that directory for every program."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(provenance.REPOSITORY),
                                         *filter(None, [env.get("PYTHONPATH")])])
    if compile_cache is not None:
        env.update(JAX_COMPILATION_CACHE_DIR=str(compile_cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def run_local(runs: list[Run], *, vmap_seeds: bool = False,
              compile_cache: Path | None = None) -> int:
    """Run each of `runs` in turn as `python -m train` (output in WORKDIR/train.log), skipping
    those finished with the same config (one finished with another, e.g. after the study file
    changed, is reported as failed and kept) and reporting as failed, without launching, those
    another trainer holds (`rundir.check_not_locked`: two sweeps sharing a root); print one line
    per run and a summary. Each launch first appends its provenance (`train.studies.provenance`)
    to the run directory. Returns 0, or 1 if any failed. SIGINT or SIGTERM is passed on to the
    run in progress, which saves its checkpoint and stops; then `Interrupted` names it.

    With `vmap_seeds`, the unstarted seeds of a cell train at once as one vmapped program
    (`vmap_groups`; docs/studies.md#study-mode: one compile for the seeds, no resume within
    the group, so an interrupted group starts again). With `compile_cache`, every run shares
    JAX's persistent compilation cache in that directory."""
    received: list[int] = []  # the signals, first one first
    running: list[subprocess.Popen] = []  # the run in progress
    env = environment(compile_cache)

    def forward(signum, frame):
        received.append(signum)
        for child in running:
            child.send_signal(signum)

    def launch(group: list[Run], log: Path) -> int:
        command = _command(group)
        for run in group:
            run.workdir.mkdir(parents=True, exist_ok=True)
            provenance.append(run.workdir, command)
        with log.open("a") as output:
            running.append(subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                            env=env))
            if received:  # a signal before the run started to be passed on
                running[0].send_signal(received[0])
            status = running[0].wait()
            running.clear()
        return status

    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        failures, finished, index = [], 0, 0
        for group in (vmap_groups(runs) if vmap_seeds else [[run] for run in runs]):
            pending = []  # (run, its steps) to train
            for run in group:
                index += 1
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
                try:  # another trainer (another sweep's, say) has it: no launch, no record
                    rundir.check_not_locked(run.workdir)
                except rundir.WorkdirError as error:
                    failures.append((run, f"busy: {error}"))
                    print(f"failed: {error}", flush=True)
                    continue
                pending.append((run, int(config.steps)))
                if len(group) > 1:
                    print("queued", flush=True)
            if not pending:
                continue
            batch = [run for run, _ in pending]
            log = (batch[0].workdir / "train.log" if len(batch) == 1
                   else batch[0].workdir.parent / "seeds.log")
            start = time.monotonic()
            status = launch(batch, log)
            if received:
                print("interrupted", flush=True)
                raise Interrupted(received[0], batch[0], finished, len(runs))
            elapsed = time.monotonic() - start
            for run, steps in pending:
                state, loss = studies.run_state(run.workdir, steps)
                where = "" if len(batch) == 1 else f"{run.label()}: "
                if status == 0 and state == "finished":
                    finished += 1
                    print(f"{where}done in {elapsed:.0f} s, eval_loss {loss:.4f}", flush=True)
                else:
                    why = f"exit {status}" if status else state
                    failures.append((run, f"{why}: {studies.last_line(log)} (log: {log})"))
                    print(f"{where}failed ({why}) after {elapsed:.0f} s: "
                          f"{studies.last_line(log)}", flush=True)
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
