"""`python -m train --config PATH[:ARG] --workdir DIR [--config.FIELD=VALUE ...]`

Trains the experiment's model, resuming from <workdir>'s newest checkpoint if there is one, and
ends by printing the validation loss and a generated sample. Exit status: 0 done, 1 stopped on a
non-finite loss or state, 2 bad config, arguments or run directory (one line on stderr), 3 a
checkpoint or metrics.jsonl could not be written (one line naming the path, the error and the
newest complete checkpoint), 4 another process of the job died (several
processes only; one line naming it where known), 130 interrupted (SIGINT, Ctrl-C) and 143 preempted
(SIGTERM), each after saving the checkpoint of the current step. The run directory is
described in docs/runs.md.

The config is resolved once (`config.resolve`: every field, component name, model and execution
rule and the mesh arithmetic for the devices), then the training checks, the workdir, its lock
and, when resuming, the config's identity with the run's (`train.rundir`), all before JAX is
imported when the environment says how many devices JAX will see (a CPU-only JAX: the host
platform's device count, `sharding.environment.device_count_from_environment`); otherwise JAX counts
them first. Before all that, on Linux, the process re-executes itself once with malloc's huge
pages on (`train.hugepages`).
"""

from __future__ import annotations

import os
import re
import sys
import time

from train import hugepages

if __name__ == "__main__":  # first: re-executing repeats the imports below
    hugepages.reexec()  # XLA:CPU's step buffers in huge pages

import ml_collections
from absl import logging as absl_logging

from config import ConfigError, resolve
from config.cli import ArgumentParser, parse_with_config
from config.state_memory import check_state_fits
from config.validate import check_training
from sharding.environment import (
    device_count_from_environment,
    heartbeat_seconds,
    multiprocess_launch,
)
from train import launch, rundir
from train.data.arguments import check_prepared
from train.data.tokenizer import check_vocab, tokenizer_of

# A collective that failed because another process of the job is gone (gloo on the CPU; the
# coordination service's heartbeat elsewhere).
LOST_PROCESS = re.compile(r"Gloo|Connection reset|Connection closed|heartbeat|UNAVAILABLE", re.I)


def parse(argv: list[str]) -> tuple[ml_collections.ConfigDict, str]:
    """(config with overrides applied, workdir) of the command line `argv` (argv[0] is the
    program), `model.vocab_size` 0 filled from the tokenizer; a bad argument exits 2 with one line
    (`config.cli`)."""
    parser = ArgumentParser("python -m train", __doc__)
    parser.add_argument("--workdir", metavar="DIR",
                        help="run directory (checkpoints, metrics, config; docs/runs.md)")
    config, args = parse_with_config(parser, argv[1:])
    if not args.workdir:
        parser.error("--workdir is required, e.g. --workdir runs/quickstart")
    check_vocab(config.model, tokenizer_of(config.data))  # vocab_size=0: the tokenizer's
    return config, args.workdir


def check_run(config, workdir: str) -> None:
    """The checks of a training run on the resolved `config`: its data and final sample, and its
    run directory (writable, not locked by another job, the same config as its checkpoints',
    its files intact)."""
    check_training(config)
    check_prepared(config.data)  # a prepared dataset's metadata and indices, before they load
    rundir.check_workdir(workdir)
    if not multiprocess_launch(os.environ):  # several processes: process 0 locks, in train()
        rundir.check_not_locked(workdir)
    rundir.check_resume(workdir, config, resolved=True)
    check_state_fits(config)  # parameters and optimizer state against the memory, from the config


def main(argv: list[str]) -> int:
    if launch.needs_supervisor(os.environ):  # a pod's or srun's process: one line if a peer dies
        try:
            heartbeat_seconds(os.environ)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return launch.supervise(argv)
    try:
        config, workdir = parse(argv)
        devices = device_count_from_environment(os.environ)
        if devices is not None:  # everything is checked before JAX loads
            config = resolve(config, devices)
            check_run(config, workdir)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax logs every save at INFO
    try:
        import jax

        from sharding.mesh import maybe_initialize_distributed, slice_count
        from train.checkpoint import WriteError
        from train.loop import NonFiniteLoss, train

        if devices is None:  # JAX counts the devices (of every process), then the same checks
            maybe_initialize_distributed()
            config = resolve(config, jax.device_count(), slice_count(jax.devices()))
            check_run(config, workdir)
        result = train(config, workdir, checked=True)
    except KeyboardInterrupt as error:  # SIGINT: the loop saved its step first (`Interrupted`)
        print(str(error) or "SIGINT: stopped; rerun the same command to resume from the newest "
              "checkpoint", file=sys.stderr)
        return 130
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except NonFiniteLoss as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except WriteError as error:
        print(f"error: {error}", file=sys.stderr)
        return 3
    except jax.errors.JaxRuntimeError as error:
        if jax.process_count() == 1 or not LOST_PROCESS.search(str(error)):
            raise
        if os.environ.get(launch.SUPERVISED) == "1":  # the supervisor names the dead process
            time.sleep(heartbeat_seconds(os.environ) + 15)  # once the service ends this one
            os._exit(4)
        print(f"error: process {jax.process_index()} of {jax.process_count()} lost another "
              f"process of this job ({str(error).splitlines()[0][:200]}); rerun the job to "
              "resume from its newest checkpoint", file=sys.stderr)
        return 4
    if result["preempted"]:
        return 143
    if jax.process_index() == 0:  # one result per job
        unit = "byte" if (config.data.tokenizer or "byte") == "byte" else "token"
        print(f"validation loss at step {result['step']}: {result['eval_loss']:.4f} nats/{unit}")
        print("sample:\n" + result["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
