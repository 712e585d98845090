"""Run every arm of a study over its seeds, here or through a cluster's launcher.

    python scripts/sweep.py --study experiments/STUDY.py --root runs/STUDY [--scale SCALE]
        [--seeds 0,1,2] [--arms A,B] [--sizes S,M] [--launch local|print|slurm|tpu]
        [-- --config.FIELD=VALUE ...]

A thin command line over `train/studies/sweep.py`, whose docstring says what it runs and writes
(docs/studies.md).
"""

import sys

from train.studies.sweep import main

if __name__ == "__main__":
    sys.exit(main())
