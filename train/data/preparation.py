"""Preparing a pre-tokenized dataset: a source tokenized into ArrayRecord shards, resumably.

The command lines: scripts/prepare_data.py (`prepare`) and scripts/train_tokenizer.py
(`train_tokenizer`).

Preparation (:func:`prepare`) reads documents from a source (`train.data.sources.read_documents`),
sends them in shards of ``docs_per_shard`` to worker processes (`train.data.shard_writer`) that
tokenize and write ``<split>-<k>.array_record`` (one record per document: its token ids,
little-endian, in the tokenizer's smallest unsigned dtype) and ``<split>-<k>.json`` (document
and token counts, text bytes, the record lengths, the file's size and SHA-256). A shard is
written under a temporary name and renamed: a killed preparation, rerun with the same arguments,
keeps the shards whose ``.json`` exists and writes only the others. It ends with
``metadata.json`` (the tokenizer's spec and fingerprint, the counts of each split, skipped
records and a content hash) and ``<split>-index.npy``, each document's start in the packed
stream (int64, memory-mapped when read). How training reads them: `train.data.shards`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from config import ConfigError
from train.data.arguments import read_json_object, read_plan
from train.data.in_memory import SPLITS
from train.data.shard_writer import init_worker, shard_name, write_shard
from train.data.shards import prepared_texts
from train.data.sources import (
    DEFAULT_VALIDATION_EVERY,
    Document,
    SourceReport,
    count_documents,
    read_documents,
)
from train.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

FORMAT_VERSION = 1
DEFAULT_DOCS_PER_SHARD = 4096


def _shard_jobs(documents: Iterator[Document], docs_per_shard: int
                ) -> Iterator[tuple[str, int, list[str]]]:
    """(split, shard index, texts): each split's documents in consecutive groups."""
    buffers: dict[str, list[str]] = {split: [] for split in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    for document in documents:
        buffer = buffers[document.split]
        buffer.append(document.text)
        if len(buffer) == docs_per_shard:
            yield document.split, counts[document.split], buffer
            counts[document.split] += 1
            buffers[document.split] = []
    for split in SPLITS:
        if buffers[split]:
            yield split, counts[split], buffers[split]


def prepare(source: str, tokenizer_spec: str, out_dir: str | Path, *, workers: int = 1,
            docs_per_shard: int = DEFAULT_DOCS_PER_SHARD,
            validation_every: int = DEFAULT_VALIDATION_EVERY, text_key: str = "text",
            data_dir: str = "", progress: bool = True,
            warn: Callable[[str], None] | None = None) -> dict:
    """Tokenize ``source`` with ``tokenizer_spec`` into shards in ``out_dir`` (see the module
    docstring); resumable; returns the metadata it writes to ``out_dir/metadata.json``."""
    if docs_per_shard <= 0:
        raise ConfigError(f"--docs_per_shard={docs_per_shard} is invalid: must be positive")
    if workers <= 0:
        raise ConfigError(f"--workers={workers} is invalid: must be positive")
    tokenizer = load_tokenizer(tokenizer_spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = {"format": FORMAT_VERSION, "source": source, "tokenizer": tokenizer.spec,
            "tokenizer_fingerprint": tokenizer.fingerprint, "docs_per_shard": docs_per_shard,
            "validation_every": validation_every, "text_key": text_key}
    plan_path = out / "prepare.json"
    previous = read_plan(out)
    if previous is not None:
        if previous != plan:
            changed = ", ".join(f"{k}={previous.get(k)!r}" for k in sorted(plan)
                                if previous.get(k) != plan[k])
            raise ConfigError(f"--out={out} is invalid: it holds a preparation with other "
                              f"settings ({changed}); use a new --out or the same arguments to "
                              "resume")
    else:
        plan_path.write_text(json.dumps(plan, indent=2) + "\n")
    report = SourceReport(warn=warn) if warn else SourceReport()
    documents = read_documents(source, report, text_key=text_key,
                               validation_every=validation_every, data_dir=data_dir)
    total_documents = count_documents(source, data_dir)
    shards: dict[tuple[str, int], dict] = {}
    kept = tokens = documents_done = documents_now = 0
    started = time.perf_counter()
    last_report = started

    def show(final: bool = False) -> None:
        nonlocal last_report
        now = time.perf_counter()
        if progress and (final or now - last_report > 2.0):
            last_report = now
            elapsed = max(now - started, 1e-9)
            remaining = max(0, total_documents - documents_done) * elapsed / max(documents_now, 1)
            print(f"prepare: {len(shards)} shards ({kept} kept from before), {documents_done:,}/"
                  f"~{total_documents:,} documents, {tokens:,} tokens, {tokens / elapsed:,.0f} "
                  f"tokens/s, ETA {time.strftime('%H:%M:%S', time.gmtime(remaining))}",
                  file=sys.stderr, flush=True)

    context = multiprocessing.get_context("spawn")  # the parent may have started threads
    pool_type = (concurrent.futures.ThreadPoolExecutor if workers == 1  # no process to start
                 else functools.partial(concurrent.futures.ProcessPoolExecutor,
                                        mp_context=context))
    with pool_type(workers, initializer=init_worker, initargs=(tokenizer_spec,)) as pool:
        pending: set[concurrent.futures.Future] = set()

        def collect(block: bool) -> None:
            nonlocal pending, tokens, documents_done, documents_now
            if not pending:
                return
            done, pending = concurrent.futures.wait(
                pending, return_when=concurrent.futures.FIRST_COMPLETED if block else
                concurrent.futures.ALL_COMPLETED)
            for future in done:
                stats = future.result()
                shards[stats["split"], stats["index"]] = stats
                tokens += stats["tokens"]
                documents_done += stats["documents"]
                documents_now += stats["documents"]
            show()

        for split, index, texts in _shard_jobs(documents, docs_per_shard):
            stats = _finished_shard(out, shard_name(split, index))
            if stats is not None and stats["documents"] == len(texts):  # not rewritten
                shards[split, index] = {"split": split, "index": index, **stats}
                kept += 1
                documents_done += stats["documents"]
                continue
            pending.add(pool.submit(write_shard, str(out), split, index, texts, tokenizer_spec))
            if len(pending) >= 2 * workers:  # bounded: at most 2 shards per worker in flight
                collect(block=True)
        collect(block=False)
    show(final=True)
    return _finish(out, plan, tokenizer, shards, report, time.perf_counter() - started)


# The fields of a shard's statistics `<split>-<k>.json` that resuming relies on, with their types.
_SHARD_STATS = {"file": str, "documents": int, "tokens": int, "text_bytes": int,
                "file_size": int, "sha256": str, "lengths": list}


def _finished_shard(out: Path, name: str) -> dict | None:
    """The statistics of shard `name` written by an earlier preparation into `out`, or None
    when it did not finish (its .array_record or .json is missing); ConfigError naming a
    damaged .json and the fix (it is left as is)."""
    path = out / f"{name}.json"
    if not (path.exists() and (out / f"{name}.array_record").exists()):
        return None
    what, fix = f"--out={out} is invalid", (f"delete it and {name}.array_record and rerun with "
                                            "the same arguments (finished shards are kept)")
    stats = read_json_object(path, what, fix)
    for field, kind in _SHARD_STATS.items():
        value = stats.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            found = f"no {field}" if field not in stats else \
                f"{field}={value!r}, not {'an integer' if kind is int else f'a {kind.__name__}'}"
            raise ConfigError(f"{what}: {path} is damaged ({found}); it is left as is: {fix}")
    return stats


def _finish(out: Path, plan: dict, tokenizer: Tokenizer, shards: dict[tuple[str, int], dict],
            report: SourceReport, seconds: float) -> dict:
    """Write each split's document index and metadata.json."""
    splits = {}
    for split in SPLITS:
        entries = [shards[key] for key in sorted(k for k in shards if k[0] == split)]
        lengths = np.array([n for e in entries for n in e["lengths"]], dtype=np.int64)
        starts = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths + 1, out=starts[1:])  # + 1: the separator after each document
        index_path = out / f"{split}-index.npy"
        with open(f"{index_path}.tmp", "wb") as f:
            np.save(f, starts)
        os.replace(f"{index_path}.tmp", index_path)
        splits[split] = {
            "documents": int(len(lengths)), "tokens": int(lengths.sum()),
            "text_bytes": int(sum(e["text_bytes"] for e in entries)),
            "longest_document": int(lengths.max(initial=0)),
            "shards": [{k: e[k] for k in ("file", "documents", "tokens", "text_bytes",
                                            "file_size", "sha256")} for e in entries]}
    content = hashlib.sha256(json.dumps(
        [[s["sha256"] for s in splits[split]["shards"]] for split in SPLITS]).encode())
    metadata = {**plan, "vocab_size": tokenizer.vocab_size, "separator": tokenizer.separator,
                "dtype": tokenizer.token_dtype().name, "splits": splits,
                "skipped_records": report.skipped, "empty_documents": report.empty,
                "content_hash": content.hexdigest(), "seconds": round(seconds, 3)}
    path = out / "metadata.json"
    path.with_suffix(".json.tmp").write_text(json.dumps(metadata, indent=2) + "\n")
    os.replace(path.with_suffix(".json.tmp"), path)
    return metadata


def describe(metadata: dict) -> str:
    """One line per split: documents, tokens, bytes per token."""
    lines = []
    for split, info in metadata["splits"].items():
        per_token = info["text_bytes"] / max(info["tokens"], 1)
        lines.append(f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens in "
                     f"{len(info['shards'])} shards ({per_token:.2f} bytes/token)")
    lines.append(f"skipped records: {metadata['skipped_records']}, empty documents: "
                 f"{metadata['empty_documents']}; content hash {metadata['content_hash'][:16]}")
    return "\n".join(lines)


def train_tokenizer(data: str, vocab_size: int, out_dir: str | Path, *, text_key: str = "text",
                    max_documents: int = 0) -> Path:
    """A byte-level BPE (`train.data.tokenizer.train_bpe`) of ``vocab_size`` tokens trained on
    the train split of ``data`` (a source of `read_documents`, or a prepared directory), at most
    ``max_documents`` of them (0: all); writes ``out_dir/tokenizer.json`` and returns its path.
    The command line: scripts/train_tokenizer.py."""
    if (Path(data) / "metadata.json").is_file():
        texts = prepared_texts(data)
    else:
        texts = (d.text for d in read_documents(data, SourceReport(), text_key=text_key)
                 if d.split == "train")
    if max_documents:
        texts = itertools.islice(texts, max_documents)
    return train_bpe(texts, vocab_size, out_dir)
