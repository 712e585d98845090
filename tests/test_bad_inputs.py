"""Bad inputs that once failed late or with a traceback (issue 44, items 5 and 6), each now one
line on stderr, exit status 2 and no traceback, checked before JAX loads: a seed outside an
int32, a norm eps that is not a finite positive number, a train state that cannot fit in memory,
resuming with steps below the newest checkpoint, a prompt that is not UTF-8, prepare_data.py's
zero counts and a source that does not open (which leaves no plan behind), an export whose
checkpoint would not load back, and an export --out that is a file.

Each command runs in a fresh interpreter through a wrapper that prints, last, the heavy modules
loaded by then (as tests/test_entry_points.py does), so "before JAX" is observed, not timed."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from config import ConfigError, resolve, state_memory
from tests.helpers import one_device_env, tiny_config
from tests.test_entry_points import QUICKSTART, WRAPPER
from train import rundir
from train.__main__ import parse

ROOT = Path(__file__).resolve().parents[1]


def run(target: str, *arguments: str | bytes) -> subprocess.CompletedProcess:
    """`target` (a module for `python -m`, or scripts/X.py) run with `arguments` in a fresh
    interpreter on one CPU device; stdout's last line lists the heavy modules it loaded."""
    return subprocess.run([sys.executable, "-c", WRAPPER, target, *arguments], cwd=ROOT,
                          env=one_device_env(), capture_output=True, timeout=300)


def assert_refused(done: subprocess.CompletedProcess, message: str, *,
                   before_jax: bool = True) -> None:
    """Exit status 2, one line on stderr holding `message`, no traceback (and, with
    `before_jax`, no heavy module loaded)."""
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 2, stderr[-2000:]
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr[-2000:]
    assert stderr.startswith("error: ") and message in stderr, stderr
    if before_jax:
        assert done.stdout.decode().strip().splitlines()[-1] == "[]", done.stdout


# python -m train: fields refused before JAX loads ---------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("--config.seed=-1", "seed=-1 is invalid: must be an integer in [0, 2147483647]"),
    ("--config.seed=2147483648", "seed=2147483648 is invalid"),
    ("--config.model.norm.eps=nan", "model.norm.eps=nan is invalid: must be a finite number > 0"),
    ("--config.model.norm.eps=inf", "model.norm.eps=inf is invalid"),
    ("--config.model.norm.eps=0", "model.norm.eps=0.0 is invalid"),
    ("--config.model.norm.eps=-1e-6", "model.norm.eps=-1e-06 is invalid"),
    # 10¹⁰ × 192 float32 parameters with two Adam moments: 23 TB, beyond any host
    ("--config.model.vocab_size=10000000000", "model.vocab_size=10000000000 is invalid: the "
     "parameters and optimizer state need at least 23040.0 GB"),
    (b"--config.sample_prompt=In \xff", "sample_prompt='In \\udcff' is invalid: it holds bytes "
     "that are not UTF-8 text (at character 3)"),
], ids=["seed-negative", "seed-int32", "eps-nan", "eps-inf", "eps-zero", "eps-negative",
        "vocab-memory", "prompt-not-utf8"])
def test_a_bad_field_is_one_line_before_jax(tmp_path, override, message):
    done = run("train", "--config", QUICKSTART, "--workdir", str(tmp_path / "w"), override)
    assert_refused(done, message)
    assert not (tmp_path / "w").exists()


def test_the_memory_bound_refuses_only_what_cannot_fit(monkeypatch):
    """The bound is exact arithmetic on the config; the check refuses one byte short of it and
    passes at it. On an accelerator the state is spread over the devices (a fake `jax` module
    stands in for a loaded JAX with 4 GPUs)."""
    config = tiny_config(head="untied")
    config.mesh.data = 4
    config = resolve(config, 4)
    embedding, ffn = state_memory.state_lower_bound(config)
    assert embedding == 2 * 256 * 32 and ffn == 2 * 3 * 32 * config.model.ffn.d_ff
    need = (embedding + ffn) * 3 * 4  # float32 parameters and two AdamW moments
    monkeypatch.setattr(state_memory, "host_memory", lambda: need)
    monkeypatch.delitem(sys.modules, "jax")  # before JAX loads: the host's memory
    state_memory.check_state_fits(config)
    monkeypatch.setattr(state_memory, "host_memory", lambda: need - 1)
    with pytest.raises(ConfigError, match=r"^model.d_model=32 is invalid: the parameters and "
                       r"optimizer state need at least 0.0 GB \(float32: 16,384 embedding and "
                       r"head parameters, 24,576 FFN parameters, 3 values each\), more than this "
                       r"host's memory \(0.0 GB\); lower model.d_model"):
        state_memory.check_state_fits(config)

    def gpus(limit):
        device = types.SimpleNamespace(platform="gpu", memory_stats=lambda: {"bytes_limit": limit})
        return types.SimpleNamespace(local_devices=lambda: [device])

    monkeypatch.setitem(sys.modules, "jax", gpus(need / 4))
    state_memory.check_state_fits(config)
    monkeypatch.setitem(sys.modules, "jax", gpus(need / 4 - 1))
    with pytest.raises(ConfigError, match=r"\(its share of 4 devices\).* more than the memory of "
                       "one gpu device"):
        state_memory.check_state_fits(config)



def test_the_cpu_memory_check_counts_every_process_on_the_host(monkeypatch):
    """issue 61: two processes on one host whose states were 0.75× its memory each both passed.
    A fake loaded `jax`: a CPU process holding 2 of the job's 4 devices."""
    config = tiny_config(head="untied")
    config.mesh.data = 4
    config = resolve(config, 4)
    embedding, ffn = state_memory.state_lower_bound(config)
    whole = (embedding + ffn) * 3 * 4
    cpu = types.SimpleNamespace(platform="cpu")
    monkeypatch.setitem(sys.modules, "jax", types.SimpleNamespace(
        local_devices=lambda: [cpu], local_device_count=lambda: 2))
    monkeypatch.setattr(state_memory, "host_memory", lambda: int(whole * 0.75))
    state_memory.check_state_fits(config)  # alone on its host: its half fits
    with pytest.raises(ConfigError, match=r"^model.d_model=32 is invalid: .* \(the share of 4 "
                       r"devices that this host's 2 processes hold\)"):
        state_memory.check_state_fits(config, processes_on_host=2)


def test_out_of_memory_past_the_check_is_one_line_with_its_own_status(tmp_path, monkeypatch,
                                                                      capsys):
    """issue 61: a state that passed the (lower-bound) check and then ran out of memory was a
    29-line JaxRuntimeError with exit status 1. The runtime's error is stood in for."""
    import jax

    import train.__main__ as cli
    import train.loop

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                         "allocate 68719476736 bytes.\nmore lines")

    monkeypatch.setattr(train.loop, "train", out_of_memory)
    assert cli.main(["train", "--config", QUICKSTART, "--workdir", str(tmp_path / "w")]) == 5
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and stderr.startswith(
        "error: out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "68719476736 bytes.): the parameters and optimizer state alone need at least "), stderr
    assert stderr.endswith("lower what each device holds: shard the state (mesh.fsdp), "
                           "recompute activations (execution.remat=full), lower batch_size or "
                           "raise accumulation_steps, or a smaller model\n")
    assert " GB of this host's memory (" in stderr


# Resuming with steps below the newest checkpoint ----------------------------------------------

def write_resumable(workdir: Path, checkpoint: int) -> None:
    """A run directory `python -m train --config QUICKSTART` would resume: the CLI's own config
    as config.json and an (empty) checkpoint directory at step `checkpoint`."""
    config, _ = parse(["train", "--config", QUICKSTART, "--workdir", str(workdir)])
    workdir.mkdir()
    (workdir / "config.json").write_text(resolve(config, 1).to_json_best_effort(indent=2))
    (workdir / "checkpoints" / str(checkpoint)).mkdir(parents=True)


def test_resuming_with_steps_below_the_newest_checkpoint_is_refused(tmp_path):
    workdir = tmp_path / "run"
    write_resumable(workdir, 40)
    before = sorted(p.name for p in workdir.rglob("*"))
    done = run("train", "--config", QUICKSTART, "--workdir", str(workdir), "--config.steps=35")
    assert_refused(done, f"steps=35 is invalid: --workdir={workdir} holds a checkpoint at step "
                         "40, past it, so there is nothing to train; raise steps to at least 40 "
                         "to resume, or use a new --workdir")
    assert sorted(p.name for p in workdir.rglob("*")) == before
    for steps, refused in ((39, True), (40, False), (41, False)):
        config, _ = parse(["train", "--config", QUICKSTART, "--workdir", str(workdir),
                           f"--config.steps={steps}"])
        if refused:
            with pytest.raises(rundir.WorkdirError, match=f"steps={steps} is invalid"):
                rundir.check_resume(workdir, resolve(config, 1), resolved=True)
        else:
            rundir.check_resume(workdir, resolve(config, 1), resolved=True)


# python -m train.generate --------------------------------------------------------------------

def test_a_prompt_that_is_not_utf8_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(tiny_config().to_json_best_effort())
    done = run("train.generate", "--workdir", str(tmp_path), "--prompt", b"In \xff\xfe")
    assert_refused(done, "--prompt='In \\udcff\\udcfe' is invalid: it holds bytes that are not "
                         "UTF-8 text (at character 3); pass UTF-8 text")


# scripts/prepare_data.py ---------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--validation_every", "--docs_per_shard"])
def test_a_zero_count_is_refused_before_anything_is_written(tmp_path, flag):
    done = run("scripts/prepare_data.py", "--source", "kjv", "--out", str(tmp_path / "out"),
               flag, "0")
    assert_refused(done, f"argument {flag}: 0 is invalid: must be a positive integer")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source,message", [
    ("tfds:no_such_dataset", "--source=tfds:no_such_dataset is invalid: no prepared "
                             "array_record tfds dataset"),
    ("hf_disk:{empty}", "is not a dataset saved with datasets' save_to_disk"),
], ids=["tfds", "hf-disk"])
@pytest.mark.slow
def test_a_source_that_does_not_open_leaves_no_plan(tmp_path, source, message):
    """The plan (prepare.json) is written only once the source opens, so the corrected command
    in the same --out is not refused as "a preparation with other settings"."""
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    done = run("scripts/prepare_data.py", "--source", source.format(empty=tmp_path / "empty"),
               "--out", str(out), "--workers", "1")
    assert_refused(done, message, before_jax=False)
    assert not (out / "prepare.json").exists()
    (tmp_path / "a.txt").write_text("In the beginning.\n" * 50)
    (tmp_path / "b.txt").write_text("And the earth was without form.\n" * 50)
    done = run("scripts/prepare_data.py", "--source", str(tmp_path / "*.txt"), "--out", str(out),
               "--workers", "1", "--validation_every", "2")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert json.loads((out / "prepare.json").read_text())["source"] == str(tmp_path / "*.txt")


# scripts/export_hf.py ------------------------------------------------------------------------

def write_run(workdir: Path, **overrides) -> Path:
    """A run directory as the export's argument checks see it: config.json and a checkpoint
    directory (never restored: the checks refuse first)."""
    config = resolve(tiny_config(**overrides), 1)
    workdir.mkdir()
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    (workdir / "checkpoints" / "0").mkdir(parents=True)
    return workdir


@pytest.mark.parametrize("overrides,out,message", [
    (dict(vocab_size=97), "{new}", "model.vocab_size=97 cannot be exported: the run's tokenizer "
     "(byte) has 256 tokens, so the exported tokenizer would give ids past the embedding"),
    (dict(attention__num_heads=3, attention__num_kv_heads=1, attention__head_dim=16,
          attention__width=48), "{new}",
     "model.attention.num_heads=3 cannot be exported as llama: transformers' LlamaConfig "
     "requires hidden_size (model.d_model=32) to be a multiple of num_attention_heads"),
    ({}, "{file}", "is a file, not a directory"),
    ({}, "{file}/hf", "cannot be created: {file} is a file"),
], ids=["vocab-below-tokenizer", "heads-not-dividing-width", "out-file", "out-under-file"])
def test_an_export_that_cannot_be_made_is_one_line_before_jax(tmp_path, overrides, out,
                                                              message):
    workdir = write_run(tmp_path / "run", **overrides)
    (tmp_path / "file").write_text("")
    paths = dict(new=tmp_path / "hf", file=tmp_path / "file")
    done = run("scripts/export_hf.py", "--workdir", str(workdir), "--out", out.format(**paths))
    assert_refused(done, message.format(**paths))
    assert not (tmp_path / "hf").exists() and (tmp_path / "file").read_text() == ""
