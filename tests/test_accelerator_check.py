"""scripts/accelerator_check.sh on CPU, with --out: one JSON line on stdout and the same object
in DIR/check.json; blocked attention checked against the explicit path; every accelerator part
skipped with its reason; the study and profile parts run at their tiny CPU shapes (per-arm
seconds and finite final losses; profile.md with a table per train step and decode); a bad
--parts name is one error line and exit status 2."""

import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest

from tests.helpers import one_device_env

ROOT = Path(__file__).resolve().parents[1]
PARTS = "attention,profile,study_mode,attnres,mfu,memory_8k"
PROGRAMS = ("prenorm train step", "prenorm decode", "block_attnres train step",
            "block_attnres decode")


@pytest.mark.slow
def test_accelerator_check_writes_every_part_to_its_out_directory(tmp_path):
    env = one_device_env()
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "out"
    done = subprocess.run([str(ROOT / "scripts" / "accelerator_check.sh"), "--out", str(out),
                           "--parts", PARTS], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    assert json.loads((out / "check.json").read_text()) == result
    assert sorted(path.name for path in out.iterdir()) == [
        "check.json", "check.log", "profile.json", "profile.md"]
    assert result["backend"] == "cpu" and result["parts"] == PARTS.split(",")
    assert "study_mode: baseline" in (out / "check.log").read_text()

    blocked = result["attention"]["blocked"]
    assert blocked["ok"] and blocked["max_rel_diff"] <= 1e-5, blocked
    assert "NVIDIA GPU" in result["attention"]["cudnn"]["skipped"]
    assert "TPU" in result["attention"]["splash"]["skipped"]
    for part in ("mfu", "attnres", "memory_8k"):
        assert result[part]["skipped"].startswith("CPU"), result[part]

    study = result["study_mode"]
    assert set(study["arms"]) == {"baseline"}, study  # on CPU one arm shows the plumbing
    for arm, entry in study["arms"].items():
        assert entry["returncode"] == 0 and entry["seconds"] > 0, (arm, entry)
        assert set(entry["eval_loss"]) == {"seed0", "seed1"}, (arm, entry)
        assert all(math.isfinite(loss) for loss in entry["eval_loss"].values()), (arm, entry)
    assert study["total_s"] == pytest.approx(
        sum(entry["seconds"] for entry in study["arms"].values()))
    assert study["cache_entries"] > 0  # the persistent compilation cache was written

    profile = result["profile"]
    assert set(profile["programs"]) == set(PROGRAMS), profile
    markdown = (out / "profile.md").read_text()
    raw = json.loads((out / "profile.json").read_text())["programs"]
    for program in PROGRAMS:
        assert f"## {program}\n" in markdown
        assert f"| {program} | " in markdown  # its summary row
        rows = raw[program]["rows"]
        assert rows and rows[0]["opcode"] != "?", rows[:1]  # named from its compiled text
        top = rows[0]
        assert f"| 1 | {top['op']} | {top['seconds'] * 1e3:.4f} |" in markdown


def test_a_bad_part_name_is_one_error_line(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location(
        "accelerator_check", ROOT / "scripts" / "accelerator_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--out", str(tmp_path / "out"), "--parts", "attention,mfuu"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--parts=attention,mfuu" in error[0] and "mfuu" in error[0], error
    assert not (tmp_path / "out").exists()  # nothing written for a bad command line
