"""Tokenizers (train/data/tokenizer.py) and prepared, streamed datasets (train/data/sources.py,
preparation.py and shards.py): round trips, shards equal to the in-memory pipeline, resumable
preparation, training from shards (resumed after SIGKILL and re-sharded with identical losses),
and each bad input's one line."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece

from config import ConfigError
from scripts.train_tokenizer import main as train_tokenizer_main
from tests.helpers import one_device_env, tiny_config
from tests.test_data import ToyDocs
from train.data import in_memory
from train.data.preparation import prepare
from train.data.shards import PreparedDataset, load_split
from train.data.sources import SourceReport, read_documents
from train.data.tokenizer import check_vocab, load_tokenizer, tokenizer_of, train_bpe
from train.loop import train
from train.step import resolve_for_job

REPO = Path(__file__).resolve().parents[1]
TEXTS = ["In the beginning God created the heaven and the earth.", "héllo wörld — 世界 🙂\n\nx",
         ""]


def kjv_texts(count: int) -> list[str]:
    return [d.text for d in itertools.islice(read_documents("kjv", SourceReport()), count)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    """A 320-token byte-level BPE trained on 100 chapters (well under a second)."""
    path = train_bpe(kjv_texts(100), 320, tmp_path_factory.mktemp("bpe"))
    return f"hf:{path.parent}"


@pytest.fixture(scope="module")
def kjv_bpe(bpe, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kjv-bpe")
    prepare("kjv", bpe, out, workers=2, docs_per_shard=40, progress=False)
    return out


def one_line_error(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


def test_byte_and_bpe_tokenizers_round_trip_text(bpe):
    for spec in ("byte", bpe):
        tokenizer = load_tokenizer(spec)
        for text in TEXTS:
            ids = tokenizer.encode(text)
            assert ids.dtype == np.int32 and np.all((ids >= 0) & (ids < tokenizer.vocab_size))
            assert tokenizer.decode(ids) == text
    bpe_tokenizer = load_tokenizer(bpe)
    assert bpe_tokenizer.vocab_size == 320 and bpe_tokenizer.separator == 0
    chapter = kjv_texts(1)[0]
    assert len(bpe_tokenizer.encode(chapter)) < 0.6 * len(chapter)  # 63 merges learned


def test_sentencepiece_tokenizer_round_trips(tmp_path):
    sentencepiece.SentencePieceTrainer.Train(
        sentence_iterator=iter(kjv_texts(60)), model_prefix=str(tmp_path / "sp"),
        vocab_size=400, model_type="bpe", byte_fallback=True, minloglevel=2)
    tokenizer = load_tokenizer(f"sentencepiece:{tmp_path / 'sp.model'}")
    assert tokenizer.vocab_size == 400 and tokenizer.separator == 2  # its EOS id
    text = "And God said, Let there be light: and there was light."
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_vocab_size_comes_from_the_tokenizer_or_is_checked(bpe):
    model = tiny_config().model
    model.vocab_size = 0
    check_vocab(model, load_tokenizer(bpe))
    assert model.vocab_size == 320
    model.vocab_size = 384  # padded: accepted
    check_vocab(model, load_tokenizer(bpe))
    model.vocab_size = 256
    with pytest.raises(ConfigError) as error:
        check_vocab(model, load_tokenizer(bpe))
    one_line_error(error, "model.vocab_size=256 is invalid", "has 320 tokens",
                   "set model.vocab_size=320")


@pytest.mark.parametrize("spec,fragment", [
    ("wordpiece:x", "use 'byte', 'hf:PATH'"),
    ("hf:/no/such/tokenizer.json", "does not exist; train one with scripts/train_tokenizer.py"),
])
def test_bad_tokenizer_spec_is_one_line(spec, fragment):
    with pytest.raises(ConfigError) as error:
        load_tokenizer(spec)
    one_line_error(error, f"data.tokenizer={spec!r} is invalid", fragment)


def test_in_memory_sources_tokenize_each_line_as_a_document(bpe):
    config = tiny_config().data
    config.tokenizer = bpe
    tokenizer = load_tokenizer(bpe)
    validation = in_memory.load(config, "validation")
    chapters = [d.text for d in read_documents("kjv", SourceReport()) if d.split == "validation"]
    expected = np.concatenate([piece for text in chapters for piece in (
        tokenizer.encode(text), [tokenizer.separator])][:-1])
    np.testing.assert_array_equal(validation.tokens, expected)


def test_prepared_byte_shards_stream_the_in_memory_batches(tmp_path):
    """The kjv corpus prepared with the byte tokenizer: every batch (and every process's rows of
    it) equals the in-memory pipeline's, through `batch` and through the prefetching stream."""
    prepare("kjv", "byte", tmp_path, workers=1, docs_per_shard=250, progress=False)
    metadata = json.loads((tmp_path / "metadata.json").read_text())
    assert len(metadata["splits"]["train"]["shards"]) == 5  # 1130 chapters / 250
    config = tiny_config().data
    for split in ("train", "validation"):
        from_memory = in_memory.load(config, split)
        prepared = PreparedDataset(tmp_path, split, load_tokenizer("byte"))
        assert prepared.stream_length == len(from_memory.tokens)
        assert metadata["splits"][split]["text_bytes"] == metadata["splits"][split]["tokens"]
        for step in (0, 7, 1000):  # 1000: a later epoch of the validation split
            np.testing.assert_array_equal(prepared.batch(step, 8, 64, seed=3),
                                          from_memory.batch(step, 8, 64, seed=3))
    train_split = PreparedDataset(tmp_path, "train", load_tokenizer("byte"))
    streamed = train_split.batches(5, 8, 64, 3, rows=slice(2, 6), prefetch=3, read_threads=2)
    unprefetched = train_split.batches(5, 8, 64, 3, rows=slice(2, 6), prefetch=0)
    for step in range(5, 9):
        expected = train_split.batch(step, 8, 64, 3)[2:6]
        np.testing.assert_array_equal(next(streamed), expected)
        np.testing.assert_array_equal(next(unprefetched), expected)


@pytest.mark.slow
def test_preparation_resumes_keeping_finished_shards(kjv_bpe, bpe, tmp_path):
    metadata = json.loads((kjv_bpe / "metadata.json").read_text())
    assert metadata["tokenizer_fingerprint"] == load_tokenizer(bpe).fingerprint
    assert metadata["splits"]["train"]["documents"] == 1130
    assert metadata["splits"]["validation"]["documents"] == 59
    # A killed preparation: two finished shards, one half-written temporary file.
    for name in ("train-00000", "train-00001"):
        for suffix in (".array_record", ".json"):
            (tmp_path / f"{name}{suffix}").write_bytes((kjv_bpe / f"{name}{suffix}").read_bytes())
    (tmp_path / "prepare.json").write_bytes((kjv_bpe / "prepare.json").read_bytes())
    (tmp_path / "train-00002.array_record.123.tmp").write_bytes(b"partial")
    os.utime(tmp_path / "train-00000.array_record", (0, 0))
    resumed = prepare("kjv", bpe, tmp_path, workers=1, docs_per_shard=40, progress=False)
    assert os.stat(tmp_path / "train-00000.array_record").st_mtime == 0  # not rewritten
    assert resumed["content_hash"] == metadata["content_hash"]
    with pytest.raises(ConfigError) as error:  # other settings into the same directory
        prepare("kjv", bpe, tmp_path, docs_per_shard=200, progress=False)
    one_line_error(error, f"--out={tmp_path} is invalid", "docs_per_shard=40",
                   "use a new --out")


def test_bad_records_are_reported_with_file_and_line_and_skipped(tmp_path):
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "first"}\n{"text": \n{"body": "no text"}\n\n{"text": ""}\n'
                      + "".join(f'{{"text": "document {i}"}}\n' for i in range(5)))
    warnings = []
    metadata = prepare(str(source), "byte", tmp_path / "out", validation_every=3,
                       progress=False, warn=warnings.append)
    assert warnings == [f"warning: {source}:2: not valid JSON (Expecting value); record skipped",
                        f"warning: {source}:3: no string field 'text' (set --text_key); "
                        "record skipped"]
    assert metadata["skipped_records"] == 2 and metadata["empty_documents"] == 1
    validation = PreparedDataset(tmp_path / "out", "validation", load_tokenizer("byte"))
    assert [bytes(validation.document(i).astype(np.uint8)) for i in range(2)] == \
        [b"document 0", b"document 3"]  # every 3rd of: first, "", document 0, ..., document 4


def with_fields(config, fields: dict):
    changed = config.copy_and_resolve_references()
    changed.update(fields)
    return changed


@pytest.mark.slow
def test_prepared_data_errors_are_one_line(kjv_bpe, bpe, tmp_path):
    config = tiny_config().data
    config.update(name="prepared", path=str(kjv_bpe), tokenizer="byte")
    with pytest.raises(ConfigError) as error:  # prepared with another tokenizer
        load_split(config, "train")
    one_line_error(error, "data.tokenizer='byte' is invalid", f"was prepared with tokenizer "
                   f"{bpe!r}", f"set data.tokenizer={bpe!r}")

    config.tokenizer = bpe
    longest = json.loads((kjv_bpe / "metadata.json").read_text())["splits"]["train"][
        "longest_document"]
    unpacked = load_split(with_fields(config, {"packing": False}), "train")
    with pytest.raises(ConfigError) as error:  # no document holds a window of longest + 1
        unpacked.batch(0, 2, longest, seed=0)
    one_line_error(error, f"seq_len={longest} is invalid: with data.packing=False",
                   f"has {longest} tokens", "set data.packing=True")
    window = unpacked.batch(0, 1, longest - 1, seed=0)[0]  # the longest document, whole
    assert unpacked.num_windows(longest - 1) == 1 and load_tokenizer(bpe).separator not in window

    (tmp_path / "empty.jsonl").write_text('{"text": "one"}\n')  # all train, no validation
    prepare(str(tmp_path / "empty.jsonl"), "byte", tmp_path / "empty", progress=False)
    with pytest.raises(ConfigError) as error:
        load_split(with_fields(config, {"path": str(tmp_path / "empty"), "tokenizer": "byte"}),
                   "validation")
    one_line_error(error, "validation split has no documents")

    copy = tmp_path / "copy"
    copy.mkdir()
    for item in kjv_bpe.iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    shard = copy / "train-00001.array_record"
    intact = shard.read_bytes()
    shard.write_bytes(intact[:1000])  # truncated
    with pytest.raises(ConfigError) as error:
        load_split(with_fields(config, {"path": str(copy)}), "train")
    one_line_error(error, f"shard {shard} is corrupt (1000 bytes, not", "rerun "
                   "scripts/prepare_data.py with the same arguments")
    shard.write_bytes(bytes(b ^ 0x5A for b in intact))  # same size, every byte flipped
    with pytest.raises(ConfigError) as error:
        load_split(with_fields(config, {"path": str(copy)}), "train")
    one_line_error(error, f"shard {shard} is corrupt (Corrupted Riegeli")
    shard.unlink()
    with pytest.raises(ConfigError) as error:
        load_split(with_fields(config, {"path": str(copy)}), "train")
    one_line_error(error, f"shard {shard} is corrupt (missing)")

    with pytest.raises(ConfigError) as error:
        load_split(with_fields(config, {"path": str(tmp_path / "nothing")}), "train")
    one_line_error(error, "holds no metadata.json", "scripts/prepare_data.py")
    with pytest.raises(ConfigError) as error:
        load_split(with_fields(config, {"read_threads": 0}), "train")
    one_line_error(error, "data.read_threads=0 is invalid: must be an integer ≥ 1")

    run = subprocess.run(  # through the command line: one line, exit status 2, no traceback
        [sys.executable, "-m", "train", "--config", "experiments/quickstart.py", "--workdir",
         str(tmp_path / "run"), "--config.data.name=prepared", f"--config.data.path={copy}",
         f"--config.data.tokenizer={bpe}", "--config.model.vocab_size=0"],
        cwd=REPO, env=one_device_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith(f"error: data.path='{copy}' is invalid")
    assert "Traceback" not in run.stderr


def shard_config(kjv_bpe: Path, bpe: str, **fields):
    config = tiny_config(vocab_size=0)
    config.update(steps=6, checkpoint_every=2, **fields)
    config.data.update(name="prepared", path=str(kjv_bpe), tokenizer=bpe)
    return config


def losses(workdir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    return {r["step"]: r["train_loss"] for r in records}  # a replayed step: its last record


@pytest.mark.slow
def test_training_from_shards_resumes_after_sigkill_and_reshards_identically(
        kjv_bpe, bpe, tmp_path):
    """Uninterrupted on 8 devices in process; on 1 device in a subprocess, SIGKILLed after its
    step-2 checkpoint and rerun: the same loss at every step."""
    config = shard_config(kjv_bpe, bpe)
    config.mesh.data = -1
    check_vocab(config.model, tokenizer_of(config.data))  # as the CLI does before resolving
    assert config.model.vocab_size == 320  # taken from the tokenizer
    uninterrupted = train(resolve_for_job(config), tmp_path / "eight")
    assert uninterrupted["step"] == 6

    workdir = tmp_path / "one"
    command = [sys.executable, "-m", "train", "--config", "experiments/quickstart.py",
               "--workdir", str(workdir), "--config.data.name=prepared",
               f"--config.data.path={kjv_bpe}", f"--config.data.tokenizer={bpe}",
               *[f"--config.{k}={v}" for k, v in dict(
                   steps=6, checkpoint_every=2, batch_size=8, seq_len=16, log_every=1,
                   eval_every=1000, eval_batches=1, sample_tokens=0, mesh__data=1,
                   model__vocab_size=0, model__d_model=32, model__num_layers=2,
                   model__attention__num_heads=4, model__attention__num_kv_heads=2,
                   optimizer__warmup_steps=2).items()]]
    command = [arg.replace("__", ".") for arg in command]
    killed = subprocess.Popen(command, cwd=REPO, env=one_device_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    deadline = time.time() + 400
    while not (workdir / "checkpoints" / "2").exists() or len(losses_or_empty(workdir)) < 3:
        assert killed.poll() is None and time.time() < deadline, killed.communicate()[1][-2000:]
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert max(losses(workdir)) < 6
    finished = subprocess.run(command, cwd=REPO, env=one_device_env(), capture_output=True,
                              text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "resuming from the checkpoint at step" in finished.stderr
    assert list(losses(workdir)) == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose(list(losses(workdir).values()),
                               list(losses(tmp_path / "eight").values()), rtol=2e-5)


def losses_or_empty(workdir: Path) -> dict[int, float]:
    try:
        return losses(workdir)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_a_prepared_tfds_dataset_is_a_source(tmp_path):
    ToyDocs(data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare()
    metadata = prepare("tfds:toy_docs", "byte", tmp_path / "out", text_key="title",
                       data_dir=str(tmp_path / "tfds"), progress=False)
    assert {split: info["documents"] for split, info in metadata["splits"].items()} == \
        {"train": 3, "validation": 1}  # the dataset's own splits
    validation = PreparedDataset(tmp_path / "out", "validation", load_tokenizer("byte"))
    assert bytes(validation.document(0).astype(np.uint8)) == b"title 0"
    with pytest.raises(ConfigError) as error:
        prepare("tfds:toy_docs", "byte", tmp_path / "other", text_key="summary",
                data_dir=str(tmp_path / "tfds"), progress=False)
    one_line_error(error, "--text_key='summary' is invalid: tfds:toy_docs has features body, "
                   "title")


ROWS = ["In the beginning", "héllo wörld — 世界 🙂", None, "", "line one\nline two", "x" * 300,
        "seventh", "eighth"]  # None: a null text, reported and skipped; "": an empty document


def documents_of(directory: Path) -> dict[str, list[bytes]]:
    metadata = json.loads((directory / "metadata.json").read_text())
    return {split: [bytes(PreparedDataset(directory, split, load_tokenizer("byte")).document(i)
                          .astype(np.uint8)) for i in range(info["documents"])]
            for split, info in metadata["splits"].items() if info["documents"]}


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps({"text": text, "id": i}) + "\n"
                            for i, text in enumerate(rows)))


def test_parquet_files_give_the_documents_of_the_same_jsonl_rows(tmp_path):
    """Two parquet files and the same rows as two .jsonl files: the same documents in the same
    splits (every 3rd validation), the same content hash; a null or non-string text is
    reported with file and row and skipped; an absent column is one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    (tmp_path / "jsonl").mkdir()
    for name, rows in (("a", ROWS[:5]), ("b", ROWS[5:])):
        pq.write_table(pa.table({"id": list(range(len(rows))), "text": rows}),
                       tmp_path / "pq" / f"{name}.parquet")
        write_jsonl(tmp_path / "jsonl" / f"{name}.jsonl", rows)
    pq.write_table(pa.table({"text": [7]}), tmp_path / "pq" / "c.parquet")  # int, not text
    write_jsonl(tmp_path / "jsonl" / "c.jsonl", [7])
    warnings: dict[str, list[str]] = {"pq": [], "jsonl": []}
    metadata = {kind: prepare(str(tmp_path / kind / f"*.{ext}"), "byte", tmp_path / f"{kind}-out",
                              docs_per_shard=2, validation_every=3, progress=False,
                              warn=warnings[kind].append)
                for kind, ext in (("pq", "parquet"), ("jsonl", "jsonl"))}
    assert documents_of(tmp_path / "pq-out") == documents_of(tmp_path / "jsonl-out") == {
        "train": [b"In the beginning", "héllo wörld — 世界 🙂".encode(), b"line one\nline two",
                  b"x" * 300, b"eighth"],
        "validation": [b"seventh"]}  # every 3rd of the 7 readable rows; "" (the 3rd) dropped
    assert metadata["pq"]["content_hash"] == metadata["jsonl"]["content_hash"]
    assert metadata["pq"]["splits"] == metadata["jsonl"]["splits"]
    for kind in ("pq", "jsonl"):
        assert (metadata[kind]["skipped_records"], metadata[kind]["empty_documents"]) == (2, 1)
    assert warnings["pq"] == [
        f"warning: {tmp_path / 'pq' / 'a.parquet'}[2]: field 'text' is null; record skipped",
        f"warning: {tmp_path / 'pq' / 'c.parquet'}[0]: field 'text' is int, not a string "
        "(set --text_key); record skipped"]
    with pytest.raises(ConfigError) as error:
        prepare(str(tmp_path / "pq" / "*.parquet"), "byte", tmp_path / "other",
                text_key="body", progress=False)
    one_line_error(error, f"--text_key='body' is invalid: {tmp_path / 'pq' / 'a.parquet'} has "
                   "columns id, text")


def test_a_saved_datasets_dataset_is_a_source(tmp_path, monkeypatch):
    """A DatasetDict saved to disk keeps its splits (test as validation when it has none); a
    saved Dataset is divided like files; a null text is skipped and counted; an absent column
    or a missing package is one line."""
    import datasets

    readable = [text.encode() for text in ROWS if text]
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ROWS, "id": list(range(len(ROWS)))}),
        "test": datasets.Dataset.from_dict({"text": ["held out", None], "id": [0, 1]}),
    }).save_to_disk(str(tmp_path / "dict"))
    warnings: list[str] = []
    metadata = prepare(f"hf_disk:{tmp_path / 'dict'}", "byte", tmp_path / "dict-out",
                       docs_per_shard=3, progress=False, warn=warnings.append)
    assert documents_of(tmp_path / "dict-out") == {"train": readable,
                                                   "validation": [b"held out"]}
    assert (metadata["skipped_records"], metadata["empty_documents"]) == (2, 1)
    assert warnings == [f"warning: hf_disk:{tmp_path / 'dict'}/train[2]: field 'text' is null; "
                        "record skipped", f"warning: hf_disk:{tmp_path / 'dict'}/validation[1]: "
                        "field 'text' is null; record skipped"]

    datasets.Dataset.from_dict({"text": ROWS}).save_to_disk(str(tmp_path / "one"))
    write_jsonl(tmp_path / "one.jsonl", ROWS)
    one = prepare(f"hf_disk:{tmp_path / 'one'}", "byte", tmp_path / "one-out",
                  validation_every=3, progress=False, warn=warnings.append)
    from_jsonl = prepare(str(tmp_path / "one.jsonl"), "byte", tmp_path / "jsonl-out",
                         validation_every=3, progress=False, warn=warnings.append)
    assert documents_of(tmp_path / "one-out") == documents_of(tmp_path / "jsonl-out")
    assert one["content_hash"] == from_jsonl["content_hash"]

    with pytest.raises(ConfigError) as error:
        prepare(f"hf_disk:{tmp_path / 'dict'}", "byte", tmp_path / "other", text_key="body",
                progress=False)
    one_line_error(error, f"--text_key='body' is invalid: hf_disk:{tmp_path / 'dict'} has "
                   "columns text, id")
    with pytest.raises(ConfigError) as error:
        prepare(f"hf_disk:{tmp_path / 'nothing'}", "byte", tmp_path / "other2", progress=False)
    one_line_error(error, f"is invalid: {tmp_path / 'nothing'} is not a dataset saved with")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ConfigError) as error:
        prepare(f"hf_disk:{tmp_path / 'dict'}", "byte", tmp_path / "other3", progress=False)
    one_line_error(error, "needs the datasets package; pip install datasets")


@pytest.mark.slow
def test_a_sigkilled_preparation_continues_where_it_stopped(kjv_bpe, bpe, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "scripts/prepare_data.py", "--source", "kjv", "--tokenizer", bpe,
               "--out", str(out), "--workers", "1", "--docs_per_shard", "40"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out.glob("train-*.json")):  # killed after its first of 31 shards
        assert killed.poll() is None and time.time() < deadline
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (out / "metadata.json").exists()
    finished_before = {path.name: path.stat().st_mtime_ns for path in out.glob("*.array_record")
                       if path.with_suffix(".json").exists()}
    assert finished_before
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"({len(finished_before)} kept from before)" in done.stderr
    for name, mtime in finished_before.items():
        assert (out / name).stat().st_mtime_ns == mtime  # not rewritten
    uninterrupted = json.loads((kjv_bpe / "metadata.json").read_text())  # same arguments
    resumed = json.loads((out / "metadata.json").read_text())
    assert resumed["content_hash"] == uninterrupted["content_hash"]
    assert resumed["splits"] == uninterrupted["splits"]


def test_train_tokenizer_command_reads_a_prepared_directory(kjv_bpe, tmp_path, capsys):
    out = tmp_path / "bpe"
    assert train_tokenizer_main(["--data", str(kjv_bpe), "--vocab_size", "290", "--out",
                                 str(out), "--max_documents", "30"]) == 0
    assert f"--config.data.tokenizer=hf:{out / 'tokenizer.json'}" in capsys.readouterr().out
    tokenizer = load_tokenizer(f"hf:{out}")
    assert tokenizer.vocab_size == 290 and tokenizer.decode(tokenizer.encode(TEXTS[1])) == TEXTS[1]
    assert train_tokenizer_main(["--data", "kjv", "--vocab_size", "100", "--out",
                                 str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --vocab_size=100 is invalid: a byte-level BPE needs at least 258 (256 bytes, "
        "the separator and one merge)")
