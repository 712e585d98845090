"""Several seeds of one config trained at once, as one program on one device (study mode).

    python -m train.seeds --config PATH[:ARG] --workdir DIR --seeds 0,1,2,3 [--config.FIELD=V ...]

trains seed k into DIR/seed<k>, as `python -m train --config PATH[:ARG] --workdir DIR/seed<k>
--config.seed=k` would, but with one compile for all the seeds: the init, train and eval steps
of `train.step.TrainProgram` are `jax.vmap`ped over a leading seed axis, so each seed keeps its
own initialization (`jax.random.key(seed)`) and its own batches (the data order of (seed,
step)). For small models, where a step is mostly launch and compile overhead, S seeds cost
about one run's compile and much less than S runs' steps (docs/studies.md#study-mode).

Each DIR/seed<k> gets what a study reads from a run: config.json (with its seed), metrics.jsonl
(train_loss, grad_norm, learning_rate every log_every steps; eval_loss every eval_every and at
the end) and, at the end, its final checkpoint, so `scripts/study_report.py`,
`scripts/sweep.py` (which skips a finished run) and the probes treat it as an ordinary run.
A seed whose state turns non-finite stops being logged and is not saved (the others go on).
Not in this mode: dropout (its keys come from the config's one seed), several devices, several
processes. Equality with separate runs to float32 tolerance: tests/test_seeds.py.

It is a trainer like `python -m train`: it locks DIR (and each DIR/seed<k>, `train.rundir.
WorkdirLock`) and, before anything is written, checks that each DIR/seed<k> is absent, empty, or
this seed's run of this config (its config.json resumes this config with seed k, its newest
checkpoint not past `steps`); a directory holding anything else, or locked by a live trainer, is
refused in one line (exit 2) and left as is. When every seed directory holds a checkpoint of the
same step, the group resumes from it (an interrupted group goes on). SIGINT (Ctrl-C) and SIGTERM
save every finite seed's current step and stop with one line (exit 130, 143). Exit status:
0 done, 1 some seed non-finite, 2 bad arguments or run directories, 3 a failed write, 130, 143.
"""

from __future__ import annotations

import sys
from pathlib import Path

from train import hugepages

if __name__ == "__main__":  # first: re-executing repeats the imports below
    hugepages.reexec()  # XLA:CPU's step buffers in huge pages, as python -m train does

import contextlib
import json
import signal

from config import ConfigError, resolve
from config.cli import ArgumentParser, UsageError, parse_with_config
from config.defaults import base_config
from config.validate import MAX_SEED, check_training
from train import rundir
from train.data.tokenizer import check_vocab, tokenizer_of


class Stopped(Exception):
    """A signal stopped the group after every finite seed saved its step: the one line (str)
    and the exit status (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, line: str, status: int):
        super().__init__(line)
        self.status = status


def parse(argv: list[str]):
    """(config, workdir, seeds) of the command line; one line and exit 2 for a bad argument."""
    parser = ArgumentParser("python -m train.seeds", __doc__)
    parser.add_argument("--workdir", required=True, metavar="DIR",
                        help="the runs go to DIR/seed<k>")
    parser.add_argument("--seeds", required=True, help="comma-separated seeds, e.g. 0,1,2,3")
    config, args = parse_with_config(parser, argv[1:])
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds={args.seeds} is invalid: comma-separated integers, e.g. 0,1,2,3")
    if any(seed < 0 for seed in seeds) or len(set(seeds)) != len(seeds):
        parser.error(f"--seeds={args.seeds} is invalid: seeds must be distinct non-negative ints")
    if any(seed > MAX_SEED for seed in seeds):
        parser.error(f"--seeds={args.seeds} is invalid: each seed must be at most {MAX_SEED} "
                     "(the initialization's key is an int32)")
    return config, args.workdir, seeds


def check_seed_mode(config) -> None:
    """What this mode cannot train beyond one device (the config is resolved for one): dropout,
    whose keys come from the config's one seed."""
    from arch import dropout

    if dropout.enabled(config.model):
        raise ConfigError("model.dropout is invalid in train.seeds: dropout keys come from the "
                          "config's one seed; train these seeds separately (python -m train)")


# What `scripts/sweep.py --vmap_seeds` writes into a seed's directory before it launches this
# (`train.studies.sweep`): a seed directory holding only these is a new run.
SWEEP_FILES = {"provenance.jsonl", "train.log"}


def config_json(config) -> dict:
    """A ConfigDict as config.json holds it (tuples as lists, references resolved)."""
    return json.loads(config.to_json_best_effort())


def seed_config(config, seed: int):
    """`config` (resolved) as seed `seed`'s run writes it in its config.json."""
    copy = config.as_configdict()
    copy.seed = seed
    return copy


def _refuse(root, directory: Path, problem: str) -> rundir.WorkdirError:
    return rundir.WorkdirError(f"--workdir={root}: {directory} {problem}; train.seeds leaves it "
                               "as is: move it aside or use another --workdir")


def check_seed_directories(config, root: str | Path, seeds: list[int]) -> int:
    """The step the group starts from, after checking (reading only) that each root/seed<k> is
    absent, empty or seed k's run of `config` (resolved): its config.json resumes this config
    with seed k (`train.rundir.identity_differences`), its metrics.jsonl is intact, no live
    trainer holds it, and its newest checkpoint is not past `steps`. That step is the seeds'
    common newest checkpoint (0 when none has one). Raises `WorkdirError` in one line
    otherwise; nothing is written."""
    rundir.check_workdir(root)
    defaults = config_json(base_config())
    newest = {}
    for seed in seeds:
        directory = Path(root) / f"seed{seed}"
        if directory.exists() and not directory.is_dir():
            raise _refuse(root, directory, "is a file, not a seed's run directory")
        if not directory.exists() or {entry.name for entry in directory.iterdir()} <= SWEEP_FILES:
            newest[seed] = 0  # a new run (a sweep records its provenance before it launches)
            continue
        rundir.check_not_locked(directory)
        saved = rundir.saved_config(directory, defaults)
        if saved is None:
            raise _refuse(root, directory, "holds files but no config.json: it is not a run of "
                          f"seed {seed} of this config")
        differences = rundir.identity_differences(
            saved, config_json(seed_config(config, seed)), resolved=True)
        if differences:  # derived fields (default None) last: the cause first
            derived = rundir._flatten(defaults)
            differences.sort(key=lambda difference: derived.get(difference[0], 0) is None)
            shown = "; ".join(f"{field}: {old!r} → {value!r}"
                              for field, old, value in differences[:4])
            raise _refuse(root, directory, f"holds another run ({shown}"
                          f"{'; …' if len(differences) > 4 else ''})")
        rundir.check_metrics(directory)
        steps = rundir.checkpoint_steps(directory)
        if steps and steps[-1] > config.steps:
            raise _refuse(root, directory, f"holds a checkpoint at step {steps[-1]}, past "
                          f"steps={config.steps}: raise steps to at least {steps[-1]} to resume it")
        newest[seed] = steps[-1] if steps else 0
    if len(set(newest.values())) > 1:
        shown = ", ".join(f"seed{seed}: {step or 'none'}" for seed, step in newest.items())
        raise rundir.WorkdirError(
            f"--workdir={root}: its seed directories hold checkpoints of different steps "
            f"({shown}), so they cannot resume as one group; they are left as is: train those "
            "seeds apart (python -m train) or move their directories aside")
    return next(iter(newest.values()))


@contextlib.contextmanager
def claimed(config, root: str | Path, seeds: list[int]):
    """Check the seed directories (`check_seed_directories`, before anything is written), then
    lock the root and each seed's directory for the run; yields the step to start from."""
    check_seed_directories(config, root, seeds)  # a refusal writes nothing, not even a lock
    with contextlib.ExitStack() as locks:
        locks.enter_context(rundir.WorkdirLock(root))
        start = check_seed_directories(config, root, seeds)  # again, under the lock
        for seed in seeds:
            locks.enter_context(rundir.WorkdirLock(Path(root) / f"seed{seed}"))
        yield start


def train_seeds(config, workdir: str | Path, seeds: list[int]) -> dict[int, float]:
    """Train `seeds` of `config` (resolved for one device) into `workdir`/seed<k>; returns
    {seed: final eval loss} of the seeds that stayed finite (module docstring). Raises
    `WorkdirError` for a seed directory it may not use (nothing written), `Stopped` after a
    signal (every finite seed's step saved)."""
    check_seed_mode(config)
    with claimed(config, workdir, seeds) as start:
        return _train(config, Path(workdir), seeds, start)


def _train(config, workdir: Path, seeds: list[int], start: int) -> dict[int, float]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tqdm

    from sharding.mesh import make_mesh
    from train.checkpoint import Checkpointer
    from train.data.in_memory import VALIDATION_SEED
    from train.loop import _Preemption, load_splits
    from train.metrics import MetricsWriter
    from train.step import TrainProgram

    program = TrainProgram(config, make_mesh(config, jax.devices()[:1]))
    train_data, validation_data = load_splits(config.data)
    workdirs = {seed: workdir / f"seed{seed}" for seed in seeds}
    for seed, directory in workdirs.items():
        text = seed_config(config, seed).to_json_best_effort(indent=2) + "\n"
        (directory / "config.json").write_text(text)

    init = jax.jit(jax.vmap(program._init_state))
    step_fn = jax.jit(jax.vmap(program._step), donate_argnums=0)
    eval_fn = jax.jit(jax.vmap(program._evaluation_loss, in_axes=(0, 0, None)))
    with jax.set_mesh(program.mesh):
        if start:  # every seed's checkpoint of step `start`, stacked on the seed axis
            restored = []
            for seed in seeds:
                with Checkpointer(workdirs[seed], read_only=True) as checkpointer:
                    found = checkpointer.restore_latest(program.abstract_state(), only=start)
                    if found is None:
                        raise rundir.WorkdirError(
                            f"--workdir={workdir}: {workdirs[seed]}'s checkpoint of step {start} "
                            f"does not restore ({checkpointer.restore_errors.get(start)}); it "
                            "is left as is: move that seed's directory aside and rerun")
                restored.append(found[1])
            state = jax.tree.map(lambda *leaves: jnp.stack(leaves), *restored)
        else:
            state = init(jnp.asarray(seeds, jnp.int32))
    streams = [train_data.batches(start, config.batch_size, config.seq_len, seed)
               for seed in seeds]
    validation = [jnp.asarray(validation_data.batch(i, config.batch_size, config.seq_len,
                                                    VALIDATION_SEED))
                  for i in range(config.eval_batches)]

    def evaluate(state) -> np.ndarray:
        with jax.set_mesh(program.mesh):
            losses = [eval_fn(state["params"], state["model_state"], batch)
                      for batch in validation]
        return np.mean(np.asarray(jax.device_get(losses)), axis=0)

    def save(step: int) -> None:
        for i, seed in enumerate(seeds):
            if finite[i]:
                with Checkpointer(workdirs[seed], config.keep_checkpoints) as checkpointer:
                    checkpointer.save(step, jax.tree.map(lambda leaf, i=i: leaf[i], state),
                                      {"next_step": step, "seed": seed, "skipped_steps": 0},
                                      force=True)

    finite = np.ones(len(seeds), bool)
    eval_losses = np.full(len(seeds), np.nan)
    step = start
    with contextlib.ExitStack() as stack:
        preemption = stack.enter_context(_Preemption())
        writers = [stack.enter_context(MetricsWriter(workdirs[seed], resume_step=start))
                   for seed in seeds]
        progress = stack.enter_context(tqdm.tqdm(total=config.steps, initial=start,
                                                 dynamic_ncols=True))
        while step < config.steps and not preemption.requested:
            batch = jnp.asarray(np.stack([next(stream) for stream in streams]))
            with jax.set_mesh(program.mesh):
                state, metrics = step_fn(state, batch)
            step += 1
            records = [{} for _ in seeds]
            if step % config.log_every == 0 or step == config.steps:
                values = jax.device_get(metrics)
                finite &= np.asarray(values["finite"], bool)
                for i, record in enumerate(records):
                    record.update(train_loss=values["loss"][i], grad_norm=values["grad_norm"][i],
                                  learning_rate=values["learning_rate"][i])
            if step % config.eval_every == 0 or step == config.steps:
                eval_losses = evaluate(state)
                for i, record in enumerate(records):
                    record["eval_loss"] = eval_losses[i]
            for i, record in enumerate(records):
                if record and finite[i]:
                    writers[i].write(step, record)
            progress.update(1)
        if preemption.requested:
            if step > start:
                finite &= np.asarray(jax.device_get(metrics)["finite"], bool)
                save(step)
            name = signal.Signals(preemption.signal).name
            raise Stopped(
                f"{name}: " + (f"the checkpoint of step {step} is saved in each of "
                               f"{workdir}/seed<k>; rerun the same command to resume"
                               if step > start else "stopped before the first step; rerun the "
                               "same command to resume"), 128 + preemption.signal)
    if step > start:
        save(step)
    elif np.isnan(eval_losses).all():  # a finished group, run again: its losses
        eval_losses = evaluate(state)
    failed = [seed for i, seed in enumerate(seeds) if not finite[i]]
    if failed:
        print(f"error: seeds {failed} made the state non-finite: not saved", file=sys.stderr)
    return {seed: float(eval_losses[i]) for i, seed in enumerate(seeds) if finite[i]}


def main(argv: list[str]) -> int:
    try:
        config, workdir, seeds = parse(argv)
        check_vocab(config.model, tokenizer_of(config.data))  # vocab_size=0: the tokenizer's
        config = resolve(config, 1)
        check_training(config)
        check_seed_mode(config)
        losses = train_seeds(config, workdir, seeds)  # its directories checked before JAX
    except (ConfigError, UsageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Stopped as stopped:
        print(stopped, file=sys.stderr)
        return stopped.status
    except KeyboardInterrupt:  # before the signal handlers are set: nothing written yet
        print("SIGINT: stopped before the first step; rerun the same command to start",
              file=sys.stderr)
        return 130
    except Exception as error:
        from train.checkpoint import WriteError, failure_reason

        if not isinstance(error, WriteError | OSError):
            raise
        # a checkpoint, metrics.jsonl, config.json
        print(f"error: cannot write the runs in {workdir}: {failure_reason(error)}; rerun the "
              "same command once the directory is writable and has space", file=sys.stderr)
        return 3
    for seed, loss in losses.items():
        print(f"seed {seed}: validation loss at step {config.steps}: {loss:.4f}")
    return 0 if len(losses) == len(seeds) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
