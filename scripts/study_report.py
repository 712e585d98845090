"""The report of a study sweep: final losses per arm with seed spreads and paired differences to
the baseline, loss curves, claims tested, and for scaling studies power-law fits and compute
multipliers; with a learning rate per arm (scripts/sweep.py --tune / --tuned), each arm's tuning
grid with its pick and the shared-rate and tuned-rate comparisons side by side.

    python scripts/study_report.py --root runs/STUDY [--study experiments/STUDY.py]

Reads ROOT/study.json (written by scripts/sweep.py) and every run directory under ROOT, and
writes ROOT/report.md with its plots: `train.studies.report`, whose module docstring says what
it reads and writes (docs/studies.md). --study gives the study file when ROOT has no study.json
(its first scale, every cell, its SEEDS), or newer declarations (baseline, paper numbers,
claims) than those recorded.

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
    args = parser.parse_args(argv)
    try:
        studies.check_root(args.root, args.study)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.studies import report  # JAX loads here, after the checks

    try:
        description = report.describe(args.root, args.study)
        written = report.write_report(args.root, description)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
