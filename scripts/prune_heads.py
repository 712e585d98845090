"""Head pruning (Michel et al. 2019): loss against the fraction of heads pruned by iterative
gradient importance, and the train and decode step speedups of the physically pruned model.

    python scripts/prune_heads.py --workdir RUN --out DIR
        [--structures heads,per_group,whole_groups] [--step_fraction 0.1] [--timing_steps 10]

A thin command line over `train/instruments/pruning_report.py` (`main_heads`), whose docstring
says what it measures and writes.
"""

import sys

from train.instruments.pruning_report import main_heads

if __name__ == "__main__":
    sys.exit(main_heads())
