"""What the command lines over the instruments share once their arguments are parsed, without
JAX: a script imports this module before JAX loads, and JAX loads only in the `run` it passes,
once its arguments are checked. The parsers stay with the scripts (`config.cli` holds the
options they share).

- `checked_run(check, run)`: `check()` reads the arguments (a `ConfigError` is one line on
  stderr and exit status 2), then `run` of what it returned gives the exit status
  (scripts/prune_heal.py, scripts/prune_heads.py, `heatmap_run`);
- `heatmap_run`: an instrument that draws heatmaps of a saved run on one batch
  (scripts/depth_mixing.py, scripts/gr_paths.py; options from `config.cli.analysis_parser`),
  its arguments checked against the run's config.json (`train.rundir.saved_run`,
  `train.data.arguments.check_analysis`, `output_file`); a run that does not restore is one
  line and exit status 2 as well.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from config import ConfigError
from train.data.arguments import check_analysis, output_file
from train.rundir import saved_run

Checked = TypeVar("Checked")

# run(workdir, out, batch, seq_len, step) -> exit status: the script's instrument, imported in it
HeatmapRun = Callable[[str, Path, int, int | None, int | None], int]


def checked_run(check: Callable[[], Checked], run: Callable[[Checked], int]) -> int:
    """`run(check())`, or 2 with `error: MESSAGE` on stderr when `check` raises a ConfigError."""
    try:
        checked = check()
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return run(checked)


def heatmap_run(args: argparse.Namespace, default_out: str, run: HeatmapRun) -> int:
    """The exit status of a heatmap command line with the parsed options of
    `config.cli.analysis_parser` (--out None: WORKDIR/`default_out`): 2 with one line on stderr
    for a bad argument or a run that does not restore, else `run`'s."""
    out = Path(args.out) if args.out else Path(args.workdir) / default_out

    def check() -> None:
        check_analysis(saved_run(args.workdir, args.step), args.batch, args.seq_len)
        output_file(out)

    def measure(_: None) -> int:
        try:
            return run(args.workdir, out, args.batch, args.seq_len, args.step)
        except (FileNotFoundError, ConfigError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return checked_run(check, measure)
