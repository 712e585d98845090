"""The report of a study sweep: final losses per arm with seed spreads and paired differences to
the baseline, loss curves, claims tested, and for scaling studies power-law fits and compute
multipliers; with a learning rate per arm (scripts/sweep.py --tune / --tuned), each arm's tuning
grid with its pick and the shared-rate and tuned-rate comparisons side by side.

    python scripts/study_report.py --root runs/STUDY [--study experiments/STUDY.py]
        [--plan [--one_sided]]

Reads ROOT/study.json (written by scripts/sweep.py) and every run directory under ROOT, and
writes ROOT/report.md with its plots: `train.studies.report`, whose module docstring says what
it reads and writes (docs/studies.md). --study gives the study file when ROOT has no study.json
(its first scale, every cell, its SEEDS), or newer declarations (baseline, paper numbers,
claims) than those recorded.

--plan prints, instead, the power plan of a replication of the study's registered claims
(`train.studies.power_plan`): from the paired runs under ROOT, per claim the seeds that detect
the observed difference and the paper's (or show the margin) at 80% power and the level α/m of
its family, and per family the n to register; --one_sided plans every direction one-sided.

Exit status: 0 done; 2 a bad argument, study or record, one line on stderr. --root and --study
are checked before JAX loads.
"""

from __future__ import annotations

import sys

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
    args = parser.parse_args(argv)
    if args.one_sided and not args.plan:
        parser.error("--one_sided plans a replication: it needs --plan")
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
        written = report.write_report(args.root, description)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
