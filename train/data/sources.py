"""Where prepared data comes from: a corpus source's documents, each with its split and origin.

:func:`read_documents` reads a source (the embedded corpus, a prepared tfds dataset, a
``datasets`` dataset saved on disk, or .jsonl, .parquet and text files) as documents
(:class:`Document`), reporting each unreadable record in a :class:`SourceReport` and skipping it;
:func:`count_documents` estimates a source's size for the progress line.
`train.data.preparation` tokenizes them into shards; `train.data.shards` reads those.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds

from config import ConfigError
from train.data.arguments import source_files
from train.data.in_memory import SPLITS, kjv_file

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
