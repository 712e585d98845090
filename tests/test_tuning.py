"""A learning rate per arm (train/studies/tuning.py, scripts/sweep.py --tune / --tuned): the
grid's extension, the tuning split (disjoint from validation and from the tuning runs' training
windows; the default data path unchanged), the per-arm rate on each cell's command line, the
report's tables and the one-line errors of a bad TUNING.

The tuning sweep is tested with its runner stubbed at the subprocess boundary (`fake_runner`
writes each run's config.json and metrics.jsonl, its loss a function of its rate); the runner
itself (`train.studies.sweep.run_local`) is tested end to end in tests/test_study.py, and one
real run here trains on the tuning split (marked slow).
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import ml_collections
import numpy as np
import pytest

from config import ConfigError
from config.cli import UsageError
from config.defaults import base_config
from config.validate import check_training
from scripts import sweep as sweep_script
from tests.helpers import EXPLORATORY, one_device_env
from train.data import in_memory, shards
from train.studies import study as studies
from train.studies import tuning
from train.studies.report import Result, grid_table, regimes_table, write_report

ROOT = Path(__file__).resolve().parents[1]

STUDY = '''"""A tiny study with a learning-rate grid, for the tests."""

from experiments.common import base_config, claim

ARMS = ("a", "b")
BASELINE = "a"
SEEDS = (0, 1)
SCALES = ("cpu",)
CLAIMS = (claim("b", "<", "a", quote="b beats a", source="the tests", family="f", n=2),)
TUNING = dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=3, steps=2)


def get_config(arg=None):
    arm, _, scale = (arg or "a").partition(",")
    config = base_config()
    config.update(steps=3, batch_size=8, seq_len=16, log_every=1, eval_every=1000,
                  eval_batches=1, checkpoint_every=1000, sample_tokens=0)
    config.optimizer.warmup_steps = 1
    config.mesh.data = 1
    config.model.d_model, config.model.num_layers = 32, 2
    return config
'''


def write_study(directory: Path, text: str = STUDY) -> studies.Study:
    path = directory / "tiny.py"
    path.write_text(text)
    return studies.load_study(str(path))


def rate_of(run) -> float:
    """The learning rate a run's command line sets (its last such override)."""
    flags = [flag for flag in run.flags() if flag.startswith("--config.optimizer.learning_rate=")]
    return float(flags[-1].split("=", 1)[1])


def fake_runner(optimum: dict[str, float], diverge_above: float = math.inf, calls=None):
    """A stand-in for `sweep.run_local`: each run "finishes" with tuning loss
    2 + log2(rate / optimum[cell])², or (above `diverge_above`) stops at step 1 without one."""
    def run(runs) -> int:
        if calls is not None:
            calls.append(runs)
        for run in runs:
            rate = rate_of(run)
            run.workdir.mkdir(parents=True, exist_ok=True)
            (run.workdir / "config.json").write_text(json.dumps({"steps": 2}))
            if rate > diverge_above:
                record = {"step": 1, "train_loss": float("nan")}
            else:
                loss = 2 + math.log2(rate / optimum[run.cell]) ** 2
                record = {"step": 2, "train_loss": loss, "eval_loss": loss}
            (run.workdir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        return 0
    return run


# The grid's extension, as a function of (rate → loss) ------------------------------------------

@pytest.mark.parametrize("losses, expected", [
    ({1.0: 3.0, 2.0: 2.0, 4.0: 2.5}, None),            # interior: stop
    ({1.0: 2.0, 2.0: 2.5, 4.0: 3.0}, 0.5),             # best at the lowest: halve it
    ({1.0: 3.0, 2.0: 2.5, 4.0: 2.0}, 8.0),             # best at the highest: double it
    ({1.0: 3.0, 2.0: 2.5, 4.0: None}, None),           # the highest failed: 2.0 is interior
    ({1.0: None, 2.0: None, 4.0: None}, None),         # nothing finished: no pick, no extension
    ({1.0: 2.0, 2.0: 2.0, 4.0: 2.5}, 0.5),             # a tie: the lower rate
])
def test_the_grid_extends_at_the_edge_of_its_best_rate_and_stops_inside(losses, expected):
    assert tuning.extension(losses) == expected


def test_tuning_widens_the_grid_until_the_best_rate_is_interior(tmp_path):
    study = write_study(tmp_path)
    calls = []
    root = tmp_path / "root"
    record = tuning.tune(study, root, "cpu", ["a", "b"], [],
                         runner=fake_runner({"a": 4e-3, "b": 6.4e-2}, calls=calls))
    a, b = record["cells"]["a"], record["cells"]["b"]
    assert a["pick"] == 4e-3 and a["interior"] and a["extensions"] == 0
    assert [row["rate"] for row in a["grid"]] == [1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2]
    # b's best is 4 times the top of the grid: at the edge after 3.2e-2 and 6.4e-2, interior
    # once 1.28e-1 shows the loss rising again
    assert b["pick"] == pytest.approx(6.4e-2) and b["interior"] and b["extensions"] == 3
    assert [row["rate"] for row in b["grid"]][-3:] == pytest.approx([3.2e-2, 6.4e-2, 1.28e-1])
    assert b["shared_rate"] == base_config().optimizer.learning_rate
    assert [len(runs) for runs in calls] == [10, 1, 1, 1]  # each round runs only the new rates
    for run in (run for runs in calls for run in runs):
        assert run.seed == 3 and run.workdir == tuning.tuning_dir(root, run.cell, rate_of(run))
        assert {"--config.data.tuning_fraction=0.1", "--config.steps=2"} <= set(run.flags())
    assert json.loads((root / tuning.TUNING_RECORD).read_text()) == record
    assert tuning.summary(record, ["a"])[0].startswith("arm=a: lr=0.004 (tuning loss 2.0000")
    # a rerun finds every run finished: the same record, nothing new but the declared grid
    again = tuning.tune(study, root, "cpu", ["a", "b"], [],
                        runner=fake_runner({"a": 4e-3, "b": 6.4e-2}))
    assert again == record


def test_tuning_stops_after_four_extensions_and_says_the_pick_is_at_an_edge(tmp_path):
    study = write_study(tmp_path)
    record = tuning.tune(study, tmp_path / "root", "cpu", ["a"], [],
                         runner=fake_runner({"a": 1e-6}))
    a = record["cells"]["a"]
    assert a["extensions"] == tuning.MAX_EXTENSIONS == 4
    assert a["pick"] == 1e-3 / 16 and not a["interior"]
    assert "at the edge of the grid after 4 extensions" in tuning.summary(record, ["a"])[0]


def test_a_failed_run_counts_as_worse_than_any_finished_one(tmp_path):
    study = write_study(tmp_path)
    record = tuning.tune(study, tmp_path / "root", "cpu", ["a"], [],
                         runner=fake_runner({"a": 1.0}, diverge_above=1e-2))
    a = record["cells"]["a"]
    assert a["pick"] == 8e-3 and a["interior"] and a["extensions"] == 0
    assert a["grid"][-1] == {"rate": 1.6e-2, "loss": None, "state": "unfinished (step 1 of 2)"}


# The tuning split ----------------------------------------------------------------------------

def text_config(directory: Path, **fields) -> ml_collections.ConfigDict:
    """A `data` config of one local text file (the one the golden hashes below were taken of)."""
    text = "".join(f"line {i}: " + "abcdefghij"[i % 10] * (i % 7 + 3) + "\n" for i in range(400))
    (directory / "a.txt").write_text(text)
    return ml_collections.ConfigDict({"name": "text", "path": str(directory / "a.txt"),
                                      "validation_fraction": 0.1, "tokenizer": "byte", **fields})


# sha256 of batches 0, 5 and 40 (batch_size 4, seq_len 16, seed 3) of each split, taken with
# the code before data.tuning_fraction existed.
GOLDEN = {"train": (6019, "adc2b225b4a0d72349fd379f914c257080a600644067f76fab6751adc0e750c5"),
          "validation": (668, "18ed971c7b590420e5788299bac3215f728b0a982df775583196a2a1017bd313")}


@pytest.mark.parametrize("fields", [{}, {"tuning_fraction": 0.0}])
def test_the_default_batches_are_unchanged(tmp_path, fields):
    config = text_config(tmp_path, **fields)
    for split, (length, digest) in GOLDEN.items():
        dataset = in_memory.load(config, split)
        batches = np.concatenate([dataset.batch(s, 4, 16, seed=3) for s in (0, 5, 40)])
        assert (len(dataset.tokens), hashlib.sha256(batches.tobytes()).hexdigest()) == \
            (length, digest)
        assert dataset.split == split


def test_the_tuning_split_is_disjoint_from_validation_and_the_training_windows(tmp_path):
    seq_len, batch_size, steps = 16, 4, 200  # 200 steps: several epochs of the train windows
    full_train = in_memory.load(text_config(tmp_path), "train").tokens
    validation = in_memory.load(text_config(tmp_path), "validation").tokens
    config = text_config(tmp_path, tuning_fraction=0.2)
    train, held_out = in_memory.load(config, "train"), in_memory.load(config, "validation")
    cut = len(full_train) - int(len(full_train) * 0.2)
    # stream positions: train [0, cut), tuning [cut, len(full_train)), validation after it
    assert held_out.split == "tuning" and len(train.tokens) == cut
    assert np.array_equal(np.concatenate([train.tokens, held_out.tokens]), full_train)
    text = np.frombuffer((tmp_path / "a.txt").read_bytes(), np.uint8)
    assert np.array_equal(text[len(full_train):], validation)  # validation is after both
    for seed in (0, 1):
        order = train.window_order(seq_len, seed)
        windows = np.array([order[i] for i in range(steps * batch_size)])
        assert windows.max() * seq_len + seq_len < cut  # the last token any window reads
        batch = train.batch(7, batch_size, seq_len, seed)
        starts = windows[7 * batch_size:8 * batch_size] * seq_len
        assert np.array_equal(batch, full_train[starts[:, None] + np.arange(seq_len + 1)])
        assert np.array_equal(batch, train.batch(7, batch_size, seq_len, seed))  # (seed, step)
    assert held_out.num_windows(seq_len) > 0


def test_the_tuning_fraction_is_checked_and_refused_for_prepared_shards(tmp_path):
    config = base_config()
    config.data.tuning_fraction = 1.0
    with pytest.raises(ConfigError, match=r"^data.tuning_fraction=1.0 is invalid: must be in"):
        check_training(config)
    config.data.update(tuning_fraction=0.1, name="prepared", path=str(tmp_path))
    with pytest.raises(ConfigError) as error:
        check_training(config)
    assert "not supported for data.name='prepared'" in str(error.value)
    with pytest.raises(ConfigError) as error:
        shards.load_split(config.data, "train")
    assert "not supported for data.name='prepared'" in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_run_trains_and_evaluates_on_the_tuning_split(tmp_path):
    config = text_config(tmp_path)
    study = write_study(tmp_path)
    workdir = tmp_path / "run"
    env = {**one_device_env(), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "train", "--config", study.config_arg("a", "cpu"),
         "--workdir", str(workdir), f"--config.data.path={config.path}",
         "--config.data.name=text", "--config.data.tuning_fraction=0.1", "--config.steps=2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert studies.run_state(workdir)[0] == "finished"
    assert json.loads((workdir / "config.json").read_text())["data"]["tuning_fraction"] == 0.1


# The command line ------------------------------------------------------------------------------

def sweep(capsys, *args: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of scripts/sweep.py in this process."""
    try:
        status = sweep_script.main([*EXPLORATORY, *args])
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def test_tune_runs_the_grid_through_the_sweeps_runner_and_prints_the_picks(tmp_path, capsys,
                                                                           monkeypatch):
    study = write_study(tmp_path)
    root = tmp_path / "root"
    monkeypatch.setattr(tuning.sweep, "run_local", fake_runner({"a": 4e-3, "b": 1.6e-2}))
    status, out, _ = sweep(capsys, "--study", study.path, "--root", str(root), "--tune")
    assert status == 0, out
    assert out.splitlines()[-2:] == [
        "arm=a: lr=0.004 (tuning loss 2.0000; shared 0.003), interior",
        "arm=b: lr=0.016 (tuning loss 2.0000; shared 0.003), interior"]
    assert tuning.read_tuning(root)["cells"]["b"]["extensions"] == 1
    assert studies.read_record(root) is None  # a tuning is not a shared-rate sweep
    status, _, err = sweep(capsys, "--study", study.path, "--root", str(root), "--tune", "--",
                           "--config.batch_size=4")
    assert status == 2 and \
        "tuning.json was tuned with overrides [], not ['--config.batch_size=4']" in err


def test_each_cells_tuned_rate_reaches_its_command_line(tmp_path, capsys):
    study = write_study(tmp_path)
    root = tmp_path / "root"
    tuning.tune(study, root, "cpu", ["a", "b"], [],
                runner=fake_runner({"a": 4e-3, "b": 2e-3}))
    status, out, _ = sweep(capsys, "--study", study.path, "--root", str(root), "--tuned",
                           "--launch", "print")
    assert status == 0
    lines = out.splitlines()
    assert len(lines) == 4
    for line, (cell, seed, rate) in zip(lines, [("a", 0, 4e-3), ("a", 1, 4e-3), ("b", 0, 2e-3),
                                                ("b", 1, 2e-3)], strict=True):
        assert f"--workdir {root / 'tuned' / cell / f'seed{seed}'}" in line
        assert line.endswith(f"--config.seed={seed} --config.optimizer.learning_rate={rate!r}")
    recorded = studies.read_record(root / tuning.TUNED_DIR)
    assert recorded["cells"] == ["a", "b"] and recorded["seeds"] == [0, 1]
    assert studies.read_record(root) is None  # the shared-rate sweep's record is its own


@pytest.mark.parametrize("args, message", [
    (["--tune", "--launch", "print"], "launches locally only"),
    (["--tune", "--seeds", "0"], "--tune trains TUNING's seed"),
    (["--tuned"], "has no tuning.json; tune first"),
    (["--tune", "--", "--config.optimizer.learning_rate=0.1"],
     "--config.optimizer.learning_rate after -- is not allowed"),
    (["--tuned", "--", "--config.data.tuning_fraction=0.1"],
     "--config.data.tuning_fraction after -- is not allowed"),
    (["--tune", "--tuned"], "not allowed with argument"),
])
def test_bad_tuning_arguments_are_one_line(tmp_path, capsys, args, message):
    study = write_study(tmp_path)
    status, _, err = sweep(capsys, "--study", study.path, "--root", str(tmp_path / "root"),
                           *args)
    assert status == 2 and message in err, err
    assert len(err.strip().splitlines()) <= 2  # argparse's usage line, then the one-line error


def test_tune_needs_a_tuning_declaration_and_the_tuned_sweep_its_overrides(tmp_path, capsys):
    study = write_study(tmp_path, STUDY.replace("TUNING = ", "UNUSED = "))
    status, _, err = sweep(capsys, "--study", study.path, "--root", str(tmp_path / "r"), "--tune")
    assert status == 2 and "declares no TUNING" in err
    study = write_study(tmp_path)
    tuning.tune(study, tmp_path / "r", "cpu", ["a"], [], runner=fake_runner({"a": 4e-3}))
    status, _, err = sweep(capsys, "--study", study.path, "--root", str(tmp_path / "r"),
                           "--tuned", "--arms", "a", "--", "--config.batch_size=4")
    assert status == 2 and "the rates were tuned with the overrides []" in err
    status, _, err = sweep(capsys, "--study", study.path, "--root", str(tmp_path / "r"),
                           "--tuned", "--launch", "print")
    assert status == 2 and "no tuned rate for arm 'b'" in err


SCALING_STUDY = STUDY.replace('SCALES = ("cpu",)', 'SCALES = ("cpu",)\nSCALING = ("s", "m", "l")') \
    .replace("steps=2)", "steps=2, at='m')").replace(
    'CLAIMS = (claim("b", "<", "a",', 'CLAIMS = (claim("b@l", "<", "a@l",') \
    .replace('arm, _, scale = (arg or "a").partition(",")',
             'arm, _, scale = (arg or "a@s").partition(",")')


def test_a_scaling_study_tunes_each_arm_at_its_at_size_and_every_size_takes_that_rate(
        tmp_path, capsys):
    study = write_study(tmp_path, SCALING_STUDY)
    assert study.tuning.at == "m" and study.tuning.tuning_cell("b@l") == "b@m"
    root, calls = tmp_path / "root", []
    tuning.tune(study, root, "cpu", study.cells(), [],
                runner=fake_runner({"a@m": 4e-3, "b@m": 2e-3}, calls=calls))
    assert {run.cell for runs in calls for run in runs} == {"a@m", "b@m"}
    assert sorted(tuning.read_tuning(root)["cells"]) == ["a@m", "b@m"]
    status, out, _ = sweep(capsys, "--study", study.path, "--root", str(root), "--tuned",
                           "--seeds", "0", "--launch", "print")
    assert status == 0
    rates = {line.split("--workdir ")[1].split()[0]: float(line.rsplit("=", 1)[1])
             for line in out.splitlines()}
    assert rates == {str(root / "tuned" / f"{arm}@{size}" / "seed0"): rate
                     for arm, rate in (("a", 4e-3), ("b", 2e-3)) for size in ("s", "m", "l")}


# The declaration ------------------------------------------------------------------------------

BAD_TUNING = [
    ("[1e-3, 2e-3]", "TUNING must be a dict"),
    ("dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2))", "TUNING lacks 'rates' or 'seed'"),
    ("dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=0, lr=1)", "unknown field 'lr'"),
    ("dict(rates=(1e-3, 2e-3, 4e-3, 8e-3), seed=0)", "at least 5 positive numbers"),
    ("dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, -1.6e-2), seed=0)", "at least 5 positive numbers"),
    ("dict(rates=(1e-3, 3e-3, 9e-3, 2.7e-2, 8.1e-2), seed=0)", "each twice the one before"),
    ("dict(rates=(1.6e-2, 8e-3, 4e-3, 2e-3, 1e-3), seed=0)", "must be ascending"),
    ("dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=-1)", "seed=-1 must be a non-negative"),
    ("dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=0, steps=0)", "steps=0 must be a pos"),
    ("dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=0, fraction=1)", "fraction=1 must be"),
    ("dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=0, at='big')",
     "at='big' must be one of the study's SCALING sizes (none: it is not a scaling study)"),
]


@pytest.mark.parametrize("declaration, message", BAD_TUNING, ids=[m for _, m in BAD_TUNING])
def test_a_bad_tuning_declaration_is_one_line(tmp_path, declaration, message):
    path = tmp_path / "tiny.py"
    path.write_text(STUDY.replace("TUNING = dict(rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=3, "
                                  "steps=2)", f"TUNING = {declaration}"))
    with pytest.raises(UsageError) as error:
        studies.load_study(str(path))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith(f"--study={path}: TUNING")


def test_a_good_tuning_declaration_is_read(tmp_path):
    assert write_study(tmp_path).tuning == studies.Tuning(
        rates=(1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2), seed=3, steps=2, fraction=0.1)


# The report -------------------------------------------------------------------------------------

def fake_runs(root: Path, losses: dict[str, list[float]]) -> None:
    """Finished run directories ROOT/<cell>/seed<k> with the given final losses."""
    for cell, values in losses.items():
        for seed, loss in enumerate(values):
            workdir = studies.run_dir(root, cell, seed)
            workdir.mkdir(parents=True)
            (workdir / "config.json").write_text(json.dumps({"steps": 3}))
            (workdir / "metrics.jsonl").write_text(
                json.dumps({"step": 3, "train_loss": loss, "eval_loss": loss}) + "\n")


def test_the_report_shows_the_grids_and_both_rate_regimes_side_by_side(tmp_path, capsys):
    study = write_study(tmp_path)
    root = tmp_path / "root"
    tuning.tune(study, root, "cpu", ["a", "b"], [], runner=fake_runner({"a": 4e-3, "b": 2e-3}))
    studies.record(root, study, "cpu", ["a", "b"], [0, 1], [])
    studies.record(root / tuning.TUNED_DIR, study, "cpu", ["a", "b"], [0, 1], [])
    fake_runs(root, {"a": [2.50, 2.52], "b": [2.55, 2.56]})  # b worse at the shared rate
    fake_runs(root / tuning.TUNED_DIR, {"a": [2.40, 2.41], "b": [2.30, 2.32]})  # better tuned
    from train.studies.report import describe
    report = write_report(root, describe(root, None)).read_text()
    assert "## Learning rate per arm" in report and "### Shared rate and tuned rate" in report
    assert "| a | 0.001: 6.0000, 0.002: 3.0000, **0.004: 2.0000**, 0.008: 3.0000, 0.016: " \
           "6.0000 | 0.004 | yes | 0.003 |" in report
    assert "| b | 0.003 | 2.5550 ± 0.0071 (2) | 0.002 | 2.3100 ± 0.0141 (2) |" in report
    claim_row = next(line for line in report.splitlines() if line.startswith("| b beats a"))
    assert claim_row.count("exploratory") == 0 and "+0.0450" in claim_row \
        and "-0.0950" in claim_row


def test_the_tables_of_a_grid_and_of_the_regimes():
    record = {"cells": {"a": {"shared_rate": 3e-3, "pick": 1e-3, "interior": False,
                              "extensions": 4, "grid": [{"rate": 1e-3, "loss": 2.0},
                                                        {"rate": 2e-3, "loss": None}]}}}
    assert grid_table(record)[2] == "| a | **0.001: 2.0000**, 0.002: — | 0.001 | no: at an " \
                                    "edge after 4 extensions | 0.003 |"
    runs = {"a": {0: Result(2.0, [], None)}}
    assert regimes_table(runs, {}, record["cells"], [])[2] == \
        "| a | 0.003 | 2.0000 ± — (1) | 0.001 | — (0) |"
