"""Study mode (`train.seeds`): seeds trained at once, vmapped, equal separate runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from config import resolve
from tests.helpers import one_device_env, tiny_config
from train.checkpoint import Checkpointer
from train.loop import train
from train.seeds import train_seeds
from train.step import build_program, resolve_for_job
from train.studies import study as studies

REPO = Path(__file__).resolve().parents[1]


def records(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").open()]


@pytest.mark.slow
def test_vmapped_seeds_equal_separate_runs(tmp_path):
    config = tiny_config()
    config.update(steps=6, eval_every=3, eval_batches=2, mesh=dict(data=-1))
    config.optimizer.ema_decay = 0.9  # the EMA rides along in the vmapped state
    losses = train_seeds(resolve(config, 1), tmp_path / "vmapped", [0, 3])
    for seed in (0, 3):
        separate = config.copy_and_resolve_references()
        separate.seed = seed
        result = train(resolve_for_job(separate), tmp_path / f"separate{seed}")
        together, alone = (records(d) for d in (tmp_path / "vmapped" / f"seed{seed}",
                                                 tmp_path / f"separate{seed}"))
        assert [r["step"] for r in together] == [r["step"] for r in alone] == list(range(1, 7))
        for key in ("train_loss", "grad_norm", "learning_rate"):
            np.testing.assert_allclose([r[key] for r in together], [r[key] for r in alone],
                                       rtol=2e-5, err_msg=key)
        np.testing.assert_allclose([r["eval_loss"] for r in together if "eval_loss" in r],
                                   [r["eval_loss"] for r in alone if "eval_loss" in r], rtol=2e-5)
        assert losses[seed] == pytest.approx(result["eval_loss"], rel=2e-5)
        assert studies.run_state(tmp_path / "vmapped" / f"seed{seed}") == ("finished",
                                                                           losses[seed])
        # Its final checkpoint restores as an ordinary run's, with the separate run's weights.
        program = build_program(resolve_for_job(separate))
        with Checkpointer(tmp_path / "vmapped" / f"seed{seed}", read_only=True) as saved, \
                Checkpointer(tmp_path / f"separate{seed}", read_only=True) as reference:
            (step, state, data), (_, expected, _) = (
                c.restore_latest(program.abstract_state()) for c in (saved, reference))
        assert (step, data["seed"]) == (6, seed)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                     state["params"], expected["params"])
    assert json.loads((tmp_path / "vmapped" / "seed3" / "config.json").read_text())["seed"] == 3


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0,x"], "--seeds=0,x is invalid: comma-separated integers, e.g. 0,1,2,3"),
    (["--seeds", "1,1"], "--seeds=1,1 is invalid: seeds must be distinct non-negative ints"),
    (["--seeds", "0,1", "--config.model.dropout.residual=0.1"],
     "model.dropout is invalid in train.seeds: dropout keys come from the config's one seed; "
     "train these seeds separately (python -m train)"),
])
def test_bad_seed_mode_arguments_are_one_line(tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "train.seeds", "--config",
                           "experiments/quickstart.py", "--workdir", str(tmp_path), *args],
                          cwd=REPO, env=one_device_env(), capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stderr) == (2, f"error: {message}\n")
