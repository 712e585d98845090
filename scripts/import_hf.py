"""Import a local Hugging Face checkpoint as a blockbench run directory.

    python scripts/import_hf.py --checkpoint DIR --workdir OUT [--seq_len N]

A thin command line over `train/interop/import_hf.py` (the same as
`python -m train.interop.import_hf`), whose docstring says what it reads and writes.
"""

import sys

from train.interop.import_hf import main

if __name__ == "__main__":
    sys.exit(main())
