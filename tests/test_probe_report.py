"""The probe report (train/instruments/probe_report.py, behind scripts/probe_report.py) end to end
on a run directory: files, numbers against the library functions on the same batch, and bad
input."""

import json
import re

import numpy as np
import pytest

from arch.accounting import parameter_count
from scripts import probe_report as probe_report_script
from tests.helpers import tiny_config, write_run
from train.data import in_memory
from train.instruments import ablation
from train.restore import restore_for_analysis
from train.step import resolve_for_job

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    config = tiny_config(num_layers=3)
    config.mesh.data = -1
    config = resolve_for_job(config)
    write_run(config, workdir, step=3)
    # Prepare the embedded corpus here, once: its first preparation reports progress on stderr,
    # which the one-line checks below would otherwise see in whichever test runs first.
    in_memory.load(config.data, "validation")
    return workdir, config


@pytest.mark.slow
def test_report_files_and_numbers(run, capsys):
    workdir, config = run
    out = workdir / "report"
    assert probe_report_script.main(["--workdir", str(workdir), "--out", str(out), "--batch",
                                     "8", "--prune", "1", "--bottleneck_tokens", "40"]) == 0
    for name in ("depth.png", "heads.png", "spectrum.png"):
        assert (out / name).read_bytes()[:8] == PNG
    report = json.loads((out / "report.json").read_text())
    assert (report["step"], report["batch"], report["seq_len"]) == (3, 8, 16)
    assert report["accounting"]["parameters"]["total"] == parameter_count(config.model)
    assert report["memory"]["parameter_bytes"] == 4 * parameter_count(config.model)
    _, _, model, tokens_BxT1 = restore_for_analysis(workdir, 8)
    loss = ablation.batch_loss(model, tokens_BxT1)
    assert report["depth"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert report["heads"]["loss"] == pytest.approx(loss, rel=1e-5)
    evaluation = report["evaluation"]  # a byte-level run: one byte per token
    assert evaluation["bytes_per_token"] == 1.0 and evaluation["tokenizer"] == "byte"
    assert evaluation["loss_per_byte"] == evaluation["loss_per_token"] == report["heads"]["loss"]
    assert np.shape(report["heads"]["loss_change"]) == (3, config.model.attention.num_heads)
    assert len(report["depth"]["hidden_rms"]) == 4 and report["pruning"]["num_layers"] == 2
    influence = report["depth"]["block_influence"]
    assert report["pruning"]["dropped"] == [int(np.argmin(influence))]
    bottleneck = report["bottleneck"]
    assert (bottleneck["contexts"], bottleneck["tokens"]) == (8 * 16, 40)
    assert bottleneck["numerical_rank"] <= bottleneck["bound"] == config.model.d_model
    text = (out / "report.md").read_text()
    for heading in ("## Evaluation text", "## Accounting", "## Compiled train-step memory",
                    "## Per-depth probes", "## Pruning by Block Influence", "## Head ablation",
                    "## Softmax bottleneck"):
        assert heading in text
    assert "report.json" in capsys.readouterr().out


@pytest.mark.parametrize("flag, message", [
    ("--prune=3", r"--prune=3 is invalid: must be in \[0, 2\]"),
    ("--batch=0", r"--batch=0 is invalid: must be a positive multiple"),
    ("--seq_len=99", r"--seq_len=99 is invalid: must be in \[2, 16\]"),
    ("--text=/no/such.txt", r"--text=/no/such.txt is invalid: it is neither a text file nor"),
])
def test_bad_input_exits_2_with_one_line(run, capsys, flag, message):
    workdir, _ = run
    assert probe_report_script.main(["--workdir", str(workdir), flag]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("error: ")
    assert re.search(message, error), error
