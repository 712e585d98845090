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
Not in this mode: resuming (an interrupted group starts again; its runs are short), dropout
(its keys come from the config's one seed), several devices, several processes. Equality with
separate runs to float32 tolerance: tests/test_seeds.py. Exit status as `python -m train`'s.
"""

from __future__ import annotations

import sys
from pathlib import Path

from train import hugepages

if __name__ == "__main__":  # first: re-executing repeats the imports below
    hugepages.reexec()  # XLA:CPU's step buffers in huge pages, as python -m train does

from config import ConfigError, resolve
from config.cli import ArgumentParser, UsageError, parse_with_config
from config.validate import check_training
from train.data.tokenizer import check_vocab, tokenizer_of


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
    return config, args.workdir, seeds


def check_seed_mode(config) -> None:
    """What this mode cannot train beyond one device (the config is resolved for one): dropout,
    whose keys come from the config's one seed."""
    from arch import dropout

    if dropout.enabled(config.model):
        raise ConfigError("model.dropout is invalid in train.seeds: dropout keys come from the "
                          "config's one seed; train these seeds separately (python -m train)")


def train_seeds(config, workdir: str | Path, seeds: list[int]) -> dict[int, float]:
    """Train `seeds` of `config` (resolved for one device) into `workdir`/seed<k>; returns
    {seed: final eval loss} of the seeds that stayed finite (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import tqdm

    from sharding.mesh import make_mesh
    from train.checkpoint import Checkpointer
    from train.data.in_memory import VALIDATION_SEED
    from train.loop import load_splits
    from train.metrics import MetricsWriter
    from train.step import TrainProgram

    check_seed_mode(config)
    program = TrainProgram(config, make_mesh(config, jax.devices()[:1]))
    train_data, validation_data = load_splits(config.data)
    workdirs = {seed: Path(workdir) / f"seed{seed}" for seed in seeds}
    for seed, directory in workdirs.items():
        directory.mkdir(parents=True, exist_ok=True)
        seed_config = config.as_configdict()
        seed_config.seed = seed
        (directory / "config.json").write_text(seed_config.to_json_best_effort(indent=2) + "\n")

    init = jax.jit(jax.vmap(program._init_state))
    step_fn = jax.jit(jax.vmap(program._step), donate_argnums=0)
    eval_fn = jax.jit(jax.vmap(program._evaluation_loss, in_axes=(0, 0, None)))
    with jax.set_mesh(program.mesh):
        state = init(jnp.asarray(seeds, jnp.int32))
    streams = [train_data.batches(0, config.batch_size, config.seq_len, seed)
               for seed in seeds]
    validation = [jnp.asarray(validation_data.batch(i, config.batch_size, config.seq_len,
                                                    VALIDATION_SEED))
                  for i in range(config.eval_batches)]

    def evaluate(state) -> np.ndarray:
        with jax.set_mesh(program.mesh):
            losses = [eval_fn(state["params"], state["model_state"], batch)
                      for batch in validation]
        return np.mean(np.asarray(jax.device_get(losses)), axis=0)

    finite = np.ones(len(seeds), bool)
    writers = [MetricsWriter(workdirs[seed]) for seed in seeds]
    eval_losses = np.full(len(seeds), np.nan)
    try:
        for step in tqdm.trange(1, config.steps + 1, dynamic_ncols=True):
            batch = jnp.asarray(np.stack([next(stream) for stream in streams]))
            with jax.set_mesh(program.mesh):
                state, metrics = step_fn(state, batch)
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
    finally:
        for writer in writers:
            writer.close()
    for i, seed in enumerate(seeds):
        if finite[i]:
            with Checkpointer(workdirs[seed], config.keep_checkpoints) as checkpointer:
                checkpointer.save(config.steps, jax.tree.map(lambda leaf, i=i: leaf[i], state),
                                  {"next_step": config.steps, "seed": seed, "skipped_steps": 0},
                                  force=True)
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
    except (ConfigError, UsageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.checkpoint import WriteError, failure_reason

    try:
        losses = train_seeds(config, workdir, seeds)
    except (WriteError, OSError) as error:  # a checkpoint, metrics.jsonl, config.json
        print(f"error: cannot write the runs in {workdir}: {failure_reason(error)}; rerun the "
              "same command once the directory is writable and has space (the seeds start "
              "again)", file=sys.stderr)
        return 3
    for seed, loss in losses.items():
        print(f"seed {seed}: validation loss at step {config.steps}: {loss:.4f}")
    return 0 if len(losses) == len(seeds) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
