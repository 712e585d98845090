"""Depth-mixing heatmaps of a trained run: which sources each sublayer reads, how it writes.

    python scripts/depth_mixing.py --workdir runs/X [--out mixing.png] [--batch 4] [--seq_len 128]
        [--step N]

Restores the run's newest checkpoint in --workdir (or the one at --step), runs the model on the
first --batch validation sequences of --seq_len tokens (default: the run's seq_len; --batch a
multiple of the local devices) and writes one heatmap per quantity its residual mechanism
records to --out (default WORKDIR/mixing.png), the numbers to the JSON beside it, and prints the
summaries: `train.instruments.depth_mixing.run`, whose module docstring says what it plots.

Exit status: 0 done; 1 the mechanism records nothing (a plain sum); 2 a bad argument or a run
that does not restore, one line on stderr. The arguments are checked against the run's
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
    parser = ArgumentParser("python scripts/depth_mixing.py", __doc__)
    parser.add_argument("--workdir", required=True, help="the run directory")
    parser.add_argument("--out", default=None, help="PNG path; default WORKDIR/mixing.png")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=None, help="default: the run's seq_len")
    parser.add_argument("--step", type=int, default=None,
                        help="the checkpoint to read; default: the newest")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.workdir) / "mixing.png"
    try:
        check_analysis(saved_run(args.workdir, args.step), args.batch, args.seq_len)
        output_file(out)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.instruments import depth_mixing  # JAX loads here, after the checks

    try:
        return depth_mixing.run(args.workdir, out, args.batch, args.seq_len, args.step)
    except (FileNotFoundError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
