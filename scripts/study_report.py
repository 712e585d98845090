"""The report of a study sweep: final losses per arm with seed spreads and paired differences to
the baseline, loss curves, claims tested, and for scaling studies power-law fits and compute
multipliers; with a learning rate per arm (scripts/sweep.py --tune / --tuned), each arm's tuning
grid with its pick and the shared-rate and tuned-rate comparisons side by side.

    python scripts/study_report.py --root runs/STUDY [--study experiments/STUDY.py]
        [--plan [--one_sided] | --rerun K]

Reads ROOT/study.json (written by scripts/sweep.py) and every run directory under ROOT, and
writes ROOT/report.md with its plots: `train.studies.report`, whose module docstring says what
it reads and writes (docs/studies.md). --study gives the study file when ROOT has no study.json
(its first scale, every cell, its SEEDS), or newer declarations (baseline, paper numbers,
claims) than those recorded.

--plan prints, instead, the power plan of a replication of the study's registered claims
(`train.studies.power_plan`): from the paired runs under ROOT, per claim the seeds that detect
the observed difference and the paper's (or show the margin) at 80% power and the level α/m of
its family, and per family the n to register; --one_sided plans every direction one-sided.

--rerun K trains the K lowest finished seeds of every cell again at this checkout's code, into
ROOT/reruns/ (`train.studies.reruns`: the commands their provenance records, or ROOT/study.json
gives; resumable), and
writes ROOT/reruns.md: each rerun's final loss against the committed one and against its cell's
paired SD, a cell flagged **sensitive to rounding** when a rerun moves by more than a tenth of
it. Run it from the repository root, as the sweep.

Exit status: 0 done (--rerun: 1 when a rerun failed); 2 a bad argument, study or record, one
line on stderr. --root and --study are checked before JAX loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's code, not an installed one's (from a git worktree, say): --rerun trains with it
# and names its commit, as scripts/sweep.py does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config.cli import ArgumentParser, UsageError
from train.studies import study as studies


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/study_report.py", __doc__)
    parser.add_argument("--root", required=True, metavar="DIR", help="the sweep's directory")
    parser.add_argument("--study", metavar="PATH", help="the study file (default: study.json's)")
    parser.add_argument("--plan", action="store_true",
                        help="print the seeds a replication needs instead of writing the report")
    parser.add_argument("--one_sided", action="store_true",
                        help="with --plan: plan every direction as a one-sided test")
    parser.add_argument("--rerun", type=int, metavar="K",
                        help="rerun the K lowest finished seeds of every cell at this code")
    args = parser.parse_args(argv)
    if args.one_sided and not args.plan:
        parser.error("--one_sided plans a replication: it needs --plan")
    if args.rerun is not None and (args.rerun < 1 or args.plan):
        parser.error(f"--rerun={args.rerun} is invalid: a positive count of seeds per cell, "
                     "without --plan")
    try:
        studies.check_root(args.root, args.study)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.studies import report  # JAX loads here, after the checks

    try:
        description = report.describe(args.root, args.study)
        if args.plan:
            from train.studies import power_plan

            results, _ = report.collect(args.root, description)
            plans = power_plan.plan_claims(report.final_losses(results),
                                           description["claims"], description["paper"],
                                           tails=1 if args.one_sided else None)
            print("\n".join(power_plan.replication_lines(plans) or ["no loss claims to plan"]))
            return 0
        if args.rerun:
            return rerun(args.root, description, args.rerun, argv)
        written = report.write_report(args.root, description)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


def rerun(root: str, description: dict, per_arm: int, argv: list[str] | None) -> int:
    """--rerun: train, compare, write ROOT/reruns.md (the command, the machine, the table)."""
    from train.studies import provenance, reruns, sweep
    from train.studies.results import baseline_cell, collect

    results, _ = collect(root, description)
    runs, skipped = reruns.plan(root, results, per_arm, description)
    status = sweep.run_local(runs)
    rows = reruns.compare(root, results, runs,
                          lambda cell: baseline_cell(cell, description["baseline"]))
    here = provenance.current([])
    command = " ".join(["python scripts/study_report.py", *(argv or sys.argv[1:])])
    lines = ["# Reruns at today's code", "",
             f"`{command}`, at {(here['commit'] or 'no commit')[:7]}"
             f"{' (dirty tree)' if here['dirty'] else ''} on {here['cpu']}, {here['date']}.",
             "", f"Each cell's {per_arm} lowest finished seed(s) trained again with the command "
             "its provenance records; a rerun that moves by more than "
             f"{reruns.SENSITIVE:g} × its cell's paired SD is *sensitive to rounding* "
             "(`train/studies/reruns.py`). The committed runs stay the record.", "",
             *reruns.table(rows, skipped)]
    (Path(root) / "reruns.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - len(skipped) - 2:]))
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
