"""Post-training quantization of a run (int8, LLM.int8(), GPTQ 4/3-bit).

    python scripts/quantize.py --workdir RUN --method int8|llm_int8|gptq4|gptq3|int4|int3 \
        --out RUN_Q [--group_size G] [--calibration_batches N] [--threshold 6.0] [--measure]

A thin command line over `train/interop/quantize.py` (the same as
`python -m train.interop.quantize`), whose docstring says what it reads and writes.
"""

import sys

from train.interop.quantize import main

if __name__ == "__main__":
    sys.exit(main())
