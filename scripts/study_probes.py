"""Per-depth probes across a study: every run of a sweep, or every cell's initialization.

    python scripts/study_probes.py --root runs/STUDY [--study experiments/STUDY.py]
        [--initialization] [--batch 16] [--sparsity_threshold 0.01]

A thin command line over `train/studies/study_probes.py`, whose docstring says what it
measures and writes.
"""

import sys

from train.studies.study_probes import main

if __name__ == "__main__":
    sys.exit(main())
