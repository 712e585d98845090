"""Data: the in-memory pipeline from corpora to batches (`pipeline`), tokenizers (`tokenizer`),
prepared ArrayRecord shards and their streaming loader (`shards`, `shard_writer`), and the
memory-bound demonstration (`memory`). The trainer's core imports it; it imports nothing of the
trainer but the run directory's file lock (`train.rundir`)."""
