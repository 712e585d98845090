"""Import a local Hugging Face checkpoint as a blockbench run directory.

    python scripts/import_hf.py --checkpoint DIR --workdir OUT [--seq_len N]

DIR holds config.json and model.safetensors (or a sharded model.safetensors.index.json) of a
Llama-family or GPT-2 model; OUT becomes a run directory (config.json, a step-0 checkpoint, the
checkpoint's tokenizer) that every script reading a run takes: `train.interop.import_hf`, whose
module docstring says what it reads and writes. --seq_len: the run's seq_len (default: the
model's context capped at `import_hf.DEFAULT_MAX_SEQ_LEN`, 1024). Nothing is downloaded.

Exit status: 0 done; 2 a bad argument or a checkpoint that cannot be imported exactly; 3 the
run cannot be written (no space, a read-only directory); one line on stderr. The paths and
--seq_len are checked before JAX loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from config import ConfigError
from config.cli import ArgumentParser, positive_int
from train.data.arguments import output_directory, read_json_object
from train.interop.safetensors_file import safetensors_problem

WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # train.interop.hf's files
REPLACE_FILE = ("download or copy the checkpoint's files again (e.g. with huggingface-cli "
                "download), then rerun")  # as train.interop.hf.REPLACE_FILE


def check_checkpoint(directory: str) -> None:
    """--checkpoint: a directory holding config.json (a JSON object) and the weights'
    safetensors (each framed as safetensors and as long as its header says; a sharded index
    with its weight_map), read without JAX."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"--checkpoint={directory} is not a directory; pass a local Hugging "
                          f"Face checkpoint directory (config.json and {WEIGHTS[0]})")
    if not (path / "config.json").exists():
        raise ConfigError(f"--checkpoint={directory} holds no config.json: a Hugging Face "
                          f"checkpoint directory holds config.json and {WEIGHTS[0]} (or "
                          f"{WEIGHTS[1]})")
    if not any((path / name).exists() for name in WEIGHTS):
        others = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(others)}: convert it to safetensors)" if others else ""
        raise ConfigError(f"--checkpoint={directory} holds neither {WEIGHTS[0]} nor "
                          f"{WEIGHTS[1]}{hint}")
    invalid = f"--checkpoint={directory} is invalid"
    read_json_object(path / "config.json", invalid, REPLACE_FILE)
    if (path / WEIGHTS[1]).exists():
        weight_map = read_json_object(path / WEIGHTS[1], invalid, REPLACE_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
                isinstance(file, str) for file in weight_map.values()):
            raise ConfigError(f"{invalid}: {path / WEIGHTS[1]} has no weight_map object of "
                              f"tensor names to shard files; it is left as is: {REPLACE_FILE}")
        files = sorted(set(weight_map.values()))
    else:
        files = [WEIGHTS[0]]
    for file in files:
        problem = safetensors_problem(path / file) if (path / file).exists() else None
        if problem is not None:
            raise ConfigError(f"{invalid}: {path / file} {problem}; it is left as is: "
                              f"{REPLACE_FILE}")


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
    from train.checkpoint import WriteError, failure_reason  # JAX loads here, after the checks
    from train.interop.import_hf import import_checkpoint

    try:
        config_path = import_checkpoint(args.checkpoint, workdir, args.seq_len)
    except (FileNotFoundError, ValueError) as error:  # ConfigError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (WriteError, OSError) as error:
        print(f"error: cannot write the run into {workdir}: {failure_reason(error)}; remove "
              "it and rerun once the directory is writable and has space", file=sys.stderr)
        return 3
    print(f"wrote {config_path} and a step-0 checkpoint in {workdir / 'checkpoints'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
