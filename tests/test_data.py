"""Tests for train/data/in_memory.py: tokenizer, sources (kjv, local text, tfds) and batching."""

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from train import rundir
from train.data import in_memory


def _config(**fields) -> ml_collections.ConfigDict:
    base = {"name": "kjv", "path": "", "data_dir": "", "validation_fraction": 0.05}
    return ml_collections.ConfigDict({**base, **fields})


def _random_dataset(num_tokens: int, seed: int = 0) -> in_memory.Dataset:
    tokens = np.random.default_rng(seed).integers(0, 256, num_tokens, dtype=np.uint8)
    return in_memory.Dataset(tokens=tokens, name="random", split="train")


def _window_ids(ds: in_memory.Dataset, batch: np.ndarray, seq_len: int) -> list[int]:
    """Index of the contiguous window ``tokens[w * seq_len : w * seq_len + seq_len + 1]``
    equal to each row (random tokens make windows unique); fails if a row is not one."""
    windows = {
        ds.tokens[w * seq_len : w * seq_len + seq_len + 1].tobytes(): w
        for w in range(ds.num_windows(seq_len))
    }
    return [windows[row.astype(np.uint8).tobytes()] for row in batch]


@pytest.fixture(scope="module")
def kjv_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def kjv(kjv_dir) -> dict[str, in_memory.Dataset]:
    cfg = _config(data_dir=kjv_dir)
    return {split: in_memory.load(cfg, split) for split in ("train", "validation")}


def test_encode_decode_round_trip():
    for text in ["In the beginning", "héllo wörld — 世界 🙂", ""]:
        tokens = in_memory.encode(text)
        assert tokens.dtype == np.int32
        assert np.all((tokens >= 0) & (tokens < in_memory.VOCAB_SIZE))
        assert len(tokens) == len(text.encode("utf-8"))
        assert in_memory.decode(tokens) == text
    # a cut multi-byte character is replaced
    assert in_memory.decode(in_memory.encode("é")[:1]) == "\ufffd"


def test_kjv_prepares_offline_into_data_dir(kjv, kjv_dir):
    train, val = kjv["train"].tokens, kjv["validation"].tokens
    assert train.dtype == np.uint8 and val.dtype == np.uint8
    assert 0.03 < len(val) / len(train) < 0.08  # every 20th chapter
    variant = os.path.join(kjv_dir, "kjv_bible", "1.0.0")
    assert any(f.endswith(".array_record-00000-of-00001") for f in os.listdir(variant))
    assert "tensorflow" not in sys.modules
    # The prepared data is a plain tfds array_record dataset: one example per chapter.
    sources = [
        tfds.data_source("kjv_bible", split=s, data_dir=kjv_dir, download=False)
        for s in ("train", "validation")
    ]
    assert len(sources[0]) + len(sources[1]) == 1189
    assert sources[0][0]["text"].startswith(b"In the beginning God created the heaven")


def test_kjv_prepared_once_by_runs_started_at_once(tmp_path, monkeypatch):
    """Two sweeps started at once on a fresh cache both built KJV; the second's rename of its
    incomplete directory failed (FileExistsError). Both callers now check, wait for the lock
    held here, and only the first builds; the other finds it prepared. Nothing is left in the
    temporary directory (tfds's metadata lookup left an empty one per builder opened)."""
    temporary = tmp_path / "temporary"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    builds = []
    build = in_memory.KjvBible.download_and_prepare
    monkeypatch.setattr(in_memory.KjvBible, "download_and_prepare",
                        lambda self, **kw: builds.append(1) or build(self, **kw))
    with ThreadPoolExecutor(2) as pool:
        with rundir.file_lock(tmp_path / "kjv_bible.lock"):
            names = [pool.submit(in_memory._prepare_kjv, str(tmp_path)) for _ in range(2)]
            time.sleep(1.0)  # both have found it unprepared and wait for the lock
            assert not any(name.done() for name in names)
        assert [name.result() for name in names] == ["kjv_bible", "kjv_bible"]
    assert builds == [1]
    assert not list(temporary.iterdir())


def test_kjv_splits_are_disjoint_chapters_spanning_the_book(kjv):
    train, val = in_memory.decode(kjv["train"].tokens), in_memory.decode(kjv["validation"].tokens)
    assert train.startswith("In the beginning God created the heaven and the earth.")
    assert train.endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert "In the beginning God created" not in val
    genesis_20 = "And Abraham journeyed from thence toward the south country"
    revelation_13 = "Let him that hath understanding count the number of the beast"
    for verse in (genesis_20, revelation_13):
        assert verse in val and verse not in train
    assert train.count("\n") + 1 + val.count("\n") + 1 == 1189  # one document per chapter


def test_kjv_second_load_uses_cache_and_env_data_dir(kjv, kjv_dir, monkeypatch):
    monkeypatch.setenv("BLOCKBENCH_DATA_DIR", kjv_dir)
    again = in_memory.load(_config(), "validation")
    np.testing.assert_array_equal(again.tokens, kjv["validation"].tokens)
    assert os.path.exists(
        os.path.join(kjv_dir, "kjv_bible", "1.0.0", "blockbench-validation-text.npy")
    )


def test_batch_shape_dtype_and_determinism():
    ds = _random_dataset(10_000)
    b = ds.batch(step=3, batch_size=8, seq_len=32, seed=1)
    assert b.shape == (8, 33) and b.dtype == np.int32
    np.testing.assert_array_equal(b, ds.batch(step=3, batch_size=8, seq_len=32, seed=1))
    assert not np.array_equal(b, ds.batch(step=4, batch_size=8, seq_len=32, seed=1))
    assert not np.array_equal(b, ds.batch(step=3, batch_size=8, seq_len=32, seed=2))


def test_batch_rows_are_contiguous_windows_with_shifted_targets():
    ds, seq_len = _random_dataset(5_000), 16
    b = ds.batch(step=2, batch_size=12, seq_len=seq_len, seed=0)
    for row, w in zip(b, _window_ids(ds, b, seq_len), strict=True):
        corpus = ds.tokens[w * seq_len :].astype(np.int32)
        np.testing.assert_array_equal(row[:-1], corpus[:seq_len])  # inputs
        np.testing.assert_array_equal(row[1:], corpus[1 : seq_len + 1])  # next-token targets


def test_rows_slice_equals_rows_of_full_batch():
    ds = _random_dataset(5_000)
    full = ds.batch(step=7, batch_size=12, seq_len=16, seed=3)
    np.testing.assert_array_equal(ds.batch(7, 12, 16, 3, rows=slice(4, 9)), full[4:9])
    per_process = [ds.batch(7, 12, 16, 3, rows=slice(p * 3, p * 3 + 3)) for p in range(4)]
    np.testing.assert_array_equal(np.concatenate(per_process), full)


def test_each_epoch_visits_every_window_once_in_a_new_order():
    ds, seq_len, batch_size = _random_dataset(100 * 16 + 1), 16, 10
    assert ds.num_windows(seq_len) == 100 and ds.num_batches(batch_size, seq_len) == 10
    epochs = [
        [
            w
            for step in range(e * 10, (e + 1) * 10)
            for w in _window_ids(ds, ds.batch(step, batch_size, seq_len, seed=5), seq_len)
        ]
        for e in range(2)
    ]
    assert sorted(epochs[0]) == list(range(100)) and sorted(epochs[1]) == list(range(100))
    assert epochs[0] != epochs[1]
    assert epochs[0] != list(range(100))  # shuffled


def test_too_small_split_names_seq_len():
    ds = in_memory.Dataset(tokens=np.zeros(64, np.uint8), name="tiny", split="validation")
    with pytest.raises(ValueError, match="seq_len"):
        ds.batch(0, 2, seq_len=64, seed=0)


def test_local_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "b.txt").write_text("second — ünïcode document")
    (tmp_path / "c.md").write_text("third")
    cfg = _config(name="text", path=f"{tmp_path}/*.txt, {tmp_path}/*.md", validation_fraction=0.25)
    train, val = in_memory.load(cfg, "train"), in_memory.load(cfg, "validation")
    corpus = "first document\n\nsecond — ünïcode document\nthird".encode()
    np.testing.assert_array_equal(np.concatenate([train.tokens, val.tokens]), list(corpus))
    assert len(val.tokens) == int(len(corpus) * 0.25) and train.tokens.dtype == np.uint8


def test_local_text_no_match_names_data_path(tmp_path):
    with pytest.raises(ValueError, match="data.path"):
        in_memory.load(_config(name="text", path=str(tmp_path / "missing*.txt")), "train")


def test_unknown_or_unprepared_tfds_name_is_one_line_error(tmp_path):
    for name in ("no_such_dataset_xyz", "tiny_shakespeare"):
        with pytest.raises(ValueError, match="data.name") as err:
            in_memory.load(_config(name=name, data_dir=str(tmp_path)), "train")
        assert name in str(err.value) and "\n" not in str(err.value)


class ToyDocs(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """A tiny offline dataset with two text features, standing in for a catalog dataset."""

    VERSION = tfds.core.Version("1.0.0")
    code_path = None  # as in in_memory.KjvBible: avoids tfds's importlib_resources import

    def _info(self):
        features = {"body": tfds.features.Text(), "title": tfds.features.Text()}
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict(features), disable_shuffling=True
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(3), "validation": self._generate_examples(1)}

    def _generate_examples(self, n):
        for i in range(n):
            yield i, {"body": f"body {i}", "title": f"title {i}"}


def test_prepared_tfds_dataset_by_name(tmp_path):
    ToyDocs(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    train = in_memory.load(_config(name="toy_docs", data_dir=str(tmp_path)), "train")
    assert in_memory.decode(train.tokens) == "body 0\nbody 1\nbody 2"  # first text feature by name
    titles = in_memory.load(_config(name="toy_docs", data_dir=str(tmp_path), text_key="title"),
                           "train")
    assert in_memory.decode(titles.tokens) == "title 0\ntitle 1\ntitle 2"
