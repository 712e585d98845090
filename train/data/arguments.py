"""The checks of the scripts' arguments that need no heavy import: every script in scripts/ runs
them after parsing its command line and before it imports JAX, Flax, Orbax, grain or
tensorflow_datasets, so a bad argument is one line on stderr (exit status 2) in a fraction of a
second. Each raises `config.ConfigError` with one line naming the flag, the value and the fix.

- `check_analysis`: the --batch and --seq_len of a script that measures a run on a batch (the
  run itself: `train.rundir.saved_run`);
- `check_text`: an evaluation --text (a text file or a prepared directory);
- `output_directory`, `output_file`: where a script writes;
- `source_files`, `check_source`: a corpus source of scripts/prepare_data.py and
  scripts/train_tokenizer.py (`train.data.sources.read_documents` reads it);
- `check_config`: a --config resolved (`config.resolve`) for the devices the environment names;
- `read_json_object`, `prepared_metadata`, `check_prepared`, `read_plan`: the files of a prepared
  dataset (metadata.json, `<split>-index.npy`, the plan prepare.json), a damaged one refused in
  one line naming it and the fix, and left as is.

A Hugging Face checkpoint's safetensors files are checked by `train.interop.safetensors_file`.
In `train.data`, the lowest layer that the scripts' library modules share; it imports only the
standard library, `config`, `sharding.environment`, `train.rundir` and `train.data.tokenizer`.
"""

from __future__ import annotations

import glob
import math
import os
from pathlib import Path

import ml_collections

from config import ConfigError, resolve
from config.mesh_shape import MESH_AXES
from sharding.environment import device_count_from_environment
from train.data.tokenizer import check_vocab, tokenizer_of
from train.rundir import DamagedFile, context_length, creation_problem, read_json


def check_analysis(saved: dict, batch: int, seq_len: int | None = None) -> None:
    """--batch and --seq_len of a script that measures the saved run on a batch of its
    validation data (`train.restore.restore_for_analysis`): a positive batch (a multiple of the
    local devices, when the environment names their count) and a length in [2, the model's
    context]."""
    devices = device_count_from_environment(os.environ) or 1
    if batch <= 0 or batch % devices:
        raise ConfigError(f"--batch={batch} is invalid: must be a positive multiple of the "
                          f"{devices} devices of the mesh's data axis")
    context = context_length(saved)
    if seq_len is not None and not 2 <= seq_len <= context:
        raise ConfigError(f"--seq_len={seq_len} is invalid: must be in [2, {context}] (the "
                          "model's max_seq_len)")


def check_text(text: str | Path | None) -> None:
    """An evaluation --text: a text file or a prepared directory (None: the run's own)."""
    path = Path(text) if text is not None else None
    if path is not None and not (path / "metadata.json").is_file() and not path.is_file():
        raise ConfigError(f"--text={text} is invalid: it is neither a text file nor a prepared "
                          "directory (scripts/prepare_data.py)")


def _creatable(path: Path, flag: str) -> None:
    """`path` can be created: its nearest existing ancestor is a directory this user may write."""
    if problem := creation_problem(path):
        raise ConfigError(f"{flag}={path} {problem}")


def output_directory(path: str | Path, flag: str = "--out") -> Path:
    """`path` as a directory a script writes into: an existing directory, or one it can create."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag}={path} is a file, not a directory; pass a directory (it is "
                          "created if missing)")
    _creatable(path, flag)
    return path


def output_file(path: str | Path, flag: str = "--out") -> Path:
    """`path` as a file a script writes (its directory is created if missing)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag}={path} is a directory; pass the path of a file to write, "
                          f"e.g. {path / 'plot.png'}")
    if not path.exists():
        _creatable(path, flag)
    elif not os.access(path, os.W_OK):
        raise ConfigError(f"{flag}={path} is not writable; pass a file you can write")
    return path


def source_files(source: str, flag: str = "--source") -> list[str]:
    """The files a source of comma-separated globs names, sorted; ConfigError when none."""
    patterns = [os.path.expanduser(p.strip()) for p in source.split(",") if p.strip()]
    files = sorted({f for p in patterns for f in glob.glob(p, recursive=True)
                    if os.path.isfile(f)})
    if not files:
        raise ConfigError(f"{flag}={source!r} is invalid: it matches no file; pass 'kjv', "
                          "'tfds:NAME', 'hf_disk:PATH' or globs of .txt/.jsonl/.parquet files")
    return files


def check_source(source: str, flag: str = "--source") -> None:
    """A corpus source (`train.data.sources.read_documents`): "kjv", "tfds:NAME",
    "hf_disk:PATH" (a directory) or globs that match a file. Whether a tfds dataset is prepared
    and a saved dataset loads is the reader's to find out."""
    if source == "kjv":
        return
    if source.startswith("tfds:"):
        if not source[len("tfds:"):]:
            raise ConfigError(f"{flag}={source!r} is invalid: name the dataset, tfds:NAME")
        return
    if source.startswith("hf_disk:"):
        path = os.path.expanduser(source[len("hf_disk:"):])
        if not os.path.isdir(path):
            raise ConfigError(f"{flag}={source!r} is invalid: {path} is not a directory; pass "
                              "hf_disk:PATH of a dataset saved with save_to_disk")
        return
    source_files(source, flag)


def check_config(config: ml_collections.ConfigDict) -> ml_collections.FrozenConfigDict:
    """`config` (its model.vocab_size 0 filled from its tokenizer, in place) resolved without
    JAX: for the devices the environment names
    (`sharding.environment.device_count_from_environment`: a CPU-only JAX), else for the fewest
    devices its mesh allows (its fixed axes, in ∏ mesh.dcn slices), so every rule but the real
    device count's arithmetic is checked before JAX loads.
    Raises ConfigError in one line."""
    check_vocab(config.model, tokenizer_of(config.data))
    devices = device_count_from_environment(os.environ)
    if devices is not None:
        return resolve(config, devices)
    slices = math.prod(config.mesh.dcn[axis] for axis in MESH_AXES)
    fixed = math.prod(size for size in (config.mesh[axis] for axis in MESH_AXES) if size > 0)
    return resolve(config, math.lcm(fixed, slices), slices)


# ---------------------------------------------------------------------------------------------
# The files of a prepared dataset (train.data.preparation writes them, train.data.shards reads them)

PLAN_FILE = "prepare.json"
METADATA_FILE = "metadata.json"
_REWRITE = ("rerun scripts/prepare_data.py with the same arguments to write it again (finished "
            "shards are kept)")


def _type_name(value: object) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean"}.get(
        type(value), "number" if isinstance(value, int | float) else type(value).__name__)


def read_json_object(path: str | Path, what: str, fix: str) -> dict:
    """The JSON object in the file `path`. Raises ConfigError, one line `"{what}: {path}
    {problem}; it is left as is: {fix}"`, if it is a directory, unreadable, not UTF-8 text, not
    JSON (e.g. truncated) or not a JSON object."""
    path = Path(path)

    def damaged(problem: str) -> ConfigError:
        return ConfigError(f"{what}: {path} {problem}; it is left as is: {fix}")

    try:
        value = read_json(path)
    except DamagedFile as problem:
        raise damaged(str(problem)) from None
    if not isinstance(value, dict):
        raise damaged(f"holds a JSON {_type_name(value)}, not an object")
    return value


# The fields of metadata.json that reading a prepared split relies on, with their types.
_METADATA_FIELDS = {"tokenizer": str, "tokenizer_fingerprint": str, "dtype": str,
                    "separator": int, "splits": dict}
_SPLIT_FIELDS = {"documents": int, "tokens": int, "text_bytes": int, "shards": list}
_SHARD_FIELDS = {"file": str, "file_size": int, "documents": int, "sha256": str}


def prepared_metadata(directory: str | Path, flag: str = "data.path") -> dict:
    """`directory/metadata.json` of a prepared dataset, once it is known to be a JSON object with
    the fields reading relies on. ConfigError naming the file and the fix otherwise."""
    path = Path(directory) / METADATA_FILE
    what = f"{flag}={str(directory)!r} is invalid"
    metadata = read_json_object(path, what, _REWRITE)

    def check_fields(record: object, fields: dict, where: str) -> None:
        for field, kind in fields.items():
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool):
                found = "is missing" if value is None else f"is a {_type_name(value)}"
                raise ConfigError(f"{what}: {path} is damaged ({where}{field} {found}, not a "
                                  f"{_type_name(kind())}); it is left as is: {_REWRITE}")

    check_fields(metadata, _METADATA_FIELDS, "")
    for split, info in metadata["splits"].items():
        check_fields(info, _SPLIT_FIELDS, f"splits.{split}.")
        for number, shard in enumerate(info["shards"]):
            check_fields(shard, _SHARD_FIELDS, f"splits.{split}.shards[{number}].")
    return metadata


def index_file(directory: str | Path, split: str) -> Path:
    """The document index of a prepared split, `<split>-index.npy`."""
    return Path(directory) / f"{split}-index.npy"


def _npy_problem(path: Path, length: int) -> str | None:
    """What is wrong with the .npy file `path` of `length` int64 values: its magic and its size
    (the header's length plus the data's), read without numpy."""
    with path.open("rb") as file:
        head = file.read(12)
    if len(head) < 10 or head[:6] != b"\x93NUMPY":
        return "is not a .npy file"
    if head[6] == 1:
        offset = 10 + int.from_bytes(head[8:10], "little")
    else:
        offset = 12 + int.from_bytes(head[8:12], "little")
    size, expected = path.stat().st_size, offset + 8 * length
    if size != expected:
        return f"is truncated or damaged ({size} bytes, not {expected})"
    return None


def check_index(directory: str | Path, split: str, documents: int | None = None,
                flag: str = "data.path") -> Path:
    """The index file of `split`, once it is a file (and, given its split's `documents`, a .npy
    file of documents + 1 int64 values by its size); ConfigError naming it and the fix."""
    path = index_file(directory, split)
    if not path.is_file():
        problem = "is a directory, not a file" if path.is_dir() else "is missing"
    else:
        try:
            problem = None if documents is None else _npy_problem(path, documents + 1)
        except OSError as error:
            problem = f"cannot be read ({error.strerror or error})"
    if problem is not None:
        kept = "" if problem == "is missing" else "it is left as is: "
        raise ConfigError(f"{flag}={str(directory)!r} is invalid: its index {path} {problem}; "
                          f"{kept}{_REWRITE}")
    return path


def check_prepared(data_config) -> None:
    """With `data.name="prepared"`, the metadata.json and the split indices of `data.path`,
    before the data libraries load (whether the shards read is the reader's to find out)."""
    if data_config.get("name") != "prepared" or not data_config.get("path"):
        return
    directory = Path(data_config.path)
    if not (directory / METADATA_FILE).exists():
        return  # the reader says how to prepare it
    for split, info in prepared_metadata(directory)["splits"].items():
        check_index(directory, split, info["documents"])


def read_plan(out: str | Path) -> dict | None:
    """The plan `OUT/prepare.json` of an earlier preparation into `out` (None if there is none):
    a JSON object, else ConfigError naming the file and the fix."""
    path = Path(out) / PLAN_FILE
    if not path.exists():
        return None
    return read_json_object(path, f"--out={out} is invalid", "delete it and rerun with the "
                            "arguments of the preparation in it (finished shards are kept), or "
                            "use a new --out")
