"""The report of a study sweep: final losses per arm with seed spreads and paired differences to
the baseline, loss curves, and for scaling studies power-law fits and compute multipliers.

    python scripts/study_report.py --root runs/STUDY [--study experiments/STUDY.py]

A thin command line over `train/studies/report.py`, whose docstring says what it reads and writes
(docs/studies.md).
"""

import sys

from train.studies.report import main

if __name__ == "__main__":
    sys.exit(main())
