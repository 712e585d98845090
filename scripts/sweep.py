"""Run every arm of a study over its seeds, here or through a cluster's launcher (docs/studies.md).

    python scripts/sweep.py --study experiments/STUDY.py --root runs/STUDY [--scale SCALE]
        [--seeds 0,1,2] [--arms A,B] [--sizes S,M] [--launch local|print|slurm|tpu [--submit]]
        [--tune | --tuned] [--vmap_seeds] [--compile_cache] [--exploratory]
        [-- --config.FIELD=VALUE ...]

Each (cell, seed) trains into its own run directory, ROOT/<cell>/seed<k>, with
`python -m train --config STUDY:CELL,SCALE --workdir ROOT/<cell>/seed<k> --config.seed=K`
plus the overrides after `--` (passed to every run). A cell is an arm, or ARM@SIZE for each
size of a scaling study. ROOT/study.json records the study, the scale and what was asked for,
so `python scripts/study_report.py --root ROOT` needs nothing else. The runs and their
launches: `train.studies.sweep`. The sweep and every run it launches here use the code of the
checkout this script is in (a git worktree's, say, not an installed package's), and each run's
provenance.jsonl names that checkout's commit.

--launch:
  local   run each in turn here (default): one progress line per run, its output in
          ROOT/<cell>/seed<k>/train.log. A finished run is skipped and an interrupted one
          resumes from its checkpoint, so stopping and rerunning the command is safe. A failed
          run does not stop the others; the summary lists the failures. Study mode
          (docs/studies.md#study-mode): --vmap_seeds trains the unstarted seeds of each cell as
          one vmapped program (`python -m train.seeds`: one compile, output in
          ROOT/<cell>/seeds.log; an interrupted group's seeds then resume one by one), and
          --compile_cache shares JAX's persistent compilation cache, ROOT/compilation_cache,
          across the runs (compiled once per program, not per run).
  print   print one `python -m train` command per run (shell-quoted).
  slurm   write ROOT/slurm_runs.txt (one run's arguments per line) and print the command that
          submits them as one array job of scripts/slurm_train.sbatch; with --submit, also
          run it (from the repository root; ROOT on a filesystem every node sees). Each task
          is one run, itself one process per node of the job's allocation.
  tpu     print one scripts/launch_tpu_pod.sh command per run; set TPU and ZONE in the shell
          that runs them (ROOT must be a directory every worker sees).
A learning rate per arm (`train.studies.tuning`), for a study that declares TUNING:
  --tune   train each cell once (TUNING's seed) at each rate of TUNING's grid, in
           ROOT/tuning/<cell>/lr<rate>, evaluating on the tail of the train split
           (data.tuning_fraction), never on validation; widen the grid by a factor of 2 at an
           edge while the best rate lies there (at most 4 times); record the grids and each
           cell's pick in ROOT/tuning.json. Local launches only; exit 1 if a cell gets no pick.
  --tuned  train the seeds of each cell at its picked rate (ROOT/tuning.json), into the sweep
           root ROOT/tuned (its own study.json), beside the shared-rate runs of ROOT; pass
           the overrides the tuning had. study_report.py --root ROOT compares the two.
Neither takes --config.optimizer.learning_rate or --config.data.tuning_fraction after --.
Provenance: a sweep launches confirmatory runs only from a clean checkout at a commit on main
(`train.studies.provenance.checkout_problem`), else it exits 2 with one line before anything
runs; --exploratory launches anyway, and the report then counts no run launched from a dirty
tree, or at a commit that is not an ancestor of its HEAD, toward a claim.
Defaults: the study's first scale and its SEEDS, every arm (and every size of a scaling
study; --sizes picks some). Exit status: 0 every run finished (local) or the commands were
written, 1 a run failed, 2 bad arguments or study (one line, before anything runs; the sweep
itself imports no JAX), 130 or 143 interrupted by SIGINT (Ctrl-C) or SIGTERM: a local sweep
passes the signal on to the run in progress, which saves its checkpoint, then names that run
on stderr; rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

# This checkout's code, not an installed one's (from a git worktree, say): the runs it launches
# train with the same code, and their provenance names its commit (`sweep.environment`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import cli
from config.cli import ArgumentParser, UsageError
from train.studies import provenance, sweep, tuning
from train.studies import study as studies
from train.studies.sweep import LAUNCHES, Run


def seeds_of(text: str) -> list[int]:
    """The seeds of `--seeds 0,1,2`; a one-line UsageError for anything else."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--seeds={text} is invalid: pass comma-separated non-negative ints, "
                         "e.g. --seeds 0,1,2") from None
    if any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds={text} is invalid: seeds must be distinct non-negative ints")
    return seeds


def check_overrides(study: studies.Study, scale: str, overrides: list[str]) -> None:
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


class Plan(NamedTuple):
    """What a command line asks for: the study's cells at a scale, and the runs to launch
    (none for --tune, whose runs `tuning.tune` chooses as the losses come in)."""
    study: studies.Study
    scale: str
    cells: list[str]
    overrides: list[str]
    runs: list[Run]


def parse(argv: list[str]) -> tuple[argparse.Namespace, Plan]:
    """(arguments, plan) of the command line `argv` (without the program), recorded in
    ROOT/study.json; a bad argument or study exits 2 with one line."""
    parser = ArgumentParser("python scripts/sweep.py", __doc__)
    parser.add_argument("--study", required=True, metavar="PATH", help="the study file")
    parser.add_argument("--root", required=True, metavar="DIR", help="the sweep's directory")
    parser.add_argument("--scale", help="one of the study's SCALES (default: its first)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the study's SEEDS)")
    parser.add_argument("--arms", help="comma-separated arms (default: all)")
    parser.add_argument("--sizes", help="comma-separated sizes of a scaling study (default: all)")
    parser.add_argument("--launch", "--launcher", choices=LAUNCHES, default="local")
    parser.add_argument("--submit", action="store_true",
                        help="with --launch slurm: submit the array job with sbatch")
    parser.add_argument("--vmap_seeds", action="store_true",
                        help="local: train each cell's unstarted seeds as one vmapped program")
    parser.add_argument("--compile_cache", action="store_true",
                        help="local: share JAX's compilation cache, ROOT/compilation_cache")
    parser.add_argument("--exploratory", action="store_true",
                        help="launch from a dirty tree or a commit not on main (its runs then "
                             "count toward no claim)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--tune", action="store_true",
                      help="tune each arm's learning rate over the study's TUNING grid")
    mode.add_argument("--tuned", action="store_true",
                      help="train each arm at its tuned rate, into ROOT/tuned")
    overrides = []
    if "--" in argv:
        split = argv.index("--")
        argv, overrides = argv[:split], argv[split + 1:]
    args = parser.parse_args(argv)
    if args.submit and args.launch != "slurm":
        parser.error(f"--submit submits a SLURM array job: it needs --launch slurm, not "
                     f"--launch {args.launch}")
    for flag in ("vmap_seeds", "compile_cache"):
        if getattr(args, flag) and args.launch != "local":
            parser.error(f"--{flag} is for local launches, not --launch {args.launch}")
    try:
        study = studies.load_study(args.study)
        scale = args.scale or study.scales[0]
        if scale not in study.scales:
            raise UsageError(f"--scale={scale} is not one of the study's SCALES {study.scales}")
        seeds = seeds_of(args.seeds) if args.seeds else list(study.seeds)
        arms = tuple(dict.fromkeys(args.arms.split(","))) if args.arms else study.arms
        unknown = [arm for arm in arms if arm not in study.arms]
        if unknown:
            raise UsageError(f"--arms={args.arms}: {unknown[0]!r} is not one of the study's "
                             f"ARMS {study.arms}")
        sizes = tuple(dict.fromkeys(args.sizes.split(","))) if args.sizes else None
        if sizes and not set(sizes) <= set(study.scaling):
            raise UsageError(f"--sizes={args.sizes}: the study's SCALING sizes are "
                             f"{study.scaling or 'none (it is not a scaling study)'}")
        check_overrides(study, scale, overrides)
        problem = None if args.exploratory else provenance.checkout_problem()
        if problem:
            raise UsageError(f"this checkout cannot launch confirmatory runs: {problem}; or "
                             "pass --exploratory (its runs then count toward no claim)")
        cells = study.cells(arms, sizes)
        if args.tune or args.tuned:
            check_tuning(args, study, arms, overrides)
        if args.tune:
            tuning.check_root(args.root, study, scale, overrides)
            return args, Plan(study, scale, cells, overrides, [])
        if args.tuned:
            runs = tuning.tuned_plan(study, args.root, scale, cells, seeds, overrides)
            studies.record(Path(args.root) / tuning.TUNED_DIR, study, scale, cells, seeds,
                           overrides)
            return args, Plan(study, scale, cells, overrides, runs)
        studies.record(args.root, study, scale, cells, seeds, overrides)
    except UsageError as error:
        parser.error(str(error))
    runs = sweep.plan(study, args.root, scale, cells, seeds, overrides)
    return args, Plan(study, scale, cells, overrides, runs)


def check_tuning(args: argparse.Namespace, study: studies.Study, arms: tuple[str, ...],
                 overrides: list[str]) -> None:
    """Refuse --tune without TUNING, with --seeds or a launch other than local; either mode
    with an override of the rate or the tuning split, or an arm named like its directories."""
    flag = "--tune" if args.tune else "--tuned"
    if args.tune and study.tuning is None:
        raise UsageError(f"--tune: {study.path} declares no TUNING, e.g. TUNING = "
                         "dict(rates=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2), seed=0)")
    if args.tune and args.seeds:
        raise UsageError("--tune trains TUNING's seed; --seeds is for the tuned runs (--tuned)")
    if args.tune and args.launch != "local":
        raise UsageError(f"--tune --launch={args.launch}: tuning widens its grid from the "
                         "losses of finished runs, so it launches locally only")
    fields = [field for field, _ in cli.split_overrides(overrides)[1]]
    reserved = [field for field in fields if field in tuning.RESERVED_FIELDS]
    if reserved:
        raise UsageError(f"{flag}: --config.{reserved[0]} after -- is not allowed: the tuning "
                         "sets each run's learning rate and tuning split")
    clash = [arm for arm in arms if arm in (tuning.TUNING_DIR, tuning.TUNED_DIR)]
    if clash:
        raise UsageError(f"{flag}: arm {clash[0]!r} has the name of a directory the tuning "
                         "writes in ROOT; rename the arm")


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    args, plan = parse(sys.argv[1:] if argv is None else argv)
    study, runs = plan.study, plan.runs
    if args.tune:
        try:
            record = tuning.tune(study, args.root, plan.scale, plan.cells, plan.overrides)
        except sweep.Interrupted as interrupted:  # in a tuning run (`sweep.run_local`)
            print(interrupted, file=sys.stderr)
            return 128 + interrupted.signum
        except KeyboardInterrupt:
            print("\ninterrupted: rerun the same command to resume", file=sys.stderr)
            return 130
        tuned = list(dict.fromkeys(study.tuning.tuning_cell(cell) for cell in plan.cells))
        lines = tuning.summary(record, tuned)
        print("\n".join(["tuned rates (ROOT/tuning.json):", *lines]))
        return 1 if any(record["cells"][cell]["pick"] is None for cell in tuned) else 0
    if args.tuned:
        record = tuning.read_tuning(args.root)
        for cell in dict.fromkeys(run.cell for run in runs):
            source = study.tuning.tuning_cell(cell) if study.tuning else cell
            if not record["cells"][source]["interior"]:
                print(f"warning: arm={source}'s tuned rate is at the edge of its grid "
                      "(ROOT/tuning.json)", file=sys.stderr)
    if args.launch == "print":
        sweep.print_commands(runs)
    elif args.launch == "slurm":
        return sweep.slurm(runs, args.root, submit=args.submit)
    elif args.launch == "tpu":
        sweep.tpu(runs)
    else:
        cache = Path(args.root) / "compilation_cache" if args.compile_cache else None
        try:
            return sweep.run_local(runs, vmap_seeds=args.vmap_seeds, compile_cache=cache)
        except sweep.Interrupted as interrupted:
            print(interrupted, file=sys.stderr)
            return 128 + interrupted.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
