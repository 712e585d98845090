"""`python -m train --config PATH[:ARG] --workdir DIR [--config.FIELD=VALUE ...]`

Trains the experiment's model, resuming from <workdir>'s newest checkpoint if there is one, and
ends by printing the validation loss and a generated sample. Exit status: 0 done, 1 stopped on a
non-finite loss or state, 2 bad config, arguments or run directory (one line on stderr), 143
preempted (SIGTERM; a checkpoint was saved). The run directory is described in docs/runs.md.

Everything that can be checked without JAX is checked before JAX is imported: the config file,
the override names and types, every field (`config.validate`), the component names
(`config.registered`), the model's and the execution's rules (`config.model`), the workdir, its
lock and, when resuming, the config's identity with the run's (`train.rundir`). Before all that,
on Linux, the process re-executes itself once with malloc's huge pages on (`train.hugepages`).
"""

from __future__ import annotations

import os
import sys

from train import hugepages

if __name__ == "__main__":  # first: re-executing repeats the imports below
    hugepages.reexec()  # XLA:CPU's step buffers in huge pages

import ml_collections
from absl import logging as absl_logging

from config import ConfigError
from config import model as rules
from config.cli import ArgumentParser, parse_with_config
from config.registered import check_names
from config.validate import check_fields, check_training
from sharding.launch import multiprocess_launch
from train import rundir
from train.data.tokenizer import check_vocab, tokenizer_of


def parse(argv: list[str]) -> tuple[ml_collections.ConfigDict, str]:
    """(config with overrides applied and checked without JAX, workdir) of the command line
    `argv` (argv[0] is the program); a bad argument exits 2 with one line (`config.cli`)."""
    parser = ArgumentParser("python -m train", __doc__)
    parser.add_argument("--workdir", metavar="DIR",
                        help="run directory (checkpoints, metrics, config; docs/runs.md)")
    config, args = parse_with_config(parser, argv[1:])
    if not args.workdir:
        parser.error("--workdir is required, e.g. --workdir runs/quickstart")
    check_fields(config)
    check_names(config.model)  # against arch/'s registrations, read without importing it
    resolved = config.copy_and_resolve_references()  # the run keeps its derived fields unset
    rules.resolve_model(resolved.model)  # every rule that needs no registry nor device
    rules.check_execution(resolved.execution)
    check_vocab(config.model, tokenizer_of(config.data))  # vocab_size=0: the tokenizer's
    check_training(config)
    rundir.check_workdir(args.workdir)
    if not multiprocess_launch(os.environ):  # several processes: process 0 locks, in train()
        rundir.check_not_locked(args.workdir)
    rundir.check_resume(args.workdir, config, resolved=False)
    return config, args.workdir


def main(argv: list[str]) -> int:
    try:
        config, workdir = parse(argv)
    except ConfigError as error:
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
    unit = "byte" if (config.data.tokenizer or "byte") == "byte" else "token"
    print(f"validation loss at step {result['step']}: {result['eval_loss']:.4f} nats/{unit}")
    print("sample:\n" + result["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
