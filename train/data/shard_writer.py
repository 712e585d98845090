"""Writing one shard of a prepared dataset (`train.data.preparation.prepare`'s worker processes).

Kept apart from `train.data.preparation` so that a spawned worker imports only numpy,
array_record and the tokenizers, not tfds or grain: starting K workers then costs well under a
second each.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from array_record.python.array_record_module import ArrayRecordWriter

from train.data.tokenizer import Tokenizer, load_tokenizer

WRITER_OPTIONS = "group_size:1,zstd:1"  # one record per chunk: random access to each document


def shard_name(split: str, index: int) -> str:
    """File stem of shard ``index`` of ``split``: train-00003."""
    return f"{split}-{index:05d}"


WORKER_TOKENIZER: Tokenizer | None = None


def init_worker(tokenizer_spec: str) -> None:
    """Load the tokenizer once per worker process."""
    global WORKER_TOKENIZER
    WORKER_TOKENIZER = load_tokenizer(tokenizer_spec)


def write_shard(out_dir: str, split: str, index: int, texts: list[str],
                tokenizer_spec: str) -> dict:
    """Tokenize ``texts`` and write shard (``split``, ``index``) atomically; its stats."""
    tokenizer = WORKER_TOKENIZER or load_tokenizer(tokenizer_spec)
    dtype = tokenizer.token_dtype().newbyteorder("<")
    name = shard_name(split, index)
    records = [ids.astype(dtype) for ids in tokenizer.encode_batch(texts)]
    path = Path(out_dir) / f"{name}.array_record"
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    writer = ArrayRecordWriter(str(temporary), WRITER_OPTIONS)
    for record in records:
        writer.write(record.tobytes())
    writer.close()
    os.replace(temporary, path)
    stats = {"file": path.name, "documents": len(records),
             "tokens": int(sum(len(r) for r in records)),
             "text_bytes": int(sum(len(t.encode("utf-8")) for t in texts)),
             "file_size": path.stat().st_size, "sha256": sha256_of(path),
             "lengths": [len(r) for r in records]}
    stats_path = Path(out_dir) / f"{name}.json"
    stats_path.with_suffix(".json.tmp").write_text(json.dumps(stats))
    os.replace(stats_path.with_suffix(".json.tmp"), stats_path)
    return {"split": split, "index": index, **stats}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
