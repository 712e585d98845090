"""Every entry point reports a bad argument before it imports JAX: each script in
scripts/, the shell scripts that wrap one, `python -m train` and `python -m train.generate`, given
an unknown flag and, where it takes them, a bad value (a --workdir that holds no run, an
impossible number, an --out that is a file, a --config with a bad field), exits with status 2
and one error line on stderr, no traceback, and no heavy module (JAX, Flax, Orbax,
tensorflow_datasets, grain, tensorboardX) imported by then.

Each case runs in a fresh interpreter: a `python -c` wrapper that runs the entry point as its
command does (`runpy`, as `__main__`, with the script's directory first on sys.path) and prints
the heavy modules it finds loaded in a `finally`, so the observation does not depend on timing.
The shell scripts run as they are (their Python part is a case of its own).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from config.defaults import base_config
from tests.helpers import one_device_env

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("jax", "flax", "orbax", "tensorflow_datasets", "grain", "tensorboardX")
QUICKSTART = "experiments/quickstart.py"
BAD_FIELD = "--config.optimizer.learning_rate=-1"

# Runs TARGET (scripts/X.py, or a module for `python -m`) with ARGS as its command line would,
# then prints the heavy modules loaded, whatever the outcome (SystemExit included).
WRAPPER = f"""
import os, runpy, sys
target, *arguments = sys.argv[1:]
sys.argv = [target, *arguments]
try:
    if target.endswith(".py"):
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
finally:
    print(sorted(m for m in {HEAVY!r} if m in sys.modules), flush=True)
"""

# (entry point, arguments, a fragment of the error line). {run}: a directory holding a run
# (config.json and a checkpoint directory); {empty}: an empty directory; {file}: a file;
# {new}: a path that does not exist yet.
CASES = [
    ("train", ["--config", QUICKSTART, "--workdir", "{new}", "--no_such_flag"],
     "unrecognized argument '--no_such_flag'"),
    ("train", ["--config", QUICKSTART, "--workdir", "{new}", BAD_FIELD],
     "optimizer.learning_rate=-1"),
    ("train", ["--config", QUICKSTART, "--workdir", "{file}"], "is a file"),
    ("train.generate", ["--workdir", "{run}", "--no_such_flag"], "--no_such_flag"),
    ("train.generate", ["--workdir", "{empty}"], "holds no config.json"),
    ("train.generate", ["--workdir", "{run}", "--num_tokens", "-1"], "--num_tokens=-1"),
    ("scripts/accelerator_check.py", ["--no_such_flag"], "--no_such_flag"),
    ("scripts/accounting.py", ["--no_such_flag"], "--no_such_flag"),
    ("scripts/accounting.py", ["--config", QUICKSTART, BAD_FIELD],
     "optimizer.learning_rate=-1"),
    ("scripts/accounting.py", ["--shape", "gpt3"], "--shape: unknown ['gpt3']"),
    ("scripts/attention_bench.py", ["--config", QUICKSTART, "--no_such_flag"], "--no_such_flag"),
    ("scripts/attention_bench.py", ["--config", QUICKSTART, BAD_FIELD],
     "optimizer.learning_rate=-1"),
    ("scripts/attention_bench.py", ["--config", QUICKSTART, "--memory", "0,64"], "--memory=0,64"),
    ("scripts/bench.py", ["--config", QUICKSTART, "--no_such_flag"], "--no_such_flag"),
    ("scripts/bench.py", ["--config", QUICKSTART, BAD_FIELD], "optimizer.learning_rate=-1"),
    ("scripts/bench.py", ["--config", QUICKSTART, "--compare", "model.num_layers=0"],
     "--compare num_layers=0: model.num_layers=0 is invalid"),
    ("scripts/data_memory.py", ["--out", "{new}", "--no_such_flag"], "--no_such_flag"),
    ("scripts/data_memory.py", ["--out", "{file}"], "is a file"),
    ("scripts/data_memory.py", ["--out", "{new}", "--scales", "0"], "--scales=0"),
    ("scripts/depth_mixing.py", ["--workdir", "{run}", "--no_such_flag"], "--no_such_flag"),
    ("scripts/depth_mixing.py", ["--workdir", "{empty}"], "holds no config.json"),
    ("scripts/depth_mixing.py", ["--workdir", "{run}", "--seq_len", "1"], "--seq_len=1"),
    ("scripts/dry_run.py", ["--config", QUICKSTART, "--devices", "8", "--no_such_flag"],
     "--no_such_flag"),
    ("scripts/dry_run.py", ["--config", QUICKSTART, "--devices", "0"], "--devices=0"),
    ("scripts/dry_run.py", ["--config", QUICKSTART, "--devices", "8", BAD_FIELD],
     "optimizer.learning_rate=-1"),
    ("scripts/evaluate.py", ["--workdir", "{run}", "--task", "{file}", "--no_such_flag"],
     "--no_such_flag"),
    ("scripts/evaluate.py", ["--workdir", "{run}", "--task", "{file}"], "is not an item"),
    ("scripts/evaluate.py", ["--workdir", "{empty}", "--task", "{file}"], "holds no config.json"),
    ("scripts/export_hf.py", ["--workdir", "{run}", "--out", "{new}", "--no_such_flag"],
     "--no_such_flag"),
    ("scripts/export_hf.py", ["--workdir", "{empty}", "--out", "{new}"], "holds no config.json"),
    ("scripts/export_hf.py", ["--workdir", "{run}", "--out", "{file}"], "is a file"),
    ("scripts/export_hf.py", ["--workdir", "{run}", "--out", "{new}", "--ema"],
     "--ema is invalid: the run in --workdir="),
    ("scripts/chaos_soak.py", ["--workdir", "{new}", "--no_such_flag"], "--no_such_flag"),
    ("scripts/chaos_soak.py", ["--workdir", "{file}"], "is a file"),
    ("scripts/chaos_soak.py", ["--workdir", "{new}", "--interruptions", "0"],
     "0 is invalid: must be a positive integer"),
    ("scripts/chaos_soak.py", ["--workdir", "{new}", "--reference", "{empty}"],
     "holds no config.json; pass a finished run"),
    ("scripts/chaos_soak.py", ["--workdir", "{new}", "--steps", "7"],
     "--steps=7 is too few: the job checkpoints every 4 steps; pass at least 8"),
    ("scripts/gr_paths.py", ["--workdir", "{run}", "--no_such_flag"], "--no_such_flag"),
    ("scripts/gr_paths.py", ["--workdir", "{run}", "--step", "7"],
     "holds no restorable checkpoint at step 7 (its checkpoints: [3])"),
    ("scripts/import_hf.py", ["--checkpoint", "{empty}", "--workdir", "{new}", "--no_such_flag"],
     "--no_such_flag"),
    ("scripts/import_hf.py", ["--checkpoint", "{empty}", "--workdir", "{new}"],
     "holds no config.json"),
    ("scripts/import_hf.py", ["--checkpoint", "{empty}", "--workdir", "{run}", "--seq_len", "0"],
     "--seq_len"),
    ("scripts/prepare_data.py", ["--source", "kjv", "--out", "{new}", "--no_such_flag"],
     "--no_such_flag"),
    ("scripts/prepare_data.py", ["--source", "{empty}/*.jsonl", "--out", "{new}"],
     "it matches no file"),
    ("scripts/prepare_data.py", ["--source", "kjv", "--out", "{new}", "--workers", "0"],
     "--workers"),
    ("scripts/prepare_data.py", ["--source", "kjv", "--tokenizer", "hf:{empty}", "--out", "{new}"],
     "data.tokenizer="),
    ("scripts/probe_report.py", ["--workdir", "{run}", "--no_such_flag"], "--no_such_flag"),
    ("scripts/probe_report.py", ["--workdir", "{run}", "--prune", "2"], "--prune=2"),
    ("scripts/probe_report.py", ["--workdir", "{run}", "--text", "{empty}/no.txt"], "--text="),
    ("scripts/prune_heads.py", ["--workdir", "{run}", "--out", "{new}", "--no_such_flag"],
     "--no_such_flag"),
    ("scripts/prune_heads.py", ["--workdir", "{run}", "--out", "{new}", "--structures", "rows"],
     "--structures=rows"),
    ("scripts/prune_heal.py", ["--workdir", "{run}", "--out", "{new}", "--no_such_flag"],
     "--no_such_flag"),
    ("scripts/prune_heal.py", ["--workdir", "{run}", "--out", "{new}", "--fractions", "1.0"],
     "--fractions=1.0 is invalid: it drops 2 of 2 blocks"),
    ("scripts/quantize.py", ["--workdir", "{run}", "--method", "int8", "--out", "{new}",
                             "--no_such_flag"], "--no_such_flag"),
    ("scripts/quantize.py", ["--workdir", "{run}", "--method", "int5", "--out", "{new}"],
     "--method"),
    ("scripts/quantize.py", ["--workdir", "{run}", "--method", "int8", "--out", "{run}"],
     "already holds a run"),
    ("scripts/study_probes.py", ["--root", "{empty}", "--no_such_flag"], "--no_such_flag"),
    ("scripts/study_probes.py", ["--root", "{empty}"], "has no study.json"),
    ("scripts/study_probes.py", ["--root", "{empty}", "--batch", "0"], "--batch"),
    ("scripts/study_report.py", ["--root", "{empty}", "--no_such_flag"], "--no_such_flag"),
    ("scripts/study_report.py", ["--root", "{file}"], "is not a directory"),
    ("scripts/sweep.py", ["--study", "{empty}/none.py", "--root", "{new}", "--no_such_flag"],
     "--no_such_flag"),
    ("scripts/sweep.py", ["--study", "{empty}/none.py", "--root", "{new}"], "does not exist"),
    ("scripts/train_tokenizer.py", ["--data", "kjv", "--vocab_size", "300", "--out", "{new}",
                                    "--no_such_flag"], "--no_such_flag"),
    ("scripts/train_tokenizer.py", ["--data", "kjv", "--vocab_size", "100", "--out", "{new}"],
     "--vocab_size=100"),
    ("scripts/train_tokenizer.py", ["--data", "kjv", "--vocab_size", "300", "--out", "{file}"],
     "is a file"),
]
SHELL_CASES = [
    ("scripts/accelerator_check.sh", ["--no_such_flag"], "--no_such_flag"),
    ("scripts/launch_tpu_pod.sh", ["--no_such_flag"], "unknown argument --no_such_flag"),
]


def _ids(cases: list[tuple]) -> list[str]:
    """`stem-unknown` for an unknown flag, `stem-value-K` for the K-th bad value."""
    ids, counts = [], {}
    for target, arguments, _ in cases:
        stem = Path(target).stem if target.endswith((".py", ".sh")) else target
        if "--no_such_flag" in arguments:
            ids.append(f"{stem}-unknown")
        else:
            counts[stem] = counts.get(stem, 0) + 1
            ids.append(f"{stem}-value-{counts[stem]}")
    return ids


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """The paths the cases name: a run directory (a 2-layer byte model's config.json and an
    empty checkpoint directory at step 3: enough for the checks, which read no checkpoint), an
    empty directory, a file and a path that does not exist."""
    root = tmp_path_factory.mktemp("entry_points")
    run = root / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    config = base_config()
    config.model.num_layers, config.model.vocab_size = 2, 256
    (run / "config.json").write_text(json.dumps(config.to_dict()))
    (root / "empty").mkdir()
    (root / "file").write_text("not a directory\n")
    return {"run": str(run), "empty": str(root / "empty"), "file": str(root / "file"),
            "new": str(root / "new" / "out")}


def _environment() -> dict[str, str]:
    env = one_device_env()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT)
    return env


def _check_error(done: subprocess.CompletedProcess, fragment: str) -> None:
    """Status 2 and one error line on stderr (argparse's usage lines allowed before it)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    lines = done.stderr.splitlines()
    while lines and (lines[0].startswith("usage:") or lines[0].startswith(" ")):
        lines.pop(0)
    assert len(lines) == 1 and "error: " in lines[0], done.stderr
    assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_a_bad_argument_is_one_line_before_jax_is_imported(paths, case):
    target, arguments, fragment = case
    arguments = [argument.format(**paths) for argument in arguments]
    done = subprocess.run([sys.executable, "-c", WRAPPER, target, *arguments], cwd=ROOT,
                          env=_environment(), capture_output=True, text=True, timeout=120)
    _check_error(done, fragment)
    assert done.stdout.splitlines()[-1:] == ["[]"], done.stdout


@pytest.mark.parametrize("case", SHELL_CASES, ids=_ids(SHELL_CASES))
def test_a_shell_script_reports_a_bad_argument_in_one_line(case):
    target, arguments, fragment = case
    done = subprocess.run([str(ROOT / target), *arguments], cwd=ROOT, env=_environment(),
                          capture_output=True, text=True, timeout=120)
    _check_error(done, fragment)


def test_every_entry_point_has_a_case():
    """A new script (or one that wraps a script) gets its cases here."""
    scripts = {f"scripts/{path.name}" for path in (ROOT / "scripts").glob("*.py")}
    covered = {target for target, _, _ in CASES}
    assert scripts <= covered and {"train", "train.generate"} <= covered, scripts - covered
    wrappers = {f"scripts/{path.name}" for path in (ROOT / "scripts").glob("*.sh")}
    assert wrappers == {target for target, _, _ in SHELL_CASES}


@pytest.mark.parametrize("script, library, name", [
    ("quantize", "train.interop.quantize", "METHODS"),
    ("prune_heads", "train.instruments.head_pruning", "STRUCTURES"),
    ("prune_heal", "train.instruments.pruning_report", "SELECTIONS"),
])
def test_the_names_a_script_checks_are_the_librarys(script, library, name):
    """A script checks names against its own copy of the library's list (the library imports
    JAX); the copies agree."""
    ours = getattr(importlib.import_module(f"scripts.{script}"), name)
    assert ours == getattr(importlib.import_module(library), name)


def test_the_reference_shapes_accounting_checks_are_archs():
    from arch import reference_shapes as shapes

    ours = importlib.import_module("scripts.accounting").SHAPES
    assert list(ours) == ["transformer_base", *shapes.worked_examples(), *shapes.PUBLIC_CONFIGS]


def test_the_library_modules_the_scripts_run_parse_no_command_line():
    """Command lines live in scripts/ (and the `python -m` entry points, train/__main__.py and
    train/generate.py): the library modules the scripts run hold no parser, so a script checks
    its arguments before it imports them."""
    found = [str(path.relative_to(ROOT))
             for package in ("instruments", "interop", "studies", "data")
             for path in sorted((ROOT / "train" / package).glob("*.py"))
             if "ArgumentParser" in path.read_text()]
    assert not found, found
