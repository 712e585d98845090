"""The instrument panel of a run: accounting, per-depth probes, pruning, head ablation, the softmax
bottleneck and compiled memory, as a Markdown report with PNG plots and a JSON file of every number.

    python scripts/probe_report.py --workdir runs/X [--out DIR] [--batch 8] [--seq_len T]
        [--prune 1] [--bottleneck_tokens M] [--sparsity_threshold 0.01]

A thin command line over `train/instruments/probe_report.py` (the same as
`python -m train.instruments.probe_report`), whose docstring says what it measures and writes.
"""

import sys

from train.instruments.probe_report import main

if __name__ == "__main__":
    sys.exit(main())
