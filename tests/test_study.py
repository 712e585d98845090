"""Studies (docs/studies.md): the study loader's one-line errors, the statistics against hand
computations (the registered claims': tests/test_claims.py), the sweep's launch commands, and
a tiny local sweep end to end (a failing arm, a rerun that skips finished runs, the report
with a missing run)."""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from arch.accounting import parameter_count
from config import resolve
from config.cli import UsageError, load_experiment, load_module
from config.defaults import base_config
from config.validate import check_fields
from scripts import study_probes as study_probes_script
from tests.helpers import EXPLORATORY, one_device_env, tiny_config
from tests.test_launch import calls, fake_command
from train import restore, rundir
from train.step import build_program, resolve_for_job
from train.studies import stats, study_probes
from train.studies import study as studies
from train.studies.report import (
    Result,
    describe,
    loss_table,
    training_flops,
    write_report,
)

ROOT = Path(__file__).resolve().parents[1]

TINY_STUDY = '''"""A tiny study for the tests: two learning rates (and an arm whose config is
invalid) on a 2-layer byte model, 3 steps."""

from experiments.common import base_config

ARMS = ("low", "broken", "high")
BASELINE = "low"
SEEDS = (0, 1)
SCALES = ("cpu", "paper")
PAPER = {"high": 2.5}
PAPER_METRIC = "final validation loss"


def get_config(arg=None):
    arm, _, scale = (arg or "low").partition(",")
    config = base_config()
    config.update(steps=3, batch_size=8, seq_len=16, log_every=1, eval_every=1000,
                  eval_batches=1, checkpoint_every=1000, sample_tokens=0)
    config.optimizer.warmup_steps = 1
    config.mesh.data = 1
    config.model.d_model, config.model.num_layers = 32, 2
    config.optimizer.learning_rate = {"low": 1e-3, "high": 3e-3, "broken": -1.0}[arm]
    return config
'''


def write_study(directory: Path, text: str = TINY_STUDY, name: str = "tiny.py") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def sweep(*args: str) -> subprocess.CompletedProcess:
    env = {**one_device_env(), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep.py"), *EXPLORATORY,
                           *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


# The loader ---------------------------------------------------------------------------------

GOOD = {"doc": '"""A study."""', "get_config": "def get_config(arg=None):\n    return None",
        "ARMS": "ARMS = ('a', 'b')", "BASELINE": "BASELINE = 'a'", "SEEDS": "SEEDS = (0, 1)",
        "SCALES": "SCALES = ('cpu',)"}

BROKEN = [
    ({"ARMS": None}, "declares no ARMS"),
    ({"BASELINE": "BASELINE = 'c'"}, "BASELINE='c' is not one of ARMS ('a', 'b')"),
    ({"doc": None}, "has no docstring"),
    ({"get_config": None}, "defines no get_config"),
    ({"ARMS": "ARMS = ('a', 'a,b')"}, "ARMS has 'a,b', not a name"),
    ({"ARMS": "ARMS = ()"}, "ARMS must be a non-empty tuple"),
    ({"SEEDS": "SEEDS = (0, -1)"}, "SEEDS must be a non-empty tuple of distinct non-negative"),
    ({"SCALES": "SCALES = 'cpu'"}, "SCALES must be a non-empty tuple of names"),
    ({"PAPER": "PAPER = {'a': 1.0}"}, "declares PAPER without PAPER_METRIC"),
    ({"PAPER": "PAPER = {'z': 1.0}\nPAPER_METRIC = 'x'"}, "PAPER names 'z', not one of ARMS"),
    ({"SCALING": "SCALING = ('s',)"}, "has one size"),
    ({"ARMS": "ARMS = (1"}, "has a syntax error at line"),
    ({"CLAIMS": "CLAIMS = ({'arm': 'b'},)", "SCALING": "SCALING = ('s', 'm')"},
     "not in a scaling study"),
]


def study_text(**changes) -> str:
    parts = {**GOOD, **changes}
    return "\n".join(part for part in parts.values() if part is not None) + "\n"


@pytest.mark.parametrize("changes, message", BROKEN, ids=[m for _, m in BROKEN])
def test_the_loader_refuses_a_bad_study_in_one_line(tmp_path, changes, message):
    path = write_study(tmp_path, study_text(**changes))
    with pytest.raises(UsageError) as error:
        studies.load_study(str(path))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith(f"--study={path}")


def test_the_loader_reads_a_scaling_study(tmp_path):
    path = write_study(tmp_path, study_text(SCALING="SCALING = ('s', 'm')",
                                            PAPER="PAPER = {'b': 1.25}\nPAPER_METRIC = 'x'"))
    study = studies.load_study(str(path))
    assert study.cells() == ["a@s", "a@m", "b@s", "b@m"]
    assert study.cells(("b",)) == ["b@s", "b@m"]
    assert study.config_arg("b@m", "cpu") == f"{path}:b@m,cpu"
    assert studies.split_cell("b@m") == ("b", "m") and studies.split_cell("b") == ("b", None)
    assert study.paper == {"b": 1.25} and study.seeds == (0, 1)


# The repository's study files --------------------------------------------------------------

# Every experiment file that declares arms is a study.
STUDY_FILES = tuple(str(path.relative_to(ROOT)) for path in sorted(ROOT.glob("experiments/*.py"))
                    if "\nARMS = " in path.read_text())


@pytest.mark.parametrize("path", STUDY_FILES)
@pytest.mark.slow
def test_every_arm_of_a_study_file_is_a_valid_config_at_every_scale(path):
    """The study loads; every arm builds at every scale and passes the JAX-free field checks
    (`config.validate.check_fields`, what the CLI runs first) and the model and mesh checks
    (`train.config.validate`: each mechanism's `resolve`; the tokenizer's vocabulary filled in
    where the study leaves it to the data, and the paper scale on 8 devices); "ARM" is
    "ARM,<first scale>"; and no two cells (arms, or ARM@SIZE in a scaling study) of a scale
    are the same config."""
    study = studies.load_study(str(ROOT / path))
    module = load_module(str(ROOT / path), "--study")
    assert study.baseline in study.arms and len(study.seeds) >= 2
    assert study.scales == ("cpu", "paper")
    cells = ([f"{arm}@{size}" for arm in study.arms for size in study.scaling]
             if study.scaling else study.arms)
    for scale in study.scales:
        seen = {}
        for arm in cells:
            config = module.get_config(f"{arm},{scale}")
            if scale == study.scales[0]:
                assert config.to_dict() == module.get_config(arm).to_dict()
            check_fields(config)
            assert config.sample_tokens == 0
            if not config.model.vocab_size:
                config.model.vocab_size = 32_000
            config = resolve(config, 1 if scale == "cpu" else 8)
            key = config.to_json_best_effort(sort_keys=True)
            assert key not in seen, (arm, seen.get(key))
            seen[key] = arm
    with pytest.raises(ValueError, match="unknown"):
        module.get_config("no_such_arm")


def test_the_gated_residual_table_arms_change_what_they_name():
    module = load_module(str(ROOT / "experiments/gated_residual_table.py"), "--study")
    models = {arm: module.get_config(f"{arm},cpu").model for arm in module.ARMS}
    assert models["prenorm"].residual.name == "prenorm"
    assert models["mhc_static"].residual.dynamic is False and models["mhc"].residual.dynamic
    gr = models["gr"]
    assert (gr.residual.name, gr.residual.streams) == ("gated_residual", 4)
    defaults = base_config().model.gated_residual.to_dict()
    assert gr.gated_residual.to_dict() == defaults | {"init": "random"}  # the notes' final GR
    # gr_no_static: init back to the default, as init="random" draws the logits it removes.
    changed = {"gr_graded": dict(init="graded"),
               "gr_no_channel_read": dict(channelwise_read=False),
               "gr_no_channel_write": dict(channelwise_write=False),
               "gr_mixing": dict(mixing=True),
               "gr_no_static": dict(static=False, init="graded"),
               "gr_frozen_static": dict(static_frozen=True), "gr_top2": dict(read_top_k=2)}
    assert set(changed) == {arm for arm in module.ARMS if arm.startswith("gr_")}
    for arm, fields in changed.items():
        model = models[arm]
        assert {name for name in model if model[name] != gr[name]} == {"gated_residual"}, arm
        differences = {name: setting for name, setting in model.gated_residual.items()
                       if setting != gr.gated_residual[name]}
        assert differences == fields, (arm, differences)
    assert module.get_config("gr,paper").data.name == "prepared"


# The statistics, against hand computations --------------------------------------------------

def test_mean_std_and_paired_difference_equal_hand_values():
    mean, std, n = stats.mean_std([1.0, 2.0, 4.0])
    assert (mean, n) == (pytest.approx(7 / 3), 3) and std == pytest.approx(math.sqrt(7 / 3))
    assert math.isnan(stats.mean_std([5.0])[1])
    # shared seeds 0 and 1: differences 0.5 and 1.0
    mean, std, n = stats.paired_difference({0: 2.0, 1: 3.0, 2: 5.0},
                                                 {0: 1.5, 1: 2.0, 3: 9.0})
    assert (mean, n) == (pytest.approx(0.75), 2) and std == pytest.approx(math.sqrt(0.125))


def test_a_power_law_fit_recovers_its_parameters():
    compute = np.geomspace(1e15, 1e18, 6)
    fit = stats.fit_power_law(compute, 3 * compute ** -0.05)
    assert fit.a == pytest.approx(3, rel=1e-9) and fit.b == pytest.approx(0.05, rel=1e-9)
    assert fit.compute(fit.loss(1e16)) == pytest.approx(1e16, rel=1e-9)
    with pytest.raises(ValueError, match="two or more compute values"):
        stats.fit_power_law([1e15, 1e15], [2.0, 2.1])


def test_the_compute_multiplier_of_a_shifted_power_law_is_the_shift():
    baseline = stats.PowerLaw(a=3.0, b=0.05)
    arm = stats.PowerLaw(a=3.0 * 2 ** -0.05, b=0.05)  # L(C) = 3·(2C)^-0.05
    for compute in (1e15, 1e17):
        assert stats.compute_multiplier(arm, baseline, compute) == pytest.approx(2.0)
    # different exponents, by hand: the baseline reaches 2.9·1e16^-0.06 at (3/L)^(1/0.05)
    loss = 2.9 * 1e16 ** -0.06
    assert stats.compute_multiplier(stats.PowerLaw(2.9, 0.06), baseline, 1e16) == \
        pytest.approx((3 / loss) ** 20 / 1e16)


def test_the_bootstrap_interval_surrounds_a_known_multiplier():
    rng = np.random.default_rng(0)
    sizes = np.geomspace(1e15, 1e17, 3)
    noise = 1 + 0.001 * rng.standard_normal((2, 3, 8))  # 0.1% of the loss, 8 seeds per size
    baseline = {c: list(3 * c ** -0.05 * noise[0, i]) for i, c in enumerate(sizes)}
    arm = {c: list(3 * (1.5 * c) ** -0.05 * noise[1, i]) for i, c in enumerate(sizes)}
    point, low, high = stats.bootstrap_multiplier(arm, baseline, sizes[-1], samples=300)
    assert low < point < high and abs(point - 1.5) < 0.05 and 1.4 < low and high < 1.6
    assert stats.bootstrap_multiplier(arm, baseline, sizes[-1], samples=300) == \
        (point, low, high)  # a fixed resampling seed
    exact = {c: [3 * (1.5 * c) ** -0.05] * 2 for c in sizes}
    exact_base = {c: [3 * c ** -0.05] * 2 for c in sizes}
    assert stats.bootstrap_multiplier(exact, exact_base, 1e16, samples=20) == \
        pytest.approx((1.5, 1.5, 1.5))
    rising = {c: [3 * c ** 0.01] * 2 for c in sizes}  # worse with compute: nothing to invert
    with pytest.raises(ValueError, match=r"^its loss does not fall with compute \(b = -0.01\)$"):
        stats.bootstrap_multiplier(exact, rising, 1e16, samples=20)


# The launch commands ------------------------------------------------------------------------

def test_the_runner_and_the_loader_import_no_jax():
    probe = ("import sys, train.studies.study, train.studies.stats, train.studies.sweep; "
             "print(sorted(m for m in ('jax', 'flax', 'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_print_lists_one_train_command_per_arm_and_seed(tmp_path):
    path = write_study(tmp_path)
    root = tmp_path / "root"
    done = sweep("--study", str(path), "--root", str(root), "--launch", "print", "--arms",
                 "low,high", "--seeds", "3,4", "--", "--config.sample_prompt=In the",
                 "--config.steps=2")
    assert done.returncode == 0, done.stderr
    expected = [["python", "-m", "train", "--config", f"{path}:{arm},cpu", "--workdir",
                 str(root / arm / f"seed{seed}"), f"--config.seed={seed}",
                 "--config.sample_prompt=In the", "--config.steps=2"]
                for arm in ("low", "high") for seed in (3, 4)]
    assert [shlex.split(line) for line in done.stdout.splitlines()] == expected
    record = json.loads((root / "study.json").read_text())
    assert record["cells"] == ["low", "high"] and record["seeds"] == [3, 4]
    assert record["baseline"] == "low" and record["paper"] == {"high": 2.5}

    done = sweep("--study", str(path), "--root", str(root), "--launch", "print", "--arms", "low")
    assert done.returncode == 0, done.stderr
    record = json.loads((root / "study.json").read_text())  # what was asked for, merged
    assert record["cells"] == ["low", "high"] and record["seeds"] == [0, 1, 3, 4]
    done = sweep("--study", str(path), "--root", str(root), "--launch", "print", "--scale",
                 "paper")
    assert done.returncode == 2 and not done.stdout
    assert done.stderr == f"error: --root={root} holds a sweep of scale 'cpu', not 'paper'; " \
                          "pass another --root\n"


def test_slurm_writes_an_array_of_runs_that_the_sbatch_script_indexes(tmp_path):
    path = write_study(tmp_path)
    root = tmp_path / "root"
    done = sweep("--study", str(path), "--root", str(root), "--launch", "slurm", "--scale",
                 "paper", "--arms", "high", "--", "--config.steps=2")
    assert done.returncode == 0, done.stderr
    runs = root / "slurm_runs.txt"
    assert shlex.split(done.stdout) == ["sbatch", "--array=0-1", "scripts/slurm_train.sbatch",
                                        "--runs", str(runs)]
    fake_command(tmp_path, "srun")
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", SLURM_GPUS_ON_NODE="2",
               SLURM_JOB_ID="7", SLURM_ARRAY_TASK_ID="1")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_train.sbatch"), "--runs",
                           str(runs)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    [srun] = calls(tmp_path)
    assert srun["argv"] == ["--kill-on-bad-exit=1", "python", "-m", "train", "--config",
                            f"{path}:high,paper", "--workdir", str(root / "high" / "seed1"),
                            "--config.seed=1", "--config.steps=2"]


def test_sizes_pick_cells_of_a_scaling_study(tmp_path):
    text = TINY_STUDY.replace('PAPER = {"high": 2.5}', 'SCALING = ("s", "m", "l")')
    path = write_study(tmp_path, text.replace("[arm]", '[arm.partition("@")[0]]'))
    done = sweep("--study", str(path), "--root", str(tmp_path / "r"), "--launch", "print",
                 "--arms", "low", "--sizes", "l,s", "--seeds", "0")
    assert done.returncode == 0, done.stderr
    assert [shlex.split(line)[4] for line in done.stdout.splitlines()] == [
        f"{path}:low@s,cpu", f"{path}:low@l,cpu"]  # in the study's order
    done = sweep("--study", str(path), "--root", str(tmp_path / "q"), "--launch", "print",
                 "--sizes", "xl")
    assert done.returncode == 2 and done.stderr == (
        "error: --sizes=xl: the study's SCALING sizes are ('s', 'm', 'l')\n")


def test_tpu_prints_one_pod_launch_per_run(tmp_path):
    path = write_study(tmp_path)
    done = sweep("--study", str(path), "--root", str(tmp_path / "r"), "--launch", "tpu",
                 "--arms", "high", "--seeds", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (f'scripts/launch_tpu_pod.sh --tpu "$TPU" --zone "$ZONE" --config '
                           f'{path}:high,cpu --workdir {tmp_path}/r/high/seed0 -- '
                           "--config.seed=0\n")


@pytest.mark.parametrize("args, message", [
    (["--arms", "low,nope"], "--arms=low,nope: 'nope' is not one of the study's ARMS"),
    (["--scale", "huge"], "--scale=huge is not one of the study's SCALES"),
    (["--seeds", "0,x"], "--seeds=0,x is invalid"),
    (["--", "--config.seed=3"], "--config.seed after -- is not allowed"),
    (["--", "--config.model.no_such=1"], "has no field 'no_such'"),
    (["--sizes", "s"], "--sizes=s: the study's SCALING sizes are none (it is not a scaling"),
], ids=["arm", "scale", "seeds", "seed-override", "unknown-field", "sizes"])
def test_bad_sweep_arguments_are_one_line(tmp_path, args, message):
    path = write_study(tmp_path)
    done = sweep("--study", str(path), "--root", str(tmp_path / "r"), "--launch", "print", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not done.stdout


# A tiny sweep end to end --------------------------------------------------------------------

@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(root, result) of a local sweep of the tiny study: 2 arms × 2 seeds, and the broken arm
    (its config's learning rate is invalid: exit 2) between them."""
    directory = tmp_path_factory.mktemp("study")
    path = write_study(directory)
    root = directory / "root"
    return root, sweep("--study", str(path), "--root", str(root))


@pytest.mark.slow
def test_a_local_sweep_reports_a_failing_arm_and_runs_the_others(swept):
    root, done = swept
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" ", 3)[:3] for line in lines[:6]] == [
        [f"[{i}/6]", f"arm={arm}", f"seed={seed}"] for i, (arm, seed) in enumerate(
            [("low", 0), ("low", 1), ("broken", 0), ("broken", 1), ("high", 0), ("high", 1)], 1)]
    for line in lines[:2] + lines[4:6]:
        assert " done in " in line and ", eval_loss " in line, line
    assert "failed (exit 2)" in lines[2] and "optimizer.learning_rate=-1.0 is invalid" in lines[2]
    assert lines[6] == "4 of 6 runs finished" and lines[7] == "2 failed:"
    assert lines[8].startswith("  arm=broken seed=0: exit 2: error: optimizer.learning_rate")
    for arm in ("low", "high"):
        for seed in (0, 1):
            assert studies.run_state(root / arm / f"seed{seed}")[0] == "finished"

    again = sweep("--study", str(json.loads((root / "study.json").read_text())["study"]),
                  "--root", str(root))
    assert again.returncode == 1
    rerun = again.stdout.splitlines()
    for line in rerun[:2] + rerun[4:6]:
        assert "finished already" in line and line.endswith(": skipped"), line
    assert rerun[6] == "4 of 6 runs finished"

    # The study file changed under its finished runs: they are reported, not reused.
    study = Path(json.loads((root / "study.json").read_text())["study"])
    study.write_text(study.read_text().replace('"low": 1e-3', '"low": 2e-3'))
    changed = sweep("--study", str(study), "--root", str(root), "--arms", "low,high")
    assert changed.returncode == 1
    lines = changed.stdout.splitlines()
    for line in lines[:2]:
        assert "failed: finished with another config" in line, line
        assert "optimizer.learning_rate: 0.001 → 0.002" in line, line
    for line in lines[2:4]:
        assert line.endswith(": skipped"), line
    assert lines[4] == "2 of 4 runs finished"


@pytest.mark.slow
def test_the_report_of_a_sweep_and_of_one_with_a_missing_run(swept, tmp_path):
    root, _ = swept
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "study_report.py"), "--root",
                           str(root)], cwd=ROOT, env={**one_device_env(), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = (root / "report.md").read_text()
    assert (root / "loss_curves.png").stat().st_size > 0
    losses = {arm: [studies.run_state(root / arm / f"seed{s}")[1] for s in (0, 1)]
              for arm in ("low", "high")}
    low = f"{np.mean(losses['low']):.4f} ± {np.std(losses['low'], ddof=1):.4f}"
    assert f"| low (baseline) | 2 | {low} | (baseline) | — |" in report
    differences = np.subtract(losses["high"], losses["low"])
    high = f"{np.mean(losses['high']):.4f} ± {np.std(losses['high'], ddof=1):.4f}"
    assert (f"| high | 2 | {high} | {differences.mean():.4f} ± "
            f"{np.std(differences, ddof=1):.4f} (2) | 2.5 |") in report
    assert "| broken | 0 | — | — (0) | — |" in report
    assert "| broken | 1 | not started (no metrics.jsonl): error: optimizer.learning_rate" \
        in report

    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    shutil.rmtree(copy / "high" / "seed1")
    write_report(copy, describe(copy, None))
    report = (copy / "report.md").read_text()
    assert f"| high | 1 | {losses['high'][0]:.4f} ± — | " in report
    assert "| high | 1 | missing |" in report


FAKE_SBATCH = """#!/usr/bin/env bash
# sbatch --array=0-N SCRIPT ARGS...: each array task in turn, here (SLURM runs them on nodes)
set -e
last="${1#--array=0-}"; shift
for ((task = 0; task <= last; task++)); do
  SLURM_JOB_ID=41 SLURM_ARRAY_TASK_ID=$task SLURM_GPUS_ON_NODE=1 bash "$@"
done
echo "Submitted batch job 41"
"""
FAKE_SRUN = """#!/usr/bin/env bash
# srun --kill-on-bad-exit=1 COMMAND...: one task, here
shift; exec "$@"
"""


@pytest.mark.slow
def test_a_slurm_array_sweep_equals_the_local_sweep(swept, tmp_path):
    """`--launch slurm --submit` through a fake sbatch that runs the array's tasks here (each
    through scripts/slurm_train.sbatch and a fake srun): the same runs as the local sweep's,
    bit for bit, recorded in a study.json that asks for the same cells."""
    local, _ = swept
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    study = str(write_study(tmp_path))  # the swept study as written (a test above edits it)
    root = tmp_path / "root"
    env = {**one_device_env(), "PYTHONPATH": str(ROOT), "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep.py"), *EXPLORATORY,
                           "--study", study, "--root", str(root), "--launcher", "slurm",
                           "--submit", "--arms", "low,high", "--seeds", "0"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-1] == "Submitted batch job 41"
    def records(metrics: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(line).items() if k in ("step", "train_loss",
                                                                   "eval_loss")}
                for line in metrics.read_text().splitlines()]

    for arm in ("low", "high"):
        ran = records(root / arm / "seed0" / "metrics.jsonl")
        assert ran and ran == records(local / arm / "seed0" / "metrics.jsonl")
    recorded = json.loads((root / "study.json").read_text())
    assert (recorded["cells"], recorded["seeds"]) == (["low", "high"], [0])


def test_vmap_groups_join_the_unstarted_seeds_of_a_cell(tmp_path):
    """Consecutive unstarted seed<k> runs of one cell and overrides form one group; a started
    run (it has metrics.jsonl), another cell or a non-seed directory (a tuning run) stays
    alone."""
    from train.studies.sweep import Run, vmap_groups

    def run(cell, seed, directory=None, overrides=()):
        return Run(cell, seed, f"s.py:{cell}", tmp_path / cell / (directory or f"seed{seed}"),
                   tuple(overrides))

    started = run("a", 2)
    started.workdir.mkdir(parents=True)
    (started.workdir / "metrics.jsonl").write_text("")
    runs = [run("a", 0), run("a", 1), started, run("a", 3), run("b", 0), run("b", 1),
            run("b", 2, overrides=("--config.steps=5",)), run("c", 100, "lr0.001"),
            run("c", 100, "lr0.002")]
    groups = vmap_groups(runs)
    assert [[(r.cell, r.seed) for r in group] for group in groups] == [
        [("a", 0), ("a", 1)], [("a", 2)], [("a", 3)], [("b", 0), ("b", 1)], [("b", 2)],
        [("c", 100)], [("c", 100)]]


@pytest.mark.slow
def test_a_vmapped_sweep_with_a_compilation_cache_equals_the_local_sweep(swept, tmp_path):
    """--vmap_seeds --compile_cache: each cell's two seeds train as one `python -m train.seeds`
    program, sharing ROOT/compilation_cache; the runs equal the local sweep's to float32
    tolerance (two programs), and a rerun skips them all."""
    local, _ = swept
    study = str(write_study(tmp_path))
    root = tmp_path / "root"
    done = sweep("--study", study, "--root", str(root), "--arms", "low,high", "--vmap_seeds",
                 "--compile_cache")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "[1/4] arm=low seed=0 queued" and lines[1] == "[2/4] arm=low seed=1 queued"
    assert lines[2].startswith("arm=low seed=0: done in ") and lines[-1] == "4 of 4 runs finished"
    assert (root / "low" / "seeds.log").is_file()
    assert any((root / "compilation_cache").iterdir())
    for arm in ("low", "high"):
        for seed in (0, 1):
            mine = studies.read_metrics(root / arm / f"seed{seed}")
            theirs = studies.read_metrics(local / arm / f"seed{seed}")
            assert [r["step"] for r in mine] == [r["step"] for r in theirs]
            np.testing.assert_allclose([r["train_loss"] for r in mine],
                                       [r["train_loss"] for r in theirs], rtol=2e-5)
            assert json.loads((root / arm / f"seed{seed}" / "provenance.jsonl").read_text()
                              )["command"][1:4] == ["-P", "-m", "train.seeds"]
    again = sweep("--study", study, "--root", str(root), "--arms", "low,high", "--vmap_seeds")
    assert again.returncode == 0 and again.stdout.count("finished already") == 4


def test_the_loss_table_puts_the_papers_difference_beside_the_paired_one():
    def runs(*losses):
        return {seed: Result(loss, [], None) for seed, loss in enumerate(losses)}

    description = {"baseline": "base", "scaling": [], "paper_metric": "final loss",
                   "paper": {"base": 1.766, "block": 1.746}}
    table = loss_table({"base": runs(2.0, 2.1, 2.3), "block": runs(1.9, 2.05),
                        "other": runs(2.2)}, description)
    assert table[0].endswith("| Paper (final loss) | Paper Δ | Per seed |")
    assert table[2] == ("| base (baseline) | 3 | 2.1333 ± 0.1528 | (baseline) | 1.766 | "
                        "(baseline) | 0: 2.0000, 1: 2.1000, 2: 2.3000 |")
    assert table[3] == ("| block | 2 | 1.9750 ± 0.1061 | -0.0750 ± 0.0354 (2) | 1.746 | -0.020 | "
                        "0: 1.9000, 1: 2.0500 |")
    assert table[4] == "| other | 1 | 2.2000 ± — | 0.2000 ± — (1) | — | — | 0: 2.2000 |"


def test_the_paired_p_value_is_the_t_distributions_tail():
    # one degree of freedom: t is Cauchy, two-sided p = 1 − (2/π)·atan(|t|)
    mean, std = 0.3, 0.1 * math.sqrt(2)  # t = 0.3 / (std/√2) = 3
    assert stats.paired_p(mean, std, 2) == pytest.approx(1 - 2 / math.pi * math.atan(3.0),
                                                               rel=1e-12)
    assert stats.paired_p(-mean, std, 2) == stats.paired_p(mean, std, 2)
    assert math.isnan(stats.paired_p(0.3, math.nan, 1))


SCALING_STUDY = '''"""A scaling study for the tests: a mechanism-free arm pair over three widths."""

ARMS = ("base", "better")
BASELINE = "base"
SEEDS = (0, 1)
SCALES = ("cpu",)
SCALING = ("s", "m", "l")
PAPER = {"better": 1.25}
PAPER_METRIC = "compute multiplier"


def get_config(arg=None):
    raise RuntimeError("never trained: the test writes the run directories itself")
'''


@pytest.mark.slow
def test_a_scaling_report_fits_each_arm_and_recovers_a_known_multiplier(tmp_path):
    """Run directories written by hand (a resolved config.json and a metrics.jsonl whose final
    loss follows a power law in the run's training FLOPs, the better arm worth 2× compute):
    the report's fit and multiplier recover them."""
    study = studies.load_study(str(write_study(tmp_path, SCALING_STUDY, "scaling.py")))
    root = tmp_path / "root"
    studies.record(root, study, "cpu", study.cells(), [0, 1], [])
    for cell in study.cells():
        arm, size = studies.split_cell(cell)
        config = tiny_config(d_model={"s": 32, "m": 64, "l": 128}[size])
        config = resolve(config, 1)
        for seed in (0, 1):
            workdir = studies.run_dir(root, cell, seed)
            workdir.mkdir(parents=True)
            (workdir / "config.json").write_text(config.to_json_best_effort())
            compute = training_flops(workdir) * (2 if arm == "better" else 1)
            loss = 3 * compute ** -0.05 * (1 + 0.001 * (seed - 0.5))
            (workdir / "metrics.jsonl").write_text(
                json.dumps({"step": config.steps, "train_loss": loss, "eval_loss": loss}) + "\n")
    write_report(root, describe(root, None))
    report = (root / "report.md").read_text()
    [better] = [line for line in report.splitlines() if line.startswith("| better |")]
    a, b, multiplier = better.split(" | ")[1:4]
    assert float(a) == pytest.approx(3 * 2 ** -0.05, rel=1e-3)
    assert float(b) == pytest.approx(0.05, rel=1e-3)
    point, interval = multiplier.split(" [")
    low, high = (float(bound) for bound in interval.rstrip("]").split(", "))
    assert float(point) == pytest.approx(2, abs=1e-3) and low <= 2 <= high
    assert better.endswith("| 1.25 |")
    assert "| base | " in report and "1 (baseline)" in report
    assert (root / "loss_vs_compute.png").stat().st_size > 0
    assert "None: every run finished." in report

    (root / "study.json").unlink()  # the study's own defaults: the same cells and seeds
    write_report(root, describe(root, study.path))
    assert (root / "report.md").read_text() == report


def test_sweeps_recording_into_one_root_at_once_take_turns_and_lose_nothing(tmp_path):
    """Two sweeps started together into one root (one per core) once raced on study.json's
    temporary file. The merge now waits for ROOT/study.json.lock, and every cell and seed that
    concurrent sweeps asked for ends up in the record."""
    study = studies.load_study(str(write_study(tmp_path)))
    root = tmp_path / "root"
    root.mkdir()
    with open(root / "study.json.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = threading.Thread(target=studies.record,
                                   args=(root, study, "cpu", ["high"], [1], []))
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not (root / "study.json").exists()
        fcntl.flock(held, fcntl.LOCK_UN)
        waiting.join(10)
    assert not waiting.is_alive()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda seed: studies.record(root, study, "cpu", [study.cells()[seed % 3]],
                                                  [seed], []), range(2, 10)))
    recorded = studies.read_record(root)
    assert recorded["cells"] == ["low", "broken", "high"]
    assert recorded["seeds"] == list(range(1, 10))
    assert sorted(path.name for path in root.iterdir()) == ["study.json", "study.json.lock"]


def test_the_report_refuses_a_root_without_a_record_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "study_report.py"), "--root",
                           str(tmp_path)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr == f"error: --root={tmp_path} has no study.json (scripts/sweep.py " \
                          "writes it); pass --study experiments/STUDY.py\n"


def test_the_collapse_curvature_is_the_quadratic_term_of_log_res():
    depth = np.arange(8)
    assert study_probes.collapse_curvature(np.exp(1 - 0.3 * depth - 0.5 * depth**2)) \
        == pytest.approx(-0.5)
    assert study_probes.collapse_curvature(np.exp(-0.7 * depth)) == pytest.approx(0, abs=1e-9)
    # Below the float32 floor the points are left out; fewer than 4 left: NaN.
    assert np.isnan(study_probes.collapse_curvature([1, 0.1, 1e-3, 1e-9, 1e-12]))


@pytest.mark.slow
def test_probes_across_a_sweep_and_at_initialization(swept):
    """Trained: every finished run measured, the broken arm listed as missing. At
    initialization: the step-0 model of each (cell, seed) is the trainer's, `program.init(seed)`
    on the study's config (its loss on the probe batch is the trainer's evaluation loss), and a
    config the trainer refuses is listed, not fatal."""
    root, _ = swept
    assert study_probes_script.main(["--root", str(root), "--batch", "8"]) == 0
    trained = json.loads((root / "probes.json").read_text())["runs"]
    assert {cell: sorted(runs) for cell, runs in trained.items()} == {
        "low": ["0", "1"], "broken": [], "high": ["0", "1"]}
    report = (root / "probes.md").read_text()
    assert "at the last checkpoint (step 3)" in report and "| low | 2 | " in report
    assert "| broken | 0 | — |" in report and "| broken | 1 | not started" in report
    assert (root / "probes_key.png").stat().st_size > 0
    profile = trained["low"]["0"]
    assert len(profile["rank_collapse"]) == 3 and len(profile["grad:attention.key.kernel"]) == 2
    assert 0 < profile["log_odds_rank"] <= profile["log_odds_bound"] == 32  # tied, d = 32

    assert study_probes_script.main(["--root", str(root), "--batch", "8", "--initialization"]) == 0
    initial = json.loads((root / "probes_init.json").read_text())["runs"]
    config = load_experiment(f"{json.loads((root / 'study.json').read_text())['study']}:low")
    config.mesh.data = -1
    program = build_program(resolve_for_job(config))
    tokens_BxT1 = restore.evaluation_split(config).batch(0, 8, config.seq_len,
                                                         restore.VALIDATION_SEED)
    for seed in (0, 1):
        expected = program.eval_loss(program.init(seed), program.put_batch(tokens_BxT1))
        assert initial["low"][str(seed)]["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert initial["low"]["0"]["loss"] != trained["low"]["0"]["loss"]
    assert "| broken | 1 | invalid config: optimizer.learning_rate=-1.0 is invalid" in (
        root / "probes_init.md").read_text()


@pytest.mark.parametrize("scale", ["cpu", "paper"])
def test_the_tying_arms_spend_the_same_budget(scale):
    """untied = tied + V·d; tied_wide spends the V·d on the FFN, to within one FFN column (3·d
    parameters) per layer."""
    module = load_module(str(ROOT / "experiments/tying.py"), "--study")
    counts = {}
    for arm in module.ARMS:
        config = module.get_config(f"{arm},{scale}")
        config.model.vocab_size = config.model.vocab_size or module.PAPER_VOCABULARY
        config = resolve(config, 1)
        counts[arm] = parameter_count(config.model)
        model = config.model
    assert counts["untied"] - counts["tied"] == model.vocab_size * model.d_model
    assert abs(counts["tied_wide"] - counts["untied"]) <= 3 * model.d_model * model.num_layers


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_local_sweep_names_the_run_it_stopped_which_saved(tmp_path, signum):
    """The signal goes to the sweep alone (as `kill` sends it): the sweep passes it on, the run
    in progress saves its checkpoint, and the sweep exits 128 + signal naming that run."""
    long_study = TINY_STUDY.replace('("low", "broken", "high")', '("low", "high")').replace(
        "steps=3,", "steps=100_000,")
    path, root = write_study(tmp_path, long_study), tmp_path / "root"
    interrupted = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "sweep.py"), *EXPLORATORY, "--study", str(path),
         "--root", str(root)], cwd=ROOT, env={**one_device_env(), "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = root / "low" / "seed0" / "metrics.jsonl", time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert interrupted.poll() is None and time.time() < deadline, interrupted.communicate()
        time.sleep(0.05)
    interrupted.send_signal(signum)
    stdout, stderr = interrupted.communicate(timeout=300)
    assert interrupted.returncode == 128 + signum, stdout + stderr
    assert stdout == "[1/4] arm=low seed=0 interrupted\n"
    saved = rundir.checkpoint_steps(root / "low" / "seed0")
    assert len(saved) == 1 and saved[0] >= 2
    log = root / "low" / "seed0" / "train.log"
    assert stderr.startswith(f"interrupted by {signum.name} while running arm=low seed=0 (its "
                             "last line: '") and stderr.count("\n") == 1, stderr
    assert stderr.endswith(  # the run's line, after its logger's prefix (SIGTERM)
        f"{signum.name}: the checkpoint of step {saved[0]} is saved in "
        f"{root / 'low' / 'seed0' / 'checkpoints'}; rerun the same command to resume'; log: "
        f"{log}); 0 of 4 runs finished: rerun the same command to resume (finished runs are "
        "skipped, a stopped one resumes from its checkpoint)\n"), stderr
