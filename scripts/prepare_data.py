"""Tokenize a corpus into ArrayRecord shards with metadata, in parallel and resumably.

    python scripts/prepare_data.py --source kjv --tokenizer hf:runs/bpe --out runs/kjv-bpe \
        [--workers K] [--docs_per_shard N] [--validation_every N] [--text_key KEY]
        [--data_dir DIR]

Tokenizes SOURCE into shards in OUT (`train.data.preparation.prepare`); rerun with the same
arguments to resume. The format: `train/data/preparation.py`; how training streams it:
`train/data/shards.py` and docs/data.md.
Train on it with --config.data.name=prepared --config.data.path=runs/kjv-bpe
--config.data.tokenizer=hf:runs/bpe.

The arguments (the source, the tokenizer, OUT and the counts) and OUT's plan prepare.json (the
arguments of an earlier preparation, when resuming) are checked before the data libraries load:
a bad one, or a damaged plan, is one line on stderr and exit status 2. Then the source is opened
and its first document read before the plan is written: a tfds dataset that is not prepared, a
directory that is not a saved dataset or a --text_key that a parquet file, saved dataset or tfds
dataset lacks is one line, and OUT stays as it was.
"""

from __future__ import annotations

import os
import sys

from config import ConfigError
from config.cli import ArgumentParser, positive_int
from train.data.arguments import check_source, output_directory, read_plan
from train.data.tokenizer import load_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/prepare_data.py", __doc__)
    parser.add_argument("--source", required=True,
                        help="kjv, tfds:NAME, hf_disk:PATH (a datasets save_to_disk "
                        "directory), or comma-separated .txt/.jsonl/.parquet globs")
    parser.add_argument("--tokenizer", default="byte",
                        help="byte, hf:PATH or sentencepiece:PATH (as data.tokenizer)")
    parser.add_argument("--out", required=True, help="directory of the shards")
    parser.add_argument("--workers", type=positive_int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="tokenizing processes")
    parser.add_argument("--docs_per_shard", type=positive_int, default=None,
                        help="documents per shard (default: train.data.preparation."
                             "DEFAULT_DOCS_PER_SHARD)")
    parser.add_argument("--validation_every", type=positive_int, default=None,
                        help="files: every N-th document is validation (default: "
                             "train.data.sources.DEFAULT_VALIDATION_EVERY)")
    parser.add_argument("--text_key", default="text",
                        help="field of .jsonl / tfds records, column of parquet / hf_disk")
    parser.add_argument("--data_dir", default="", help="tfds data dir for tfds:NAME")
    args = parser.parse_args(argv)
    try:
        check_source(args.source)
        load_tokenizer(args.tokenizer)
        output_directory(args.out)
        read_plan(args.out)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    # grain and tensorflow_datasets load here, after the checks
    from train.data import preparation, sources

    counts = {name: value for name, value in (("docs_per_shard", args.docs_per_shard),
                                               ("validation_every", args.validation_every))
              if value is not None}
    try:
        # The source opens and yields its first document before prepare writes its plan, so a
        # source that cannot be read leaves no plan behind to refuse the corrected command.
        documents = sources.read_documents(args.source, sources.SourceReport(warn=lambda _: None),
                                           text_key=args.text_key, data_dir=args.data_dir)
        next(documents, None)
        documents.close()
        metadata = preparation.prepare(args.source, args.tokenizer, args.out,
                                       workers=args.workers, text_key=args.text_key,
                                       data_dir=args.data_dir, **counts)
    except (ConfigError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(preparation.describe(metadata))
    print(f"train on it with --config.data.name=prepared --config.data.path={args.out} "
          f"--config.data.tokenizer={args.tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
