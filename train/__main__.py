"""`python -m train --config PATH[:ARG] --workdir DIR [--config.FIELD=VALUE ...]`

Trains the experiment's model, resuming from <workdir>'s newest checkpoint if there is one, and
ends by printing the validation loss and a generated sample. Exit status: 0 done, 1 stopped on a
non-finite loss or state, 2 bad config, arguments or run directory (one line on stderr), 3 a
checkpoint or metrics.jsonl could not be written (one line naming the path, the error and the
newest complete checkpoint), 4 another process of the job died (several processes only; one
line naming it where known), 5 out of memory although the state-memory check passed (one line:
the estimate, the limit, the knobs), 130 interrupted (SIGINT, Ctrl-C) and 143 preempted
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

import json
import os
import re
import socket
import sys
import time

from train import hugepages

if __name__ == "__main__":  # first: re-executing repeats the imports below
    hugepages.reexec()  # XLA:CPU's step buffers in huge pages

import ml_collections
from absl import logging as absl_logging

from config import ConfigError, resolve
from config.cli import ArgumentParser, parse_with_config
from config.defaults import base_config
from config.state_memory import check_state_fits, out_of_memory_line
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
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|out of memory", re.I)
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


def check_run(config, workdir: str, processes_on_host: int = 1) -> None:
    """The checks of a training run on the resolved `config`: its data and final sample, and its
    run directory (writable, not locked by another job, the same config as its checkpoints',
    its files intact)."""
    check_training(config)
    check_prepared(config.data)  # a prepared dataset's metadata and indices, before they load
    rundir.check_workdir(workdir)
    if not multiprocess_launch(os.environ):  # several processes: process 0 locks, in train()
        rundir.check_not_locked(workdir)
    rundir.check_resume(workdir, config, resolved=True)
    check_state_fits(config, processes_on_host)  # the state against the memory, from the config


def check_same_config(config) -> None:
    """Refuse (`ConfigError`) a job whose processes resolved different configs (each host ran
    other arguments or another config file), before the first collective: each process
    publishes its resolved config in the coordination service and compares it with process
    0's. The process that differs says how; process 0, if it differs from some, says so after
    a moment (so that, under `train.launch`, the one that differs is the one named)."""
    import jax

    from sharding.mesh import gather_text

    mine = config.to_json_best_effort(sort_keys=True)
    configs = gather_text("resolved-config", mine)
    index = jax.process_index()
    differing = [i for i, other in enumerate(configs) if other != configs[0]]
    if not differing:
        return
    if index == 0:
        time.sleep(5)
        raise ConfigError(f"process{'es' if len(differing) > 1 else ''} "
                          f"{', '.join(map(str, differing))} of this job resolved a different "
                          "config from process 0's; every process must run the same arguments "
                          "and config file")
    if index in differing:
        theirs = rundir._flatten(json.loads(configs[0]))
        ours = rundir._flatten(json.loads(mine))
        derived = rundir._flatten(json.loads(base_config().to_json_best_effort()))
        fields = [f"{field}: {theirs.get(field)!r} (process 0) → {ours.get(field)!r}"
                  for field in sorted(theirs.keys() | ours.keys(),
                                      key=lambda field: (derived.get(field, 0) is None, field))
                  if theirs.get(field) != ours.get(field)]
        raise ConfigError(f"process {index} of {jax.process_count()} resolved a different config "
                          f"from process 0's ({'; '.join(fields[:4])}"
                          f"{'; …' if len(fields) > 4 else ''}); every process must run the same "
                          "arguments and config file")
    time.sleep(5)  # the same as process 0's: one that differs says why; then stop with it
    raise ConfigError(f"processes {', '.join(map(str, differing))} of this job resolved a "
                      "different config from process 0's; every process must run the same "
                      "arguments and config file")


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

        from sharding.mesh import gather_text, maybe_initialize_distributed, slice_count
        from train.checkpoint import WriteError
        from train.loop import NonFiniteLoss, train

        if devices is None:  # JAX counts the devices (of every process), then the same checks
            maybe_initialize_distributed()
            config = resolve(config, jax.device_count(), slice_count(jax.devices()))
            check_same_config(config)
            hosts = gather_text("host", socket.gethostname())
            check_run(config, workdir, processes_on_host=hosts.count(socket.gethostname()))
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
        if jax.process_count() > 1 and os.environ.get(launch.SUPERVISED) == "1":
            # a save needs every process: if another died, the coordination service ends this
            # one within the heartbeat and the supervisor names the dead one (exit 4)
            time.sleep(heartbeat_seconds(os.environ) + 10)
        print(f"error: {error}", file=sys.stderr)
        return 3
    except jax.errors.JaxRuntimeError as error:
        if OUT_OF_MEMORY.search(str(error)):
            print(f"error: {out_of_memory_line(config, str(error).splitlines()[0])}",
                  file=sys.stderr)
            return 5
        if jax.process_count() == 1 or not LOST_PROCESS.search(str(error)):
            raise
        if os.environ.get(launch.SUPERVISED) == "1":  # the supervisor names the dead process
            time.sleep(heartbeat_seconds(os.environ) + 15)  # once the service ends this one
            os._exit(4)
        if "BLOCKBENCH_PROCESS_ID" in os.environ:  # train.launch's line names the dead one
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


def exit_now_if_failed(status: int) -> None:
    """After a failure, one process of several leaves at once: a normal exit waits at the
    coordination service's shutdown barrier for the others, which wait for it (the launcher,
    or the heartbeat, stops them, naming this one)."""
    if status in (0, 130, 143) or "jax" not in sys.modules:
        return
    import jax

    if jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    exit_status = main(sys.argv)
    exit_now_if_failed(exit_status)
    sys.exit(exit_status)
