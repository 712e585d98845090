"""Tokenize a corpus into ArrayRecord shards with metadata, in parallel and resumably.

    python scripts/prepare_data.py --source kjv --tokenizer hf:runs/bpe --out runs/kjv-bpe \
        [--workers K] [--docs_per_shard N]

A thin command line over `train.data.shards.prepare_main`; the format and how training streams it:
`train/data/shards.py` and docs/data.md. Train on it with --config.data.name=prepared
--config.data.path=runs/kjv-bpe --config.data.tokenizer=hf:runs/bpe.
"""

import sys

from train.data.shards import prepare_main

if __name__ == "__main__":
    sys.exit(prepare_main())
