"""Import a local Hugging Face checkpoint as a blockbench run directory.

    python scripts/import_hf.py --checkpoint DIR --workdir OUT [--seq_len N]

DIR holds config.json and model.safetensors (or a sharded model.safetensors.index.json) of a
Llama-family or GPT-2 model; OUT becomes a run directory (config.json, a step-0 checkpoint, the
checkpoint's tokenizer) that every script reading a run takes: `train.interop.import_hf`, whose
module docstring says what it reads and writes. --seq_len: the run's seq_len (default: the
model's context capped at `import_hf.DEFAULT_MAX_SEQ_LEN`, 1024). Nothing is downloaded.

Exit status: 0 done; 2 a bad argument or a checkpoint that cannot be imported exactly, one line
on stderr. The paths and --seq_len are checked before JAX loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from config import ConfigError
from config.cli import ArgumentParser, positive_int
from train.data.arguments import output_directory

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # train.interop.hf's files


def check_checkpoint(directory: str) -> None:
    """--checkpoint: a directory holding config.json and the weights' safetensors."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"--checkpoint={directory} is not a directory; pass a local Hugging "
                          f"Face checkpoint directory (config.json and {WEIGHTS[0]})")
    if not (path / "config.json").is_file():
        raise ConfigError(f"--checkpoint={directory} holds no config.json: a Hugging Face "
                          f"checkpoint directory holds config.json and {WEIGHTS[0]} (or "
                          f"{WEIGHTS[1]})")
    if not any((path / name).is_file() for name in WEIGHTS):
        others = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(others)}: convert it to safetensors)" if others else ""
        raise ConfigError(f"--checkpoint={directory} holds neither {WEIGHTS[0]} nor "
                          f"{WEIGHTS[1]}{hint}")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/import_hf.py", __doc__)
    parser.add_argument("--checkpoint", required=True, help="local Hugging Face checkpoint dir")
    parser.add_argument("--workdir", required=True, help="run directory to create")
    parser.add_argument("--seq_len", type=positive_int, default=None,
                        help="the run's seq_len; default min(model context, 1024)")
    args = parser.parse_args(argv)
    try:
        check_checkpoint(args.checkpoint)
        workdir = output_directory(args.workdir, "--workdir")
        if (workdir / "config.json").exists() or (workdir / "checkpoints").exists():
            raise ConfigError(f"--workdir={workdir} already holds a run; import into a new "
                              "directory")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.interop.import_hf import import_checkpoint  # JAX loads here, after the checks

    try:
        config_path = import_checkpoint(args.checkpoint, workdir, args.seq_len)
    except (FileNotFoundError, ValueError) as error:  # ConfigError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {config_path} and a step-0 checkpoint in {workdir / 'checkpoints'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
