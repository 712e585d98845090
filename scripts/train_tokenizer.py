"""Train a byte-level BPE tokenizer offline, for a subword run.

    python scripts/train_tokenizer.py --data kjv --vocab_size 4096 --out runs/bpe

A thin command line over `train.data.shards.train_tokenizer_main` (BPE training itself:
`train.data.tokenizer.train_bpe`). Train on it with --config.data.tokenizer=hf:runs/bpe.
"""

import sys

from train.data.shards import train_tokenizer_main

if __name__ == "__main__":
    sys.exit(train_tokenizer_main())
