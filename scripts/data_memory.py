"""The memory-bound demonstration: peak RSS of training as the dataset grows 1×, 10×, 100×.

    python scripts/data_memory.py --out runs/data_memory [--scales 1,10,100] [--steps 20]

A thin command line over `train/data/memory.py`, whose docstring says what it runs and prints.
"""

import sys

from train.data.memory import main

if __name__ == "__main__":
    sys.exit(main())
