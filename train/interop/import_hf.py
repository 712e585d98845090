"""Import a local Hugging Face checkpoint as a blockbench run directory.

`import_checkpoint(DIR, OUT)` (the command line: scripts/import_hf.py). DIR holds config.json
and model.safetensors (or a sharded model.safetensors.index.json) of a Llama-family (model_type
"llama", or "mistral": its sliding window is attention.window) or GPT-2 model;
`train.interop.hf.load_hf_checkpoint` converts it (what maps to what, and what raises: its
docstring and `arch.hf_config`'s). Nothing is downloaded. OUT must not hold a run yet. It writes

  OUT/config.json      the full training config, as `python -m train` writes it:
                       `config.defaults.base_config()` with the imported model section. Its
                       seq_len is the model's context (max_position_embeddings / n_positions)
                       capped at 1024, or `seq_len`; data is base_config's (the embedded King
                       James Bible) tokenized with the checkpoint's own tokenizer: DIR's
                       tokenizer.json (data.tokenizer="hf:OUT/tokenizer.json") or SentencePiece
                       tokenizer.model ("sentencepiece:OUT/tokenizer.model"), copied into OUT;
                       without either, bytes, which mean nothing to a BPE model (probes of the
                       network's internals still run).
  OUT/checkpoints/0    an Orbax checkpoint at step 0: the imported parameters (float32) and a
                       freshly initialized (zero) optimizer state, the train state a run holds.
  OUT/hf_source.json   provenance: the absolute checkpoint path and its config.json.
  OUT/tokenizer.json   (or tokenizer.model) the checkpoint's tokenizer, when it has one.

so that `train.restore.restore_run(OUT)` restores the model and every script that reads a run
(`python -m train.generate`, scripts/depth_mixing.py, ...) works on it unchanged. Memory: about
four copies of the float32 parameters at peak (tensors read, parameters, two optimizer moments).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from config.defaults import base_config
from train.checkpoint import Checkpointer
from train.data.tokenizer import check_vocab, load_tokenizer
from train.interop.hf import load_hf_checkpoint, read_hf_config
from train.step import build_program, resolve_for_job

DEFAULT_MAX_SEQ_LEN = 1024  # cap on the run's seq_len when `seq_len` is not given
TOKENIZER_FILES = {"tokenizer.json": "hf", "tokenizer.model": "sentencepiece"}  # in this order


def import_checkpoint(checkpoint: str | Path, workdir: str | Path,
                      seq_len: int | None = None) -> Path:
    """Convert `checkpoint` and write the run directory `workdir` (see the module docstring);
    returns the config path. Raises FileNotFoundError / ValueError (incl. ConfigError) with a
    one-line message."""
    workdir = Path(workdir)
    if (workdir / "config.json").exists() or (workdir / "checkpoints").exists():
        raise ValueError(f"--workdir={workdir} already holds a run; import into a new directory")
    model_cfg, model = load_hf_checkpoint(checkpoint)
    config = base_config()
    config.model = model_cfg
    config.seq_len = seq_len if seq_len is not None else min(model_cfg.max_seq_len,
                                                             DEFAULT_MAX_SEQ_LEN)
    tokenizer_file = next((Path(checkpoint) / name for name in TOKENIZER_FILES
                           if (Path(checkpoint) / name).is_file()), None)
    if tokenizer_file is not None:
        kind = TOKENIZER_FILES[tokenizer_file.name]
        config.data.tokenizer = f"{kind}:{(workdir / tokenizer_file.name).absolute()}"
        check_vocab(config.model, load_tokenizer(f"{kind}:{tokenizer_file}"))
    program = build_program(resolve_for_job(config))  # checked (seq_len ≤ max_seq_len, mesh)
    # before anything is written
    params, model_state = nnx.state(model, nnx.Param), nnx.state(model, nnx.Not(nnx.Param))

    def initial_state(params, model_state):  # the structure TrainProgram.init gives, step 0
        return {"step": jnp.zeros((), jnp.int32), "params": params, "model_state": model_state,
                "opt_state": program.optimizer.init(params)}

    with jax.set_mesh(program.mesh):
        state = jax.jit(initial_state, out_shardings=program.state_shardings)(params,
                                                                               model_state)
    workdir.mkdir(parents=True, exist_ok=True)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, workdir / tokenizer_file.name)
    with Checkpointer(workdir, config.keep_checkpoints) as checkpointer:
        checkpointer.save(0, state, {"next_step": 0, "seed": config.seed}, force=True)
    source = {"checkpoint": str(Path(checkpoint).absolute()),
              "hf_config": read_hf_config(checkpoint)}
    (workdir / "hf_source.json").write_text(json.dumps(source, indent=2) + "\n")
    config_path = workdir / "config.json"
    config_path.write_text(config.to_json_best_effort(indent=2) + "\n")
    return config_path
