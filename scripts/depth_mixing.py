"""Depth-mixing heatmaps of a trained run: which sources each sublayer reads, how it writes.

    python scripts/depth_mixing.py --workdir runs/X [--out mixing.png] [--batch 4] [--seq_len 128]
        [--step N]

A thin command line over `train/instruments/depth_mixing.py` (the same as
`python -m train.instruments.depth_mixing`), whose docstring says what it plots and writes.
"""

import sys

from train.instruments.depth_mixing import main

if __name__ == "__main__":
    sys.exit(main())
