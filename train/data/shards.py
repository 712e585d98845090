"""Pre-tokenized datasets: preparation into ArrayRecord shards, and streaming reads by (seed, step).

The command lines: scripts/prepare_data.py (`prepare`) and scripts/train_tokenizer.py
(`train_tokenizer`).

Preparation (:func:`prepare`) reads documents from a source (:func:`read_documents`), sends
them in shards of ``docs_per_shard`` to worker processes that tokenize and write
``<split>-<k>.array_record`` (one record per document: its token ids, little-endian, in the
tokenizer's smallest unsigned dtype) and ``<split>-<k>.json`` (document and token counts,
text bytes, the record lengths, the file's size and SHA-256). A shard is written under a
temporary name and renamed: a killed preparation, rerun with the same arguments, keeps the
shards whose ``.json`` exists and writes only the others. It ends with ``metadata.json`` (the
tokenizer's spec and fingerprint, the counts of each split, skipped records and a content hash)
and ``<split>-index.npy``, each document's start in the packed stream (int64, memory-mapped
when read).

Reading (:class:`PreparedDataset`): the packed stream of a split is its documents joined by the
tokenizer's separator, as the in-memory byte pipeline joins them by ``\\n``; window ``w`` is
``stream[w·T : w·T + T + 1]``. With ``data.packing=False`` the windows are those that lie inside
one document instead. Batch ``step`` holds windows ``order[step·B + r]`` of a seeded grain
shuffle, re-drawn every epoch (`in_memory.window_order`), so a batch is a pure function of
(seed, step) and a process reads only its own rows' records. :meth:`PreparedDataset.batches`
streams them through a grain ``IterDataset`` whose threads read ``data.prefetch`` batches ahead
of the step. Memory is the records of the batches in flight, whatever the dataset's size.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import glob
import hashlib
import importlib
import itertools
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds
from array_record.python.array_record_module import ArrayRecordReader
from grain.sources import ArrayRecordDataSource

from config import ConfigError, check
from train.data import in_memory
from train.data.arguments import (
    check_index,
    prepared_metadata,
    read_json_object,
    read_plan,
    source_files,
)
from train.data.in_memory import SPLITS, kjv_file, window_order
from train.data.shard_writer import init_worker, sha256_of, shard_name, write_shard
from train.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_of, train_bpe

FORMAT_VERSION = 1
DEFAULT_DOCS_PER_SHARD = 4096
DEFAULT_VALIDATION_EVERY = 20  # every 20th document is validation (as the embedded corpus)


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of a source: its split, where it came from (file:line) and its text."""

    split: str
    origin: str
    text: str


@dataclasses.dataclass
class SourceReport:
    """What reading a source skipped: records that could not be read (with file and line)."""

    skipped: int = 0
    empty: int = 0
    warn: Callable[[str], None] = lambda message: print(message, file=sys.stderr)

    def skip(self, origin: str, reason: str) -> None:
        self.skipped += 1
        self.warn(f"warning: {origin}: {reason}; record skipped")


def _split_of(index: int, validation_every: int) -> str:
    return "validation" if validation_every and index % validation_every == validation_every - 1 \
        else "train"


def _kjv_documents(report: SourceReport) -> Iterator[Document]:
    """The embedded corpus: one document per chapter, every 20th chapter validation (as
    `train.data.in_memory.KjvBible`)."""
    path = kjv_file()
    with path.open("rb") as f:
        verses = [json.loads(line) for line in f if line.strip()]
    chapters = itertools.groupby(verses, key=lambda v: (v["book"], v["chapter"]))
    for index, ((book, chapter), chapter_verses) in enumerate(chapters):
        yield Document(_split_of(index, 20), f"{path}:{book} {chapter}",
                       " ".join(v["text"] for v in chapter_verses))


def _jsonl_documents(path: str, text_key: str, report: SourceReport) -> Iterator[tuple[str, str]]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            origin = f"{path}:{number}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                report.skip(origin, f"not valid JSON ({getattr(error, 'msg', error)})")
                continue
            text = record.get(text_key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                report.skip(origin, f"no string field {text_key!r} (set --text_key)")
                continue
            yield origin, text


def _text_document(path: str, report: SourceReport) -> Iterator[tuple[str, str]]:
    raw = Path(path).read_bytes()
    try:
        yield path, raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        report.skip(f"{path}:{line}", f"invalid UTF-8 at byte {error.start}")


def _optional(module: str, package: str, source: str) -> Any:
    """``module``, imported when a source needs it: a ConfigError naming ``package`` if absent."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"--source={source!r} is invalid: reading it needs the {package} "
                          f"package; pip install {package} (or pip install -e '.[data]')"
                          ) from None


def _row_texts(values: Iterator[Any], where: str, text_key: str, report: SourceReport
               ) -> Iterator[tuple[str, str]]:
    """(origin, text) of a column's values; ``where[i]`` names row ``i`` (from 0). A null, a
    non-string value or bytes that are not UTF-8 are reported and skipped."""
    for row, value in enumerate(values):
        origin = f"{where}[{row}]"
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as error:
                report.skip(origin, f"field {text_key!r} is not UTF-8 at byte {error.start}")
                continue
        if value is None:
            report.skip(origin, f"field {text_key!r} is null")
        elif not isinstance(value, str):
            report.skip(origin, f"field {text_key!r} is {type(value).__name__}, not a string "
                        "(set --text_key)")
        else:
            yield origin, value


def _parquet_documents(path: str, text_key: str, report: SourceReport, source: str
                       ) -> Iterator[tuple[str, str]]:
    """Column ``text_key`` of a parquet file, read one record batch at a time."""
    # pyarrow is optional (the default sources do not need it): imported only for parquet
    parquet = _optional("pyarrow.parquet", "pyarrow", source)
    try:
        file = parquet.ParquetFile(path)
    except Exception as error:  # pyarrow raises ArrowInvalid/OSError for a non-parquet file
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        report.skip(path, f"not a readable parquet file ({reason})")
        return
    columns = file.schema_arrow.names
    if text_key not in columns:
        raise ConfigError(f"--text_key={text_key!r} is invalid: {path} has columns "
                          f"{', '.join(columns)}")
    values = (value for batch in file.iter_batches(batch_size=1024, columns=[text_key])
              for value in batch.column(0).to_pylist())
    yield from _row_texts(values, path, text_key, report)


def _hf_disk_splits(path: str, source: str) -> dict[str, Any]:
    """The splits of a ``datasets`` dataset saved on disk, by the split they prepare: a saved
    ``Dataset`` is one split (``{"": dataset}``, divided by ``validation_every``); a saved
    ``DatasetDict`` gives its ``train`` and ``validation`` splits, and ``test`` as validation
    when it has no ``validation`` split; its other splits are not read."""
    # datasets is optional (the default sources do not need it): imported only for hf_disk:
    datasets = _optional("datasets", "datasets", source)
    try:
        loaded = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError, OSError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        raise ConfigError(f"--source={source!r} is invalid: {path} is not a dataset saved with "
                          f"datasets' save_to_disk ({reason})") from None
    if isinstance(loaded, datasets.Dataset):
        return {"": loaded}
    splits = {split: loaded[split] for split in SPLITS if split in loaded}
    if "validation" not in splits and "test" in loaded:
        splits["validation"] = loaded["test"]
    if not splits:
        raise ConfigError(f"--source={source!r} is invalid: {path} has splits "
                          f"{', '.join(loaded)}; it needs train, validation or test")
    return splits


def _hf_disk_documents(path: str, text_key: str, report: SourceReport,
                       validation_every: int) -> Iterator[Document]:
    source = f"hf_disk:{path}"
    splits = _hf_disk_splits(path, source)
    for dataset in splits.values():
        if text_key not in dataset.column_names:
            raise ConfigError(f"--text_key={text_key!r} is invalid: {source} has columns "
                              f"{', '.join(dataset.column_names)}")
    for name, dataset in splits.items():
        values = (value for batch in dataset.select_columns([text_key]).iter(batch_size=1024)
                  for value in batch[text_key])
        where = f"{source}/{name}" if name else source
        texts = _row_texts(values, where, text_key, report)
        for index, (origin, text) in enumerate(texts):
            yield Document(name or _split_of(index, validation_every), origin, text)


def _tfds_documents(name: str, data_dir: str, text_key: str) -> Iterator[Document]:
    for split in SPLITS:
        try:
            source = tfds.data_source(name, split=split, data_dir=data_dir or None,
                                      download=False)
        except Exception as error:  # tfds raises several types for "not prepared"
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
            raise ConfigError(f"--source=tfds:{name} is invalid: no prepared array_record tfds "
                              f"dataset in {data_dir or 'the default data dir'} ({reason}); "
                              f"prepare it with tfds build {name} --file_format=array_record"
                              ) from None
        if text_key not in source.dataset_info.features:
            raise ConfigError(f"--text_key={text_key!r} is invalid: tfds:{name} has features "
                              f"{', '.join(sorted(source.dataset_info.features))}")
        for i in range(len(source)):
            text = source[i][text_key]
            yield Document(split, f"tfds:{name}/{split}[{i}]",
                           text.decode("utf-8", errors="replace") if isinstance(text, bytes)
                           else str(text))


def read_documents(source: str, report: SourceReport, *, text_key: str = "text",
                   validation_every: int = DEFAULT_VALIDATION_EVERY, data_dir: str = ""
                   ) -> Iterator[Document]:
    """Documents of ``source``: ``"kjv"`` (the embedded corpus), ``"tfds:NAME"`` (a prepared
    tfds dataset, its own splits), ``"hf_disk:PATH"`` (a ``datasets`` Dataset or DatasetDict
    saved with ``save_to_disk``: see `_hf_disk_splits`), or comma-separated file globs:
    ``.jsonl`` files give one document per line and ``.parquet`` files one per row (field or
    column ``text_key``), other files one document each. Files are read in sorted order and
    every ``validation_every``-th document is validation (so is a saved Dataset's). Unreadable
    records are reported (file and line, or row from 0) and skipped; empty documents are
    counted and dropped. ``hf_disk:``, not ``hf:``: ``hf:PATH`` names a tokenizer.json in
    ``--tokenizer``, beside this argument."""
    if source == "kjv":
        documents = _kjv_documents(report)
    elif source.startswith("tfds:"):
        documents = _tfds_documents(source[len("tfds:"):], data_dir, text_key)
    elif source.startswith("hf_disk:"):
        documents = _hf_disk_documents(os.path.expanduser(source[len("hf_disk:"):]), text_key,
                                       report, validation_every)
    else:
        files = source_files(source)

        def texts_of(path: str) -> Iterator[tuple[str, str]]:
            if path.endswith((".jsonl", ".json")):
                return _jsonl_documents(path, text_key, report)
            if path.endswith(".parquet"):
                return _parquet_documents(path, text_key, report, source)
            return _text_document(path, report)

        def from_files() -> Iterator[Document]:
            texts = itertools.chain.from_iterable(texts_of(path) for path in files)
            for index, (origin, text) in enumerate(texts):
                yield Document(_split_of(index, validation_every), origin, text)

        documents = from_files()
    for document in documents:
        if document.text:
            yield document
        else:
            report.empty += 1


def count_documents(source: str, data_dir: str = "") -> int:
    """About how many documents ``source`` holds (lines of .jsonl files, counted without
    parsing; rows of parquet files and saved datasets, from their metadata), for the progress
    line's ETA; 0 where it cannot tell."""
    if source == "kjv":
        with kjv_file().open("rb") as f:
            return len({(v["book"], v["chapter"]) for v in map(json.loads, f)})
    if source.startswith("tfds:"):
        try:
            return sum(len(tfds.data_source(source[5:], split=split, data_dir=data_dir or None,
                                            download=False)) for split in SPLITS)
        except Exception:  # not prepared: reading it reports that in one line
            return 0
    if source.startswith("hf_disk:"):
        try:
            return sum(len(split) for split in _hf_disk_splits(
                os.path.expanduser(source[len("hf_disk:"):]), source).values())
        except ConfigError:  # reading it reports that in one line
            return 0
    total = 0
    for pattern in (os.path.expanduser(p.strip()) for p in source.split(",") if p.strip()):
        for path in {f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f)}:
            if path.endswith((".jsonl", ".json")):
                with open(path, "rb") as f:
                    while block := f.read(1 << 24):
                        total += block.count(b"\n")
            elif path.endswith(".parquet"):
                try:
                    parquet = _optional("pyarrow.parquet", "pyarrow", source)
                    total += parquet.ParquetFile(path).metadata.num_rows
                except Exception:  # missing pyarrow or a bad file: reading it reports that
                    pass
            else:
                total += 1
    return total


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


def _read_index(directory: str | Path, split: str, documents: int) -> np.ndarray:
    """The document starts of a prepared split, memory-mapped: `documents` + 1 int64 values.
    ConfigError naming the index file and the fix if it is missing or damaged."""
    path = check_index(directory, split, documents)
    expected = (documents + 1,)
    try:
        starts = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "unreadable"
    else:
        if starts.dtype == np.int64 and starts.shape == expected:
            return starts
        reason = f"{starts.dtype} of shape {starts.shape}, not int64 of shape {expected}"
    raise ConfigError(f"data.path={str(directory)!r} is invalid: its index {path} is damaged "
                      f"({reason}); it is left as is: rerun scripts/prepare_data.py with the same "
                      "arguments to write it again (finished shards are kept)")


# A split whose shards hold at most this many bytes is verified whole when it loads, before the
# first step (SHA-256 reads about 0.7 GiB/s on one core: about 1.5 s); a larger one shard by shard
# on its first read, so that the start of a run does not wait on a pass over the whole dataset.
VERIFY_AT_LOAD_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class _Checksum:
    """A shard's SHA-256 as its metadata records it, keyed by the file's size and modification
    time too, so a shard rewritten since it was verified is verified again."""

    path: str
    sha256: str
    size: int
    mtime_ns: int


_VERIFIED: set[_Checksum] = set()  # the shards this process has verified
_VERIFYING = threading.Lock()  # one hash at a time: two read threads never hash one shard twice


def _verify(checksum: _Checksum, name: str) -> None:
    """Hash the shard once per process (streaming); ConfigError naming it and the fix if its
    SHA-256 is not the one its metadata.json records."""
    if checksum in _VERIFIED:
        return
    with _VERIFYING:
        if checksum in _VERIFIED:
            return
        actual = sha256_of(Path(checksum.path))
        if actual != checksum.sha256:
            raise ConfigError(
                f"data.path={name!r} is invalid: shard {checksum.path} is corrupt (its SHA-256 is "
                f"{actual[:12]}…, not {checksum.sha256[:12]}… as metadata.json records); delete "
                "it and its .json and rerun scripts/prepare_data.py with the same arguments "
                "(finished shards are kept)")
        _VERIFIED.add(checksum)


def _readable(path: str) -> bool:
    try:
        ArrayRecordReader(path).close()
    except (RuntimeError, ValueError, OSError):
        return False
    return True


class PreparedDataset:
    """One split of a prepared directory, read by window index (see the module docstring).

    With ``verify`` (`data.verify`, the default), each shard's SHA-256 is checked against
    metadata.json once per process: every shard when the split loads if the split is at most
    `VERIFY_AT_LOAD_BYTES`, else each shard before its first record is read."""

    def __init__(self, directory: str | Path, split: str, tokenizer: Tokenizer,
                 packing: bool = True, verify: bool = True):
        self.directory, self.split, self.packing = Path(directory), split, packing
        self.name = str(directory)
        metadata_path = self.directory / "metadata.json"
        if not metadata_path.exists():
            raise ConfigError(f"data.path={str(directory)!r} is invalid: it holds no "
                              "metadata.json; prepare it with python scripts/prepare_data.py "
                              "--source ... --tokenizer ... --out DIR")
        self.metadata = metadata = prepared_metadata(directory)
        if metadata["tokenizer_fingerprint"] != tokenizer.fingerprint:
            raise ConfigError(
                f"data.tokenizer={tokenizer.spec!r} is invalid: {directory} was prepared with "
                f"tokenizer {metadata['tokenizer']!r} (fingerprint "
                f"{metadata['tokenizer_fingerprint']}, not {tokenizer.fingerprint}); set "
                f"data.tokenizer={metadata['tokenizer']!r} or prepare the data again with this one")
        if split not in metadata["splits"]:
            raise ConfigError(f"data.path={str(directory)!r} is invalid: {metadata_path} is "
                              f"damaged (it has no {split} split); it is left as is: rerun "
                              "scripts/prepare_data.py with the same arguments to write it "
                              "again (finished shards are kept)")
        info = metadata["splits"][split]
        if info["documents"] == 0:
            raise ConfigError(f"data.path={str(directory)!r} is invalid: its {split} split has "
                              "no documents; prepare it from a source with some")
        paths, checksums = [], []
        for shard in info["shards"]:
            path = self.directory / shard["file"]
            stat = path.stat() if path.is_file() else None
            if stat is None or stat.st_size != shard["file_size"]:
                found = ("missing" if stat is None
                         else f"{stat.st_size} bytes, not {shard['file_size']}")
                raise ConfigError(
                    f"data.path={str(directory)!r} is invalid: shard {path} is corrupt "
                    f"({found}); delete it and its .json and rerun scripts/prepare_data.py with "
                    "the same arguments (finished shards are kept)")
            paths.append(str(path))
            if verify:
                checksums.append(_Checksum(str(path), shard["sha256"], stat.st_size,
                                           stat.st_mtime_ns))
        self.dtype = np.dtype(metadata["dtype"]).newbyteorder("<")
        self.separator = int(metadata["separator"])
        try:
            self.source = ArrayRecordDataSource(paths)
        except (RuntimeError, ValueError, OSError) as error:
            bad = next((path for path in paths if not _readable(path)), "a shard")
            reason = str(error).strip().splitlines()[0] if str(error).strip() else "unreadable"
            raise ConfigError(
                f"data.path={str(directory)!r} is invalid: shard {bad} is corrupt ({reason}); "
                "delete it and its .json and rerun scripts/prepare_data.py with the same "
                "arguments (finished shards are kept)") from None
        # A large split's checksums, each checked on its shard's first read (`document`), and
        # the document each shard ends before; a small split's are checked here.
        self._unverified: list[_Checksum] = []
        if sum(shard["file_size"] for shard in info["shards"]) > VERIFY_AT_LOAD_BYTES:
            self._unverified = checksums
            self._shard_ends = np.cumsum([shard["documents"] for shard in info["shards"]])
        else:
            for checksum in checksums:
                _verify(checksum, self.name)
        self.starts = _read_index(directory, split, info["documents"])
        self.stream_length = int(self.starts[-1]) - 1  # no separator after the last document
        self._document_windows: dict[int, np.ndarray] = {}

    @property
    def tokens_per_byte(self) -> float:
        info = self.metadata["splits"][self.split]
        return info["tokens"] / max(info["text_bytes"], 1)

    def document(self, index: int) -> np.ndarray:
        if self._unverified:
            shard = int(np.searchsorted(self._shard_ends, index, side="right"))
            _verify(self._unverified[shard], self.name)
        try:
            record = self.source[int(index)]
        except Exception as error:  # array_record raises RuntimeError/ValueError on bad data
            raise ConfigError(f"data.path={self.name!r} is invalid: document {index} of the "
                              f"{self.split} split cannot be read ({error}); prepare the data "
                              "again") from None
        return np.frombuffer(record, dtype=self.dtype)

    def _windows_per_document(self, seq_len: int) -> np.ndarray:
        """Cumulative count of in-document windows (packing off), one entry per document + 1."""
        if seq_len not in self._document_windows:
            lengths = np.diff(self.starts) - 1
            counts = np.maximum(0, (lengths - 1) // seq_len)
            self._document_windows[seq_len] = np.concatenate([[0], np.cumsum(counts)])
        return self._document_windows[seq_len]

    def num_windows(self, seq_len: int) -> int:
        if self.packing:
            return max(0, (self.stream_length - 1) // seq_len)
        return int(self._windows_per_document(seq_len)[-1])

    def window(self, index: int, seq_len: int) -> np.ndarray:
        """Window ``index``: ``seq_len + 1`` int32 tokens."""
        if not self.packing:
            cumulative = self._windows_per_document(seq_len)
            document = int(np.searchsorted(cumulative, index, side="right")) - 1
            offset = (index - int(cumulative[document])) * seq_len
            return self.document(document)[offset:offset + seq_len + 1].astype(np.int32)
        position, needed = index * seq_len, seq_len + 1
        document = int(np.searchsorted(self.starts, position, side="right")) - 1
        pieces, offset = [], position - int(self.starts[document])
        while needed > 0:
            tokens = np.append(self.document(document), np.array([self.separator], self.dtype))
            piece = tokens[offset:offset + needed]
            pieces.append(piece)
            needed -= len(piece)
            document, offset = document + 1, 0
        return np.concatenate(pieces).astype(np.int32)

    def window_order(self, seq_len: int, seed: int) -> grain.MapDataset:
        n = self.num_windows(seq_len)
        if n == 0:
            if not self.packing:
                longest = self.metadata["splits"][self.split]["longest_document"]
                raise ConfigError(
                    f"seq_len={seq_len} is invalid: with data.packing=False every window lies "
                    f"inside one document, and the longest of {self.name} ({self.split}) has "
                    f"{longest} tokens; lower seq_len below {longest} or set data.packing=True")
            raise ConfigError(f"seq_len={seq_len} is invalid: the {self.split} split of "
                              f"{self.name} has {self.stream_length} tokens, too few for one "
                              f"window of {seq_len + 1}; lower seq_len or add data")
        return window_order(n, seed)

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int,
              rows: slice | np.ndarray | None = None) -> np.ndarray:
        """Global batch ``step`` as int32 ``[batch_size, seq_len + 1]``, or only its ``rows``."""
        order = self.window_order(seq_len, seed)
        row_ids = np.arange(batch_size)[rows if rows is not None else slice(None)]
        return np.stack([self.window(order[step * batch_size + int(r)], seq_len)
                         for r in row_ids])

    def batches(self, start_step: int, batch_size: int, seq_len: int, seed: int,
                rows: slice | np.ndarray | None = None, *, prefetch: int = 4,
                read_threads: int = 2) -> Iterator[np.ndarray]:
        """Batches ``start_step, start_step + 1, ...`` (each equal to :meth:`batch`), read
        ``prefetch`` ahead by ``read_threads`` grain threads."""
        self.window_order(seq_len, seed)  # report a too-long seq_len here, not in a thread
        steps = grain.MapDataset.range(start_step, sys.maxsize).map(
            lambda step: self.batch(step, batch_size, seq_len, seed, rows))
        if prefetch <= 0:
            return iter(steps)
        options = grain.ReadOptions(num_threads=max(1, read_threads),
                                    prefetch_buffer_size=prefetch)
        return iter(steps.to_iter_dataset(options))


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


def load_split(data_config: Any, split: str) -> in_memory.Dataset | PreparedDataset:
    """``split`` of the dataset ``data_config`` names: a prepared directory (``name="prepared"``,
    ``path=DIR``) streamed from its shards, or an in-memory source (`train.data.in_memory.load`)."""
    tokenizer = tokenizer_of(data_config)
    for field, least in (("prefetch", 0), ("read_threads", 1)):
        value = data_config.get(field, least)
        check(isinstance(value, int) and value >= least, f"data.{field}", value,
              f"must be an integer ≥ {least}")
    if data_config.get("name", "kjv") != "prepared":
        return in_memory.load(data_config, split)
    fraction = data_config.get("tuning_fraction", 0.0)
    check(not fraction, "data.tuning_fraction", fraction,
          "is not supported for data.name='prepared' (its shards stream whole documents); "
          "tune on an in-memory source, or set it to 0")
    if not data_config.get("path", ""):
        raise ConfigError("data.path='' is invalid: data.name='prepared' reads the directory "
                          "data.path; prepare one with python scripts/prepare_data.py")
    return PreparedDataset(data_config.path, split, tokenizer,
                           packing=bool(data_config.get("packing", True)),
                           verify=bool(data_config.get("verify", True)))


def prepared_texts(directory: str | Path, split: str = "train") -> Iterator[str]:
    """The documents of a prepared directory's ``split``, decoded with its own tokenizer."""
    metadata = prepared_metadata(directory, "--data")
    tokenizer = load_tokenizer(metadata["tokenizer"])
    dataset = PreparedDataset(directory, split, tokenizer)
    for index in range(len(dataset.starts) - 1):
        yield tokenizer.decode(dataset.document(index))


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


def loader_throughput(data_config: Any, batch_size: int, seq_len: int, batches: int,
                      seed: int = 0) -> dict[str, float]:
    """Tokens per second the train split of ``data_config`` delivers at this batch shape:
    ``loader_tokens_per_sec`` through the stream the training loop reads (``batches``, with
    the config's prefetch and read threads, after one warm-up batch) and
    ``loader_sync_tokens_per_sec`` one ``batch`` call at a time."""
    dataset = load_split(data_config, "train")
    tokens = batch_size * seq_len
    started = time.perf_counter()
    for step in range(batches):
        dataset.batch(step, batch_size, seq_len, seed)
    synchronous = batches * tokens / (time.perf_counter() - started)
    stream = dataset.batches(batches, batch_size, seq_len, seed,
                             prefetch=data_config.get("prefetch", 4),
                             read_threads=data_config.get("read_threads", 2))
    next(stream)
    started = time.perf_counter()
    for _ in range(batches):
        next(stream)
    streamed = batches * tokens / (time.perf_counter() - started)
    return {"loader_tokens_per_sec": streamed, "loader_sync_tokens_per_sec": synchronous}
