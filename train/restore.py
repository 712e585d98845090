"""Restoring a training run from its directory: for generation, for the instruments that analyse
a run, and for anything else that reads one back (`python -m train.generate`,
`train.instruments`, scripts/).

A run directory holds the config.json that `python -m train` wrote and its Orbax checkpoints
(`train.checkpoint`). The config is read over `base_config()`'s defaults, so a field added since
the run was saved keeps its default, and the model is rebuilt onto all local devices along the
data axis whatever mesh it was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from config import ConfigError
from config.defaults import base_config
from config.resolution import unresolved
from train.checkpoint import Checkpointer
from train.data import in_memory, shards
from train.data.in_memory import VALIDATION_SEED
from train.data.tokenizer import tokenizer_of
from train.rundir import saved_config
from train.step import build_program, resolve_for_job

# Analysis runs on all local devices along the data axis, whatever mesh the run trained on.
ANALYSIS_MESH = dict(data=-1, fsdp=1, tensor=1, sequence=1, stage=1, expert=1)


# What generation, analysis and export leave unread in a checkpoint: the optimizer state, so
# restoring a run holds one copy of the parameters (two with an EMA), not AdamW's moments too.
UNREAD_ENTRIES = ("opt_state",)


def restore_run(workdir: str | Path, step: int | None = None):
    """(program, step, state) of the newest restorable checkpoint (or the one at `step`) of the
    training run in `workdir`, rebuilt from its config.json (over `base_config()`'s defaults)
    onto all local devices along the data axis (for generation and analysis). The state holds
    every entry of the train state but the `UNREAD_ENTRIES`: the optimizer state is not read.
    Raises FileNotFoundError with a one-line message when there is no config or checkpoint."""
    config = base_config()  # fields added since the run was saved keep their defaults
    saved = saved_config(workdir, json.loads(config.to_json_best_effort()))
    if saved is None:
        raise FileNotFoundError(f"--workdir={workdir} holds no config.json; train a model there "
                                "first with python -m train")
    config.update(saved)
    config.mesh = ANALYSIS_MESH
    program = build_program(resolve_for_job(config))
    with Checkpointer(workdir) as checkpointer:
        abstract_state = program.abstract_state()
        restored = checkpointer.restore_latest(
            {entry: value for entry, value in abstract_state.items()
             if entry not in UNREAD_ENTRIES}, partial=True, only=step)
        saved = sorted(checkpointer.manager.all_steps())
    if restored is None and step is not None:
        raise FileNotFoundError(f"--workdir={workdir} holds no restorable checkpoint at step "
                                f"{step} (its checkpoints: {saved or 'none'})")
    if restored is None:
        errors = checkpointer.restore_errors
        why = f" (step {max(errors)}: {errors[max(errors)]})" if errors else ""
        raise FileNotFoundError(f"--workdir={workdir} holds no restorable checkpoint{why}")
    step, state, _ = restored
    return program, step, state


def with_ema_params(state, workdir: str | Path = "") -> dict:
    """The train state with its EMA parameters (optimizer.ema_decay > 0) in place of its
    parameters: the EMA model, for generation and analysis. Raises ConfigError in one line when
    the run keeps no EMA."""
    if "ema" not in state:
        where = f" in --workdir={workdir}" if workdir else ""
        raise ConfigError(f"--ema is invalid: the run{where} keeps no EMA of its parameters "
                          "(optimizer.ema_decay=0); train one with "
                          "--config.optimizer.ema_decay=0.999, say")
    return {**state, "params": state["ema"]}


def evaluation_split(config, text: str | Path | None = None):
    """The held-out text a run is measured on, tokenized with the run's tokenizer
    (``data.tokenizer``; an imported checkpoint's own): ``text``, a local text file (one
    document) or a prepared directory (its validation split), else the run's validation split."""
    tokenizer = tokenizer_of(config.data)
    if text is None:
        return shards.load_split(config.data, "validation")
    path = Path(text)
    if (path / "metadata.json").is_file():
        return shards.PreparedDataset(path, "validation", tokenizer)
    if not path.is_file():
        raise ConfigError(f"--text={text} is invalid: it is neither a text file nor a prepared "
                          "directory (scripts/prepare_data.py)")
    tokens = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
    return in_memory.Dataset(tokens=tokens, name=str(path), split="validation")


def bytes_per_token(tokens_BxT1, config) -> float:
    """UTF-8 bytes of text per predicted token of a batch (targets ``[:, 1:]``), decoded with
    the run's tokenizer; a document separator counts as one byte (the byte pipeline's
    newline), so a byte-level run gives exactly 1."""
    tokenizer = tokenizer_of(config.data)
    targets = np.asarray(tokens_BxT1)[:, 1:]
    separators = targets == tokenizer.separator
    text_bytes = sum(len(tokenizer.decode(row[~keep]).encode("utf-8"))
                     for row, keep in zip(targets, separators, strict=True))
    return (text_bytes + int(separators.sum())) / targets.size


def restore_for_analysis(workdir: str | Path, batch: int, seq_len: int | None = None,
                         text: str | Path | None = None, *, ema: bool = False,
                         step: int | None = None):
    """(program, step, model in evaluation mode, validation tokens B×(T+1)) for the scripts that
    analyse a run: `restore_run` (the newest checkpoint, or the one at `step`), then the first
    batch of `batch` rows of `seq_len` + 1 tokens (default the run's seq_len) of
    `evaluation_split(config, text)`, the same batch for every run of a config. With `ema`, the
    model has the run's EMA parameters. Raises FileNotFoundError (no run) or ConfigError (a bad
    batch, length or text; no EMA) in one line."""
    program, step, state = restore_run(workdir, step)
    if ema:
        state = with_ema_params(state, workdir)
    return _for_analysis(program, step, state, batch, seq_len, text)


def initialization_for_analysis(config, batch: int, seq_len: int | None = None):
    """`restore_for_analysis` of the model a run of `config` starts from: its step-0 state
    (`TrainProgram.init(config.seed)`, what `python -m train` initializes), on all local devices
    along the data axis; nothing is read from disk but the validation text."""
    config = unresolved(config)
    config.mesh = ANALYSIS_MESH
    program = build_program(resolve_for_job(config))
    return _for_analysis(program, 0, program.init(config.seed), batch, seq_len, None)


def _for_analysis(program, step, state, batch, seq_len, text):
    config = program.config
    seq_len = seq_len or config.seq_len
    data_shards = program.mesh.shape["data"]
    if batch <= 0 or batch % data_shards:
        raise ConfigError(f"--batch={batch} is invalid: must be a positive multiple of the "
                          f"{data_shards} devices of the mesh's data axis")
    if not 2 <= seq_len <= config.model.max_seq_len:
        raise ConfigError(f"--seq_len={seq_len} is invalid: must be in [2, "
                          f"{config.model.max_seq_len}] (the model's max_seq_len)")
    tokens_BxT1 = evaluation_split(config, text).batch(0, batch, seq_len, VALIDATION_SEED)
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    model.eval()
    return program, step, model, jax.device_put(tokens_BxT1, program.batch_sharding)
