"""Reading a prepared dataset: its shards streamed by (seed, step), each checked on first use.

How a directory is prepared: `train.data.preparation` (scripts/prepare_data.py).

Reading (:class:`PreparedDataset`): the packed stream of a split is its documents joined by the
tokenizer's separator, as the in-memory byte pipeline joins them by ``\\n``; window ``w`` is
``stream[w·T : w·T + T + 1]``. With ``data.packing=False`` the windows are those that lie inside
one document instead. Batch ``step`` holds windows ``order[step·B + r]`` of a seeded grain
shuffle, re-drawn every epoch (`in_memory.window_order`), so a batch is a pure function of
(seed, step) and a process reads only its own rows' records. :meth:`PreparedDataset.batches`
streams them through a grain ``IterDataset`` whose threads read ``data.prefetch`` batches ahead
of the step. Memory is the records of the batches in flight, whatever the dataset's size.
:func:`load_split` opens the split a data config names (prepared or in memory).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordReader
from grain.sources import ArrayRecordDataSource

from config import ConfigError, check
from train.data import in_memory
from train.data.arguments import check_index, prepared_metadata
from train.data.in_memory import window_order
from train.data.shard_writer import sha256_of
from train.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_of


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
