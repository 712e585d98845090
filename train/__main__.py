"""`python -m train --config PATH[:ARG] --workdir DIR [--config.FIELD=VALUE ...]`

Trains the experiment's model, resuming from <workdir>'s newest checkpoint if there is one, and
ends by printing the validation loss and a generated sample. Exit status: 0 done, 1 stopped on a
non-finite loss, 2 bad config or arguments, 143 preempted (SIGTERM; a checkpoint was saved).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file, PATH[:ARG].",
                                          lock_config=False)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, config).")


def _config_path_error(argv: list[str]) -> str | None:
    """Say so in one line if --config names no file (absl would print a traceback-like dump)."""
    for i, arg in enumerate(argv):
        value = (arg.split("=", 1)[1] if arg.startswith("--config=")
                 else argv[i + 1] if arg == "--config" and i + 1 < len(argv) else None)
        if value is not None:
            path = value.split(":", 1)[0]
            if not os.path.isfile(path):
                return f"error: --config={path} does not exist; pass an experiment file such as " \
                       "experiments/quickstart.py"
            return None
    return "error: --config is required, e.g. --config experiments/quickstart.py"


def main(argv) -> int:
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO
    from config import ConfigError
    from train.loop import NonFiniteLoss, train

    if not _WORKDIR.value:
        print("error: --workdir is required, e.g. --workdir runs/quickstart", file=sys.stderr)
        return 2
    try:
        result = train(_CONFIG.value, _WORKDIR.value)
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
    error = _config_path_error(sys.argv[1:])
    if error:
        print(error, file=sys.stderr)
        sys.exit(2)
    app.run(lambda argv: sys.exit(main(argv)))
