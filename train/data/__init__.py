"""Data: the in-memory pipeline from corpora to batches (`pipeline`), tokenizers (`tokenizer`),
prepared ArrayRecord shards and their streaming loader (`shards`, `shard_writer`), the
memory-bound demonstration (`memory`), and the checks of the scripts' arguments that need no
heavy import (`arguments`). The trainer's core imports it; it imports nothing of the trainer but
the run directory's guards (`train.rundir`: its file lock, and what `arguments` reads of a run)."""
