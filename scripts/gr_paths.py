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

from config.cli import analysis_parser
from train.instruments.command_line import heatmap_run

OUT = "gr_paths.png"  # default --out, in the run directory


def run(workdir: str, out: Path, batch: int, seq_len: int | None, step: int | None) -> int:
    """`train.instruments.gr_paths.run` once the arguments are checked; its exit status."""
    from train.instruments import gr_paths  # JAX loads here, after the checks

    gr_paths.run(workdir, out, batch, seq_len, step)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = analysis_parser("python scripts/gr_paths.py", __doc__, OUT)
    return heatmap_run(parser.parse_args(argv), OUT, run)


if __name__ == "__main__":
    sys.exit(main())
