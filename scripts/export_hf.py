"""Export a run as a Hugging Face checkpoint that `transformers` loads.

    python scripts/export_hf.py --workdir RUN --out DIR

A thin command line over `train/interop/export_hf.py` (the same as
`python -m train.interop.export_hf`), whose docstring says what it reads and writes.
"""

import sys

from train.interop.export_hf import main

if __name__ == "__main__":
    sys.exit(main())
