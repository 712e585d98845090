"""Train a byte-level BPE tokenizer offline, for a subword run.

    python scripts/train_tokenizer.py --data kjv --vocab_size 4096 --out runs/bpe
        [--text_key KEY] [--max_documents N]

Trains a byte-level BPE (`train.data.tokenizer.train_bpe`) on the train split of --data (kjv,
tfds:NAME, hf_disk:PATH, .txt/.jsonl/.parquet globs, or a prepared directory:
`train.data.preparation.train_tokenizer`) and writes OUT/tokenizer.json, which
--config.data.tokenizer=hf:OUT names.

The arguments (the data, the vocabulary size, OUT) are checked before the data libraries load: a
bad one is one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from config import ConfigError
from config.cli import ArgumentParser
from train.data.arguments import check_source, output_directory
from train.data.tokenizer import check_bpe_vocab_size, load_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/train_tokenizer.py", __doc__)
    parser.add_argument("--data", required=True,
                        help="kjv, tfds:NAME, hf_disk:PATH, .txt/.jsonl/.parquet globs, or a "
                        "prepared directory")
    parser.add_argument("--vocab_size", type=int, required=True)
    parser.add_argument("--out", required=True, help="directory for tokenizer.json")
    parser.add_argument("--text_key", default="text",
                        help="field of .jsonl records, column of parquet / hf_disk")
    parser.add_argument("--max_documents", type=int, default=0, help="0: all of them")
    args = parser.parse_args(argv)
    try:
        if not (Path(args.data) / "metadata.json").is_file():
            check_source(args.data, "--data")
        check_bpe_vocab_size(args.vocab_size)
        if args.max_documents < 0:
            raise ConfigError(f"--max_documents={args.max_documents} is invalid: must be ≥ 0 "
                              "(0: all of them)")
        output_directory(args.out)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.data.preparation import train_tokenizer  # grain and tensorflow_datasets load here

    started = time.perf_counter()
    try:
        path = train_tokenizer(args.data, args.vocab_size, args.out, text_key=args.text_key,
                               max_documents=args.max_documents)
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    vocab = load_tokenizer(f"hf:{path}").vocab_size
    print(f"wrote {path} ({vocab} tokens, {time.perf_counter() - started:.1f} s); use it with "
          f"--config.data.tokenizer=hf:{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
