"""Path decomposition of Gated Residual reads: each write's contribution to each later read.

    python scripts/gr_paths.py --workdir runs/X [--out gr_paths.png] [--batch 4] [--seq_len 128]
        [--step N]

Restores the run's newest checkpoint in --workdir (or the one at --step), runs the model on the
first --batch validation sequences of --seq_len tokens (default: the run's seq_len; --batch a
multiple of the local devices) and writes the heatmaps of the contributions to --out (default
WORKDIR/gr_paths.png), the numbers to the JSON beside it, and prints a summary line:
`train.instruments.gr_paths.run`, whose module docstring defines what it computes. The captured
terms take about (4n + 3)·B·T·d float32 values per sublayer: keep --batch and --seq_len small.

Exit status: 0 done; 2 a bad argument, a run that does not restore or a mechanism without read
gates and write strengths, one line on stderr. The arguments are checked against the run's
config.json before JAX loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from config import ConfigError
from config.cli import ArgumentParser
from train.data.arguments import check_analysis, output_file
from train.rundir import saved_run


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/gr_paths.py", __doc__)
    parser.add_argument("--workdir", required=True, help="the run directory")
    parser.add_argument("--out", default=None, help="PNG path; default WORKDIR/gr_paths.png")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=None, help="default: the run's seq_len")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint to read; default: the newest")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.workdir) / "gr_paths.png"
    try:
        check_analysis(saved_run(args.workdir, args.step), args.batch, args.seq_len)
        output_file(out)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.instruments import gr_paths  # JAX loads here, after the checks

    try:
        gr_paths.run(args.workdir, out, args.batch, args.seq_len, args.step)
    except (FileNotFoundError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
