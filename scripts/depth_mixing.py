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

from config.cli import analysis_parser
from train.instruments.command_line import heatmap_run

OUT = "mixing.png"  # default --out, in the run directory


def run(workdir: str, out: Path, batch: int, seq_len: int | None, step: int | None) -> int:
    """`train.instruments.depth_mixing.run` once the arguments are checked; its exit status."""
    from train.instruments import depth_mixing  # JAX loads here, after the checks

    return depth_mixing.run(workdir, out, batch, seq_len, step)


def main(argv: list[str] | None = None) -> int:
    parser = analysis_parser("python scripts/depth_mixing.py", __doc__, OUT)
    return heatmap_run(parser.parse_args(argv), OUT, run)


if __name__ == "__main__":
    sys.exit(main())
