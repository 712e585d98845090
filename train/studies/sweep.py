"""Run every arm of a study over its seeds (docs/studies.md).

    python scripts/sweep.py --study experiments/STUDY.py --root runs/STUDY [--scale SCALE]
        [--seeds 0,1,2] [--arms A,B] [--sizes S,M] [--launch local|print|slurm|tpu]
        [-- --config.FIELD=VALUE ...]

Each (cell, seed) trains into its own run directory, ROOT/<cell>/seed<k>, with
`python -m train --config STUDY:CELL,SCALE --workdir ROOT/<cell>/seed<k> --config.seed=K`
plus the overrides after `--` (passed to every run). A cell is an arm, or ARM@SIZE for each
size of a scaling study. ROOT/study.json records the study, the scale and what was asked for,
so `python scripts/study_report.py --root ROOT` needs nothing else.

--launch:
  local   run each in turn here (default): one progress line per run, its output in
          ROOT/<cell>/seed<k>/train.log. A finished run is skipped and an interrupted one
          resumes from its checkpoint, so stopping and rerunning the command is safe. A failed
          run does not stop the others; the summary lists the failures.
  print   print one `python -m train` command per run (shell-quoted).
  slurm   write ROOT/slurm_runs.txt (one run's arguments per line) and print the command that
          submits them as one array job of scripts/slurm_train.sbatch.
  tpu     print one scripts/launch_tpu_pod.sh command per run; set TPU and ZONE in the shell
          that runs them (ROOT must be a directory every worker sees).
Defaults: the study's first scale and its SEEDS, every arm (and every size of a scaling
study; --sizes picks some). Exit status: 0 every run finished
(local) or the commands were written, 1 a run failed, 2 bad arguments or study (one line),
130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from config import ConfigError, cli
from config.cli import ArgumentParser, UsageError
from train import rundir
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

    def train_args(self) -> list[str]:
        """The arguments of `python -m train` for this run."""
        return ["--config", self.config, "--workdir", str(self.workdir), *self.flags()]

    def flags(self) -> list[str]:
        """The run's config overrides: its seed, then the sweep's overrides."""
        return [f"--config.seed={self.seed}", *self.overrides]

    def label(self) -> str:
        """The run as the progress lines name it."""
        return f"arm={self.cell} seed={self.seed}"


def plan(study: studies.Study, root: str | Path, scale: str, cells: list[str], seeds: list[int],
         overrides: list[str]) -> list[Run]:
    """The runs of `cells` × `seeds`, cell by cell."""
    return [Run(cell, seed, study.config_arg(cell, scale), studies.run_dir(root, cell, seed),
                tuple(overrides)) for cell in cells for seed in seeds]


def _seeds(text: str) -> list[int]:
    """The seeds of `--seeds 0,1,2`; a one-line UsageError for anything else."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--seeds={text} is invalid: pass comma-separated non-negative ints, "
                         "e.g. --seeds 0,1,2") from None
    if any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds={text} is invalid: seeds must be distinct non-negative ints")
    return seeds


def _check_overrides(study: studies.Study, scale: str, overrides: list[str]) -> None:
    """Refuse overrides that are not --config.FIELD flags, that set the seed, or that the
    baseline's config rejects (an unknown field, a wrong type): one line, before any run."""
    rest, fields = cli.split_overrides(overrides)
    if rest:
        raise UsageError(f"{rest[0]!r} after -- is not a --config.FIELD=VALUE override")
    if any(field == "seed" for field, _ in fields):
        raise UsageError("--config.seed after -- is not allowed: the sweep sets each run's seed "
                         "(--seeds)")
    config = cli.load_experiment(study.config_arg(study.cells([study.baseline])[0], scale))
    cli.apply_overrides(config, fields)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[Run]]:
    """(arguments, runs) of the command line `argv` (without the program), recorded in
    ROOT/study.json; a bad argument or study exits 2 with one line."""
    parser = ArgumentParser("python scripts/sweep.py", __doc__)
    parser.add_argument("--study", required=True, metavar="PATH", help="the study file")
    parser.add_argument("--root", required=True, metavar="DIR", help="the sweep's directory")
    parser.add_argument("--scale", help="one of the study's SCALES (default: its first)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the study's SEEDS)")
    parser.add_argument("--arms", help="comma-separated arms (default: all)")
    parser.add_argument("--sizes", help="comma-separated sizes of a scaling study (default: all)")
    parser.add_argument("--launch", choices=LAUNCHES, default="local")
    overrides = []
    if "--" in argv:
        split = argv.index("--")
        argv, overrides = argv[:split], argv[split + 1:]
    args = parser.parse_args(argv)
    try:
        study = studies.load_study(args.study)
        scale = args.scale or study.scales[0]
        if scale not in study.scales:
            raise UsageError(f"--scale={scale} is not one of the study's SCALES {study.scales}")
        seeds = _seeds(args.seeds) if args.seeds else list(study.seeds)
        arms = tuple(dict.fromkeys(args.arms.split(","))) if args.arms else study.arms
        unknown = [arm for arm in arms if arm not in study.arms]
        if unknown:
            raise UsageError(f"--arms={args.arms}: {unknown[0]!r} is not one of the study's "
                             f"ARMS {study.arms}")
        sizes = tuple(dict.fromkeys(args.sizes.split(","))) if args.sizes else None
        if sizes and not set(sizes) <= set(study.scaling):
            raise UsageError(f"--sizes={args.sizes}: the study's SCALING sizes are "
                             f"{study.scaling or 'none (it is not a scaling study)'}")
        _check_overrides(study, scale, overrides)
        cells = study.cells(arms, sizes)
        studies.record(args.root, study, scale, cells, seeds, overrides)
    except UsageError as error:
        parser.error(str(error))
    return args, plan(study, args.root, scale, cells, seeds, overrides)


def run_config(run: Run):
    """The config the run trains with: its study's config with its seed and the overrides (no
    JAX)."""
    config = cli.load_experiment(run.config)
    cli.apply_overrides(config, cli.split_overrides(run.flags())[1])
    return config


def run_local(runs: list[Run]) -> int:
    """Run each of `runs` in turn as `python -m train` (output in WORKDIR/train.log), skipping
    those finished with the same config (one finished with another, e.g. after the study file
    changed, is reported as failed and kept); print one line per run and a summary. Returns 0,
    or 1 if any failed."""
    failures = []
    for index, run in enumerate(runs, 1):
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
            print(f"finished already (eval_loss {loss:.4f}): skipped", flush=True)
            continue
        run.workdir.mkdir(parents=True, exist_ok=True)
        log = run.workdir / "train.log"
        start = time.monotonic()
        with log.open("a") as output:
            status = subprocess.run([sys.executable, "-m", "train", *run.train_args()],
                                    stdout=output, stderr=subprocess.STDOUT,
                                    env=os.environ).returncode
        elapsed = time.monotonic() - start
        state, loss = studies.run_state(run.workdir, int(config.steps))
        if status == 0 and state == "finished":
            print(f"done in {elapsed:.0f} s, eval_loss {loss:.4f}", flush=True)
        else:
            why = f"exit {status}" if status else state
            failures.append((run, f"{why}: {studies.last_line(log)} (log: {log})"))
            print(f"failed ({why}) after {elapsed:.0f} s: {studies.last_line(log)}", flush=True)
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


def slurm(runs: list[Run], root: str | Path) -> None:
    """Write ROOT/slurm_runs.txt, one run's scripts/slurm_train.sbatch arguments per line, and
    print the `sbatch --array` command whose task k runs line k + 1."""
    path = Path(root) / SLURM_RUNS
    path.write_text("".join(shlex.join([run.config, str(run.workdir), *run.flags()]) + "\n"
                            for run in runs))
    print(shlex.join(["sbatch", f"--array=0-{len(runs) - 1}", "scripts/slurm_train.sbatch",
                      "--runs", str(path)]))


def tpu(runs: list[Run]) -> None:
    """One scripts/launch_tpu_pod.sh command per run, for the TPU and ZONE of the shell."""
    for run in runs:
        rest = shlex.join(["--config", run.config, "--workdir", str(run.workdir), "--",
                           *run.flags()])
        print(f'scripts/launch_tpu_pod.sh --tpu "$TPU" --zone "$ZONE" {rest}')


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    args, runs = parse(sys.argv[1:] if argv is None else argv)
    if args.launch == "print":
        print_commands(runs)
    elif args.launch == "slurm":
        slurm(runs, args.root)
    elif args.launch == "tpu":
        tpu(runs)
    else:
        try:
            return run_local(runs)
        except KeyboardInterrupt:
            print("\ninterrupted: rerun the same command to resume", file=sys.stderr)
            return 130
    return 0
