"""Export a blockbench run as a Hugging Face checkpoint that `transformers` loads.

`export_run(RUN, DIR)` (the command line: scripts/export_hf.py). RUN is a run directory
(`python -m train`, or an import); its newest checkpoint's parameters (or, with `ema`, their
EMA) are restored (`train.restore.restore_run`: never the optimizer state). A model that a
Llama or GPT-2 checkpoint represents exactly is written (RoPE → "llama", learned positions → "gpt2":
`arch.hf_config.hf_config_from_model`; anything else is refused in one line naming the field,
e.g. an AttnRes stream or a MoE FFN, as is what would not load back:
`train.interop.exportable`). DIR must not exist or be empty. It gets

  DIR/config.json        the model's architecture, float32 (`hf_config_from_model`);
  DIR/model.safetensors  float32 weights under the names `save_pretrained` writes
                         (`train.interop.hf.hf_tensors_from_params`, the importer's tables
                         inverted; no lm_head for a tied head);
  DIR/tokenizer.json     (or tokenizer.model) the run's tokenizer: its tokenizer.json or
                         SentencePiece model copied, or for a byte-level run a byte-level BPE
                         without merges whose ids are the byte values.

so that `transformers.AutoModelForCausalLM.from_pretrained(DIR)` computes the run's logits, and
`scripts/import_hf.py --checkpoint DIR` gives back the same parameters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.numpy import save_file

from arch.hf_config import hf_config_from_model
from train.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, tokenizer_of
from train.interop.exportable import check_exportable
from train.interop.hf import SINGLE_FILE, hf_tensors_from_params
from train.restore import restore_run, with_ema_params


def export_run(workdir: str | Path, out: str | Path, *, ema: bool = False) -> int:
    """Write the Hugging Face checkpoint of the run in `workdir` into `out` (see the module
    docstring): its parameters, or with `ema` their exponential moving average (a run with
    optimizer.ema_decay > 0; `train.restore.with_ema_params`). Returns the checkpoint's step.
    FileNotFoundError / ValueError with a one-line message."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--out={out} is not empty; export into a new directory")
    program, step, state = restore_run(workdir)
    if ema:
        state = with_ema_params(state, workdir)
    model_cfg = program.config.model
    tokenizer = tokenizer_of(program.config.data)
    check_exportable(model_cfg, tokenizer)  # these refuse before anything is written
    hf_config = hf_config_from_model(model_cfg)
    tensors = hf_tensors_from_params(model_cfg, state["params"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / SINGLE_FILE, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer.as_hugging_face().save(str(out / "tokenizer.json"))
    else:
        name = "tokenizer.json" if isinstance(tokenizer, HuggingFaceTokenizer) \
            else "tokenizer.model"
        shutil.copyfile(tokenizer.path, out / name)
    return step
