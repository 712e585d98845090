"""The memory-bound demonstration: peak RSS of training as the dataset grows 1×, 10×, 100×.

    python scripts/data_memory.py --out runs/data_memory [--scales 1,10,100] [--steps 20]
        [--workers 2]

For each scale, trains the quickstart model for --steps steps from prepared shards and from the
corpus read into memory, and prints one JSON line per run (`train.data.memory.run`, whose module
docstring says what it runs and prints); all of them go to OUT/data_memory.json. Exit status: 0
every run finished, 1 a training run failed, 2 a bad argument (one line, before the data
libraries load).
"""

from __future__ import annotations

import sys

from config import ConfigError
from config.cli import ArgumentParser, positive_int
from train.data.arguments import output_directory


def scales_of(text: str) -> list[int]:
    """The corpus repetitions of `--scales 1,10,100`; a one-line ConfigError for anything but
    positive ints."""
    try:
        scales = [int(part) for part in text.split(",")]
    except ValueError:
        scales = []
    if not scales or min(scales) < 1:
        raise ConfigError(f"--scales={text} is invalid: pass comma-separated positive ints, e.g. "
                          "--scales 1,10,100")
    return scales


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/data_memory.py", __doc__)
    parser.add_argument("--out", required=True, help="directory for corpora, shards and runs")
    parser.add_argument("--scales", default="1,10,100", help="corpus repetitions")
    parser.add_argument("--steps", type=positive_int, default=20)
    parser.add_argument("--workers", type=positive_int, default=2, help="tokenizing processes")
    args = parser.parse_args(argv)
    try:
        scales = scales_of(args.scales)
        output_directory(args.out)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.data import memory  # grain and tensorflow_datasets load here, after the checks

    return memory.run(args.out, scales, args.steps, args.workers)


if __name__ == "__main__":
    sys.exit(main())
