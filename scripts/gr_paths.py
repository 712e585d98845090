"""Path decomposition of Gated Residual reads: each write's contribution to each later read.

    python scripts/gr_paths.py --workdir runs/X [--out gr_paths.png] [--batch 4] [--seq_len 128]
        [--step N]

A thin command line over `train/instruments/gr_paths.py` (the same as
`python -m train.instruments.gr_paths`), whose docstring defines what it computes and writes.
"""

import sys

from train.instruments.gr_paths import main

if __name__ == "__main__":
    sys.exit(main())
