"""Block pruning with healing: loss after pruning and after LoRA healing against the fraction of
blocks removed, for Block Influence and angular-distance selection.

    python scripts/prune_heal.py --workdir RUN --out DIR [--fractions 0.125,0.25,0.5]
        [--selection influence,angular] [--heal_steps 200] [--rank 8]

A thin command line over `train/instruments/pruning_report.py` (`main_blocks`), whose docstring
says what it measures and writes.
"""

import sys

from train.instruments.pruning_report import main_blocks

if __name__ == "__main__":
    sys.exit(main_blocks())
