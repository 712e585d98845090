"""`python -m train --config PATH[:ARG] --workdir DIR [--config.FIELD=VALUE ...]`

Trains the experiment's model, resuming from <workdir>'s newest checkpoint if there is one, and
ends by printing the validation loss and a generated sample. Exit status: 0 done, 1 stopped on a
non-finite loss or state, 2 bad config, arguments or run directory (one line on stderr), 143
preempted (SIGTERM; a checkpoint was saved). The run directory is described in docs/runs.md.

Everything that can be checked without JAX is checked before JAX is imported: the config file,
the override names and types, every field (`config.validate`), the workdir, its lock and, when
resuming, the config's identity with the run's (`train.rundir`).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys

import ml_collections
from absl import flags
from absl import logging as absl_logging
from ml_collections import config_flags

from config import ConfigError
from config.validate import check_fields, check_training
from sharding.launch import multiprocess_launch
from train import rundir

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file, PATH[:ARG].",
                                          lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, config).")


class UsageError(ValueError):
    """A command-line error: one line, exit status 2."""


def _config_argument(argv: list[str]) -> str:
    """The value of --config (PATH[:ARG]); UsageError if absent or naming no file."""
    for i, arg in enumerate(argv):
        value = (arg.split("=", 1)[1] if arg.startswith("--config=")
                 else argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
        if value is not None:
            path = value.split(":", 1)[0]
            if not os.path.isfile(path):
                raise UsageError(f"--config={path} does not exist; pass an experiment file such "
                                 "as experiments/quickstart.py")
            return value
    raise UsageError("--config is required, e.g. --config experiments/quickstart.py")


def load_experiment(value: str) -> ml_collections.ConfigDict:
    """Run the experiment file PATH of `value` (PATH[:ARG]) and return `get_config(ARG)`, with a
    one-line UsageError for a file that does not load or does not define `get_config`."""
    path, _, arg = value.partition(":")
    spec = importlib.util.spec_from_file_location("blockbench_experiment", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise UsageError(f"--config={path} has a syntax error at line {error.lineno}: "
                         f"{error.msg}") from None
    except Exception as error:  # noqa: BLE001 -- any failure of the file is the user's to fix
        raise UsageError(f"--config={path} fails to load: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from None
    get_config = getattr(module, "get_config", None)
    if not callable(get_config):
        raise UsageError(f"--config={path} defines no get_config(arg=None); an experiment file "
                         "returns its ConfigDict from get_config (see experiments/quickstart.py)")
    try:
        config = get_config(arg) if arg else get_config()
    except Exception as error:  # noqa: BLE001
        raise UsageError(f"--config={value}: get_config raised {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise UsageError(f"--config={path}: get_config returned {type(config).__name__}, not an "
                         "ml_collections.ConfigDict")
    return config


def check_override_names(config: ml_collections.ConfigDict, argv: list[str]) -> None:
    """UsageError naming the first --config.FIELD that `config` does not have."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        field = arg[len("--config."):].split("=", 1)[0]
        node, parts = config, field.split(".")
        for depth, part in enumerate(parts):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                parent = ".".join(parts[:depth]) or "the config"
                known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
                close = difflib.get_close_matches(part, known, n=1)
                hint = f"; did you mean {'.'.join(parts[:depth] + close)}?" if close else ""
                raise UsageError(f"--config.{field}: {parent} has no field {part!r}{hint}")
            node = node[part]


def parse(argv: list[str]) -> tuple[ml_collections.ConfigDict, str]:
    """(config with overrides applied and checked without JAX, workdir) of the command line."""
    config_value = _config_argument(argv[1:])
    check_override_names(load_experiment(config_value), argv[1:])
    try:
        rest = flags.FLAGS(argv)
        config = _CONFIG.value
    except flags.Error as error:
        raise UsageError(str(error).splitlines()[0]) from None
    except Exception as error:  # noqa: BLE001 -- config_flags' own failures, in one line
        raise UsageError(f"--config: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from None
    if len(rest) > 1:
        raise UsageError(f"unexpected argument {rest[1]!r}; fields are set as "
                         "--config.FIELD=VALUE")
    workdir = _WORKDIR.value
    if not workdir:
        raise UsageError("--workdir is required, e.g. --workdir runs/quickstart")
    check_fields(config)
    check_training(config)
    rundir.check_workdir(workdir)
    if not multiprocess_launch(os.environ):  # several processes: process 0 locks, in train()
        rundir.check_not_locked(workdir)
    rundir.check_resume(workdir, config, resolved=False)
    return config, workdir


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help", "--helpfull") for arg in argv[1:]):
        print(__doc__)
        return 0
    try:
        config, workdir = parse(argv)
    except (UsageError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO
    # JAX loads here, after every cheap check: the model and mesh checks need it.
    import jax

    from sharding.mesh import maybe_initialize_distributed, slice_count
    from train.config import validate

    try:
        maybe_initialize_distributed()
        validate(config, jax.device_count(), slice_count(jax.devices()))  # before Orbax, tfds
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.loop import NonFiniteLoss, train

    try:
        result = train(config, workdir)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except NonFiniteLoss as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if result["preempted"]:
        return 143
    print(f"validation loss at step {result['step']}: {result['eval_loss']:.4f} nats/byte")
    print("sample:\n" + result["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
