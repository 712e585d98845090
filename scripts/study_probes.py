"""Per-depth probes across a study: every run of a sweep, or every cell's initialization.

    python scripts/study_probes.py --root runs/STUDY [--study experiments/STUDY.py]
        [--initialization] [--batch 16] [--sparsity_threshold 0.01]

For each (cell, seed) of ROOT/study.json (or of --study, as in scripts/study_report.py), the
newest checkpoint of the finished run ROOT/<cell>/seed<k>, or with --initialization the model
that run starts from (no run needs to exist), is measured on the first --batch validation
sequences; --sparsity_threshold: |a| below it counts as inactive (default 0.01,
`train.instruments.probes.DEFAULT_SPARSITY_THRESHOLD`). Writes ROOT/probes.json, probes.md and
the plots (probes_init.* with --initialization): `train.studies.study_probes`, whose module
docstring says what it measures and writes.

Progress goes to stderr, one line per run. Exit status: 0 done; 2 a bad argument, study or
record, one line on stderr. The arguments are checked before JAX loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from config import ConfigError
from config.cli import ArgumentParser, UsageError, positive_int
from train.data.arguments import output_directory
from train.studies import study as studies


def check_study(root: str, study: str | None, initialization: bool) -> None:
    """ROOT (a directory; at initialization, one that can be created) holds a readable
    study.json, or --study names a study file: one-line UsageError."""
    if initialization:
        try:
            output_directory(root, "--root")
        except ConfigError as error:
            raise UsageError(str(error)) from None
    studies.check_root(root, study, exists=not initialization)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/study_probes.py", __doc__)
    parser.add_argument("--root", required=True, metavar="DIR", help="the sweep's directory")
    parser.add_argument("--study", metavar="PATH", help="the study file (default: study.json's)")
    parser.add_argument("--initialization", action="store_true",
                        help="probe each cell's step-0 model instead of the trained runs")
    parser.add_argument("--batch", type=positive_int, default=16,
                        help="validation sequences per probe")
    parser.add_argument("--sparsity_threshold", type=float, default=None,
                        help="|a| below this counts as inactive (default 0.01)")
    args = parser.parse_args(argv)
    try:
        check_study(args.root, args.study, args.initialization)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.instruments.probes import DEFAULT_SPARSITY_THRESHOLD  # JAX loads here
    from train.studies import report, study_probes

    threshold = (DEFAULT_SPARSITY_THRESHOLD if args.sparsity_threshold is None
                 else args.sparsity_threshold)
    root = Path(args.root)
    try:
        description = report.describe(root, args.study)
        root.mkdir(parents=True, exist_ok=True)
        path = study_probes.write(root, description, args.initialization, args.batch, threshold)
    except (FileNotFoundError, ValueError) as error:  # ConfigError, UsageError: ValueErrors
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
