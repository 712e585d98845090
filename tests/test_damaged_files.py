"""Damaged run files (issue 44, item 3; the table in docs/runs.md): each is one line on stderr
naming the file, exit status 2, no traceback, and the file left exactly as it was.

Per file and damage kind (bytes that are not UTF-8, the wrong JSON type, truncated, a directory
in its place, where each applies) the real entry point runs in a subprocess: `python -m train`
on a run directory (its lock, config.json, metrics.jsonl) or a prepared dataset (its
metadata.json and indices) or with a tokenizer file, `scripts/prepare_data.py` on a plan or a
shard's statistics, `scripts/study_report.py` on a study.json, `scripts/sweep.py --tuned` on a
tuning.json and `scripts/import_hf.py` on a Hugging Face directory. Every case is refused before
JAX loads, so each costs about a second."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import EXPLORATORY, one_device_env, tiny_prepared

REPO = Path(__file__).resolve().parents[1]
GARBAGE = b"\xff\xfe\x00\x9c not utf-8 \x80\x81"
TRAIN = ("-m", "train", "--config", "experiments/quickstart.py")


def state(path: Path) -> object:
    """What must not change: a file's bytes, a directory's listing, or absence."""
    if path.is_dir():
        return ("directory", sorted(str(p.relative_to(path)) for p in path.rglob("*")))
    return path.read_bytes() if path.exists() else None


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def replace_with_directory(path: Path) -> None:
    if path.exists():
        path.unlink()
    path.mkdir()
    (path / "inside").write_text("kept\n")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "garbage": lambda path: path.write_bytes(GARBAGE),
    "list": lambda path: path.write_text("[1, 2, 3]\n"),
    "truncated": truncate,
    "directory": replace_with_directory,
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A tiny prepared dataset (bytes, 8 documents) with its plan prepare.json."""
    return tiny_prepared(tmp_path_factory, docs_per_shard=4)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory) -> Path:
    """A directory shaped like a Hugging Face checkpoint: config.json and model.safetensors."""
    from safetensors.numpy import save_file

    directory = tmp_path_factory.mktemp("hf") / "checkpoint"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 4, "intermediate_size": 64, "vocab_size": 256}))
    save_file({"model.embed_tokens.weight": np.zeros((256, 32), np.float32)},
              str(directory / "model.safetensors"))
    return directory


def run_dir(root: Path, *, checkpoints: bool = True) -> Path:
    """A run directory as a trainer leaves it, without training: the checkpoint directories
    `python -m train` looks for before JAX loads, and a metrics.jsonl."""
    workdir = root / "run"
    if checkpoints:
        for step in (2, 4):
            (workdir / "checkpoints" / str(step)).mkdir(parents=True)
    workdir.mkdir(exist_ok=True)
    (workdir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "train_loss": 5.0}) + "\n" for step in (1, 2, 3, 4)))
    (workdir / "lock").write_text("")
    return workdir


def copy(source: Path, root: Path) -> Path:
    return Path(shutil.copytree(source, root / source.name))


# (file, damage) -> (setup(tmp_path, prepared, hf) -> (argv, damaged path), expected fragment)
Case = tuple[Callable[[Path, Path, Path], tuple[list[str], Path]], str]


def lock_case(tmp_path, prepared, hf):
    workdir = run_dir(tmp_path, checkpoints=False)
    return [*TRAIN, "--workdir", str(workdir)], workdir / "lock"


def config_case(tmp_path, prepared, hf):
    workdir = run_dir(tmp_path)
    (workdir / "config.json").write_text(json.dumps({"seed": 0}))
    return [*TRAIN, "--workdir", str(workdir)], workdir / "config.json"


def metrics_case(tmp_path, prepared, hf):
    workdir = run_dir(tmp_path, checkpoints=False)
    return [*TRAIN, "--workdir", str(workdir)], workdir / "metrics.jsonl"


def prepared_case(name):
    def setup(tmp_path, prepared, hf):
        data = copy(prepared, tmp_path)
        return ([*TRAIN, "--workdir", str(tmp_path / "run"), "--config.data.name=prepared",
                 f"--config.data.path={data}"], data / name)
    return setup


def plan_case(tmp_path, prepared, hf):
    data = copy(prepared, tmp_path)
    sources = tmp_path / "sources"
    sources.mkdir()
    (sources / "a.txt").write_text("a document\n")
    return (["scripts/prepare_data.py", "--source", str(sources / "*.txt"), "--out", str(data),
             "--workers", "1"], data / "prepare.json")


def study_case(tmp_path, prepared, hf):
    root = tmp_path / "sweep"
    root.mkdir()
    (root / "study.json").write_text(json.dumps({
        "study": "experiments/quickstart.py", "scale": "tiny", "cells": ["a"], "seeds": [0]}))
    return ["scripts/study_report.py", "--root", str(root)], root / "study.json"


def shard_stats_case(tmp_path, prepared, hf):
    """The preparation rerun with its own arguments: it resumes, reading each shard's .json."""
    data = copy(prepared, tmp_path)
    plan = json.loads((data / "prepare.json").read_text())
    return (["scripts/prepare_data.py", "--source", plan["source"], "--tokenizer", "byte",
             "--out", str(data), "--docs_per_shard", str(plan["docs_per_shard"]),
             "--validation_every", str(plan["validation_every"]), "--workers", "1"],
            data / "train-00000.json")


def tokenizer_case(tmp_path, prepared, hf):
    from train.data.tokenizer import ByteTokenizer

    directory = tmp_path / "tokenizer"
    directory.mkdir()
    ByteTokenizer.as_hugging_face().save(str(directory / "tokenizer.json"))
    return ([*TRAIN, "--workdir", str(tmp_path / "run"), f"--config.data.tokenizer=hf:{directory}",
             "--config.model.vocab_size=0"], directory / "tokenizer.json")


TUNING_STUDY = '''"""A one-arm study with a learning-rate grid, for the tests."""

from experiments.common import base_config

ARMS = ("a",)
BASELINE = "a"
SEEDS = (0,)
SCALES = ("cpu",)
TUNING = dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=3)


def get_config(arg=None):
    return base_config()
'''


def tuning_case(tmp_path, prepared, hf):
    """`scripts/sweep.py --tuned` of a sweep whose tuning.json is intact before the damage."""
    study = tmp_path / "tiny.py"
    study.write_text(TUNING_STUDY)
    root = tmp_path / "sweep"
    root.mkdir()
    (root / "tuning.json").write_text(json.dumps({
        "study": str(study), "scale": "cpu", "seed": 3, "steps": None, "fraction": 0.1,
        "overrides": [], "max_extensions": 4, "cells": {"a": {
            "shared_rate": 3e-3, "grid": [{"rate": 1e-3, "loss": 2.5, "state": "finished"}],
            "pick": 1e-3, "interior": False, "extensions": 0}}}))
    return (["scripts/sweep.py", *EXPLORATORY, "--study", str(study), "--root", str(root),
             "--tuned", "--launch", "print"], root / "tuning.json")


def hf_case(name):
    def setup(tmp_path, prepared, hf):
        checkpoint = copy(hf, tmp_path)
        if name.endswith(".index.json"):
            (checkpoint / name).write_text(json.dumps(
                {"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}))
        return (["scripts/import_hf.py", "--checkpoint", str(checkpoint), "--workdir",
                 str(tmp_path / "imported")], checkpoint / name)
    return setup


def write(text: str | bytes) -> Callable[[Path], None]:
    return lambda path: (path.write_bytes(text) if isinstance(text, bytes)
                         else path.write_text(text))


def edit_json(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        record = json.loads(path.read_text())
        change(record)
        path.write_text(json.dumps(record))
    return damage


def flip_documents(metadata: dict) -> None:
    metadata["splits"]["train"]["documents"] = "many"


def json_lines(*lines: bytes) -> Callable[[Path], None]:
    return write(b"".join(line + b"\n" for line in lines))


FIX_RERUN_PREPARE = "rerun scripts/prepare_data.py with the same arguments to write it again"
CASES: dict[str, tuple[Callable, Callable[[Path], None], str]] = {
    # name: (setup, damage, the fragments the line must hold, "|"-separated)
    "lock-garbage": (lock_case, DAMAGE["garbage"], "lock holds bytes that are not UTF-8 text; "
                     "it is left as is: if no trainer is using this directory, delete it"),
    "lock-list": (lock_case, DAMAGE["list"], "lock holds a JSON list"),
    "lock-truncated": (lock_case, write('{"host": "h", "pi'), "lock is not JSON"),
    "lock-directory": (lock_case, DAMAGE["directory"], "lock is a directory, not a file"),
    "config-garbage": (config_case, DAMAGE["garbage"], "config.json holds bytes that are "
                       "not UTF-8 text; it is left as is, and its checkpoints (steps 2..4) are "
                       "kept|--config.resume_mode=finetune --config.finetune_from="),
    "config-list": (config_case, DAMAGE["list"], "config.json holds a JSON list, not the "
                    "object of a config|put back a copy of the run's config.json to resume"),
    "config-truncated": (config_case, truncate, "config.json is not valid JSON"),
    "config-directory": (config_case, DAMAGE["directory"], "config.json is a directory"),
    "config-missing": (config_case, lambda path: path.unlink(), "config.json is missing, so its "
                       "checkpoints cannot be checked against this config; its checkpoints "
                       "(steps 2..4) are kept|"
                       "--config.finetune_from="),
    "metrics-garbage": (metrics_case, json_lines(b'{"step": 1}', GARBAGE, b'{"step": 3}'),
                        "metrics.jsonl line 2 holds bytes that are not UTF-8 text; it is left "
                        "as is: move it aside"),
    "metrics-step-type": (metrics_case, json_lines(b'{"step": "one"}'),
                          "metrics.jsonl line 1 has step='one', not an integer"),
    "metrics-list": (metrics_case, json_lines(b"[1, 2]", b'{"step": 2}'),
                     "metrics.jsonl line 1 holds a JSON list, not an object"),
    "metrics-truncated-line": (metrics_case, json_lines(b'{"step": 1, "tra', b'{"step": 2}'),
                               "metrics.jsonl line 1 is not JSON"),
    "metrics-directory": (metrics_case, DAMAGE["directory"], "metrics.jsonl is a directory"),
    "metadata-garbage": (prepared_case("metadata.json"), DAMAGE["garbage"],
                         "metadata.json holds bytes that are not UTF-8 text; it is left as "
                         f"is: {FIX_RERUN_PREPARE}"),
    "metadata-list": (prepared_case("metadata.json"), DAMAGE["list"],
                      "metadata.json holds a JSON list, not an object"),
    "metadata-truncated": (prepared_case("metadata.json"), truncate,
                           "metadata.json is not valid JSON ("),
    "metadata-directory": (prepared_case("metadata.json"), DAMAGE["directory"],
                           "metadata.json is a directory"),
    "metadata-field-type": (prepared_case("metadata.json"), edit_json(flip_documents),
                            "metadata.json is damaged (splits.train.documents is a string, "
                            "not a number)"),
    "index-missing": (prepared_case("train-index.npy"), lambda path: path.unlink(),
                      f"train-index.npy is missing; {FIX_RERUN_PREPARE}"),
    "index-garbage": (prepared_case("train-index.npy"), DAMAGE["garbage"],
                      "train-index.npy is not a .npy file; it is left as is"),
    "index-truncated": (prepared_case("validation-index.npy"), truncate,
                        "validation-index.npy is truncated or damaged ("),
    "index-directory": (prepared_case("train-index.npy"), DAMAGE["directory"],
                        "train-index.npy is a directory"),
    "plan-garbage": (plan_case, DAMAGE["garbage"], "prepare.json holds bytes that are not "
                     "UTF-8 text; it is left as is: delete it and rerun with the arguments"),
    "plan-list": (plan_case, DAMAGE["list"], "prepare.json holds a JSON list"),
    "plan-truncated": (plan_case, truncate, "prepare.json is not valid JSON"),
    "plan-directory": (plan_case, DAMAGE["directory"], "prepare.json is a directory"),
    "study-garbage": (study_case, DAMAGE["garbage"], "study.json holds bytes that are not "
                      "UTF-8 text; it is left as is: put back a copy, or move it aside and "
                      "rerun scripts/sweep.py"),
    "study-list": (study_case, DAMAGE["list"], "study.json holds a JSON list"),
    "study-field-type": (study_case, edit_json(lambda record: record.update(seeds="0,1")),
                         "study.json has seeds='0,1', not a list of int"),
    "study-truncated": (study_case, truncate, "study.json is not valid JSON"),
    "study-directory": (study_case, DAMAGE["directory"], "study.json is a directory"),
    "shard-stats-garbage": (shard_stats_case, DAMAGE["garbage"], "train-00000.json holds bytes "
                            "that are not UTF-8 text; it is left as is: delete it and "
                            "train-00000.array_record and rerun with the same arguments"),
    "shard-stats-list": (shard_stats_case, DAMAGE["list"], "train-00000.json holds a JSON list"),
    "shard-stats-truncated": (shard_stats_case, truncate, "train-00000.json is not valid JSON"),
    "shard-stats-directory": (shard_stats_case, DAMAGE["directory"],
                              "train-00000.json is a directory"),
    "shard-stats-field-type": (shard_stats_case, edit_json(lambda stats: stats.update(
        documents="four")), "train-00000.json is damaged (documents='four', not an integer)"),
    "tokenizer-garbage": (tokenizer_case, DAMAGE["garbage"], "tokenizer.json is not a Hugging "
                          "Face tokenizer.json (|pass a tokenizer.json written by the tokenizers"),
    "tokenizer-list": (tokenizer_case, DAMAGE["list"], "is not a Hugging Face tokenizer.json ("),
    "tokenizer-truncated": (tokenizer_case, truncate, "is not a Hugging Face tokenizer.json ("),
    "tokenizer-directory": (tokenizer_case, DAMAGE["directory"],
                            "tokenizer.json is a directory, not a file"),
    "tuning-garbage": (tuning_case, DAMAGE["garbage"], "tuning.json holds bytes that are not "
                       "UTF-8 text; it is left as is: put back a copy, or move it aside and "
                       "rerun scripts/sweep.py --tune"),
    "tuning-list": (tuning_case, DAMAGE["list"], "tuning.json holds a JSON list"),
    "tuning-field-type": (tuning_case, edit_json(lambda record: record["cells"]["a"].update(
        pick="fast")), "tuning.json has cells.a.pick='fast', not a number or null"),
    "tuning-truncated": (tuning_case, truncate, "tuning.json is not valid JSON"),
    "tuning-directory": (tuning_case, DAMAGE["directory"], "tuning.json is a directory"),
    "hf-config-garbage": (hf_case("config.json"), DAMAGE["garbage"], "config.json holds bytes "
                          "that are not UTF-8 text; it is left as is: download or copy the "
                          "checkpoint's files again"),
    "hf-config-list": (hf_case("config.json"), DAMAGE["list"], "config.json holds a JSON list"),
    "hf-config-truncated": (hf_case("config.json"), truncate, "config.json is not valid JSON"),
    "hf-config-directory": (hf_case("config.json"), DAMAGE["directory"],
                            "config.json is a directory"),
    "hf-weights-garbage": (hf_case("model.safetensors"), DAMAGE["garbage"],
                           "model.safetensors is truncated or not safetensors"),
    "hf-weights-truncated": (hf_case("model.safetensors"), truncate,
                             "model.safetensors is truncated or damaged ("),
    "hf-weights-directory": (hf_case("model.safetensors"), DAMAGE["directory"],
                             "model.safetensors is a directory"),
    "hf-index-list": (hf_case("model.safetensors.index.json"), DAMAGE["list"],
                      "model.safetensors.index.json holds a JSON list"),
    "hf-index-no-weight-map": (hf_case("model.safetensors.index.json"), write("{}"),
                               "model.safetensors.index.json has no weight_map object"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_damaged_file_is_one_line_and_left_as_is(name, tmp_path, prepared, hf_checkpoint):
    setup, damage, fragments = CASES[name]
    argv, path = setup(tmp_path, prepared, hf_checkpoint)
    damage(path)
    before = state(path)
    run = subprocess.run([sys.executable, *argv], cwd=REPO, env=one_device_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(path) in last, run.stderr[-3000:]
    for fragment in fragments.split("|"):
        assert fragment in last, last
    assert state(path) == before


def test_the_library_readers_raise_one_line_for_damaged_files(tmp_path, prepared,
                                                               hf_checkpoint):
    """The readers behind the entry points (after JAX loads, and for library callers) give the
    same one-line ConfigError: a Hugging Face config.json without model_type, a truncated
    safetensors file, a prepared split's index of the wrong length, a torn metrics line."""
    from config import ConfigError
    from train.data.shards import PreparedDataset
    from train.data.tokenizer import load_tokenizer
    from train.interop.hf import read_hf_config, read_safetensors
    from train.rundir import truncate_metrics

    checkpoint = copy(hf_checkpoint, tmp_path)
    (checkpoint / "config.json").write_text(json.dumps({"hidden_size": 32}))
    with pytest.raises(ConfigError, match="has no model_type string"):
        read_hf_config(checkpoint)
    truncate(checkpoint / "model.safetensors")
    with pytest.raises(ConfigError, match="model.safetensors is truncated or damaged"):
        read_safetensors(checkpoint)

    data = copy(prepared, tmp_path)
    np.save(data / "train-index.npy", np.arange(3, dtype=np.int64))
    with pytest.raises(ConfigError, match="train-index.npy is truncated or damaged"):
        PreparedDataset(data, "train", load_tokenizer("byte"))

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"st')  # a torn last line
    assert truncate_metrics(metrics, 1) == 3
    assert metrics.read_text() == '{"step": 1}\n'


@pytest.mark.slow
def test_a_run_without_its_config_json_is_fine_tuned_from_its_checkpoints(tmp_path):
    """The way on that the config.json cases name: with the damaged file moved aside, a
    fine-tune into a new directory starts from the checkpoints' weights."""
    from tests.helpers import tiny_config
    from train.loop import train
    from train.step import resolve_for_job

    def config(**fields):
        config = tiny_config()
        config.update(dict(steps=3, checkpoint_every=1, mesh=dict(data=-1), **fields))
        return resolve_for_job(config)

    old = tmp_path / "old"
    first = train(config(), old)
    (old / "config.json").rename(old / "config.json.damaged")
    tuned = train(config(resume_mode="finetune", finetune_from=str(old)), tmp_path / "new")
    assert tuned["step"] == 3 and (tmp_path / "new" / "config.json").is_file()
    first_loss = json.loads((old / "metrics.jsonl").read_text().splitlines()[0])["train_loss"]
    tuned_loss = json.loads((tmp_path / "new" / "metrics.jsonl").read_text().splitlines()[0])
    assert tuned_loss["train_loss"] < first_loss  # it starts from the trained weights
    assert first["step"] == 3
