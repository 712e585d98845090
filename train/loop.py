"""The training loop: data → sharded steps → metrics, evaluation, checkpoints → a sample.

Nothing is lost on a crash or preemption: checkpoints are saved asynchronously every
`checkpoint_every` steps, on SIGTERM and SIGINT (Ctrl-C), and before a data error stops the run;
re-running with the same workdir resumes from the newest checkpoint that restores. A checkpoint
or metrics.jsonl that cannot be written stops the run at once with one line (`WriteError`).
Batches are a pure function of (seed, step), so a resumed or re-sharded run sees exactly the
batches an uninterrupted one would. A non-finite loss stops the run before anything bad is
saved: every step checks the loss, the gradients and the whole new state for finiteness inside
the jitted step, and a checkpoint is saved only after its step passed.
The workdir lock, config identity on resume and the checkpoint fallback are in docs/runs.md.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax.experimental import multihost_utils

from arch.accounting import flops_per_token
from config import ConfigError
from config.validate import check_training
from sharding.mesh import any_process, any_process_flags
from sharding.pipeline import bubble_fraction
from train import rundir
from train.checkpoint import Checkpointer
from train.data import in_memory, shards
from train.data.in_memory import VALIDATION_SEED
from train.metrics import MetricsWriter, measure_matmul_peak
from train.sampling import generate_text
from train.step import TrainProgram, build_program

log = logging.getLogger(__name__)


class NonFiniteLoss(RuntimeError):
    """A step made the loss, the gradients or the train state non-finite (exit status 1)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) stopped the run after it saved the current step (exit status 130)."""


def load_splits(data_config) -> tuple[in_memory.Dataset, in_memory.Dataset]:
    """(train, validation) datasets. Every process reads the whole token stream (memory-mapped
    for tfds datasets), or opens the shards of a prepared directory (`train.data.shards`), and later
    takes only its rows of each batch. Of several processes, process 0 loads first, preparing
    the corpus if needed, and the others after a barrier: on a shared data_dir they find it
    prepared; on per-host disks each host prepares its own copy (one process per host, as the
    launchers in scripts/ start, so no two prepare one directory at once)."""
    def load():
        return (shards.load_split(data_config, "train"),
                shards.load_split(data_config, "validation"))

    if jax.process_count() == 1:
        return load()
    splits, error = None, None
    if jax.process_index() == 0:
        try:
            splits = load()
        except ValueError as raised:  # still meet the others at the barrier, then report it
            error = raised
    multihost_utils.sync_global_devices("blockbench: process 0 prepared the data")
    if error is not None:
        raise error
    return splits if splits is not None else load()


def evaluate(program: TrainProgram, state, dataset: in_memory.Dataset, *,
             ema: bool = False) -> float:
    """Mean evaluation loss over `eval_batches` validation batches; with `ema`, of the state's
    EMA parameters."""
    config, rows = program.config, program.process_rows()
    losses = [program.eval_loss(state, program.put_batch(
        dataset.batch(i, config.batch_size, config.seq_len, VALIDATION_SEED, rows)), ema=ema)
        for i in range(config.eval_batches)]
    return float(np.mean(jax.device_get(losses)))


def _check_finite(step: int, metrics, checkpointer: Checkpointer) -> None:
    """Raise NonFiniteLoss if step `step` made the loss, the gradients or the state non-finite
    (metrics["finite"], computed inside the step): that state is never saved."""
    if bool(metrics["finite"]):
        return
    loss, grad_norm = (float(metrics["loss"]), float(metrics["grad_norm"]))
    checkpointer.wait()
    kept = checkpointer.latest_step()
    raise NonFiniteLoss(
        f"non-finite {'loss or gradients' if not math.isfinite(loss + grad_norm) else 'state'}"
        f" at step {step} (loss={loss}, grad_norm={grad_norm}): stopping without saving it; the "
        f"last finite checkpoint ({'none' if kept is None else f'step {kept}'}) is kept in "
        f"{checkpointer.directory}; lower optimizer.learning_rate, or set "
        "nonfinite_policy='skip' to skip such steps")


def _check_splits(config, splits) -> None:
    """A one-line ConfigError for a split too short for one window (e.g. an empty file)."""
    for dataset in splits:
        if dataset.num_windows(config.seq_len) == 0:
            source = (f"data.path={config.data.path!r}" if config.data.name == "text"
                      else f"data.name={config.data.name!r}")
            raise ConfigError(
                f"{source} is invalid: its {dataset.split} split holds {len(dataset.tokens)} "
                f"tokens, too few for one window of seq_len + 1 = {config.seq_len + 1}; add "
                "data or lower seq_len")


def _start_state(program: TrainProgram, config, checkpointer: Checkpointer, workdir: Path):
    """(step, state, data position) to start from: the newest checkpoint of this run that
    restores (newer ones that do not are moved aside), else a fine-tune's source weights, else
    a fresh initialization. WorkdirError when checkpoints exist but none restores."""
    restored = checkpointer.restore_latest(program.abstract_state(), move_aside_corrupt=True)
    if restored is not None:
        step, state, position = restored
        log.warning("resuming from the checkpoint at step %d in %s", step, checkpointer.directory)
        return step, state, position
    if checkpointer.restore_errors:
        newest = max(checkpointer.restore_errors)
        raise rundir.WorkdirError(
            f"--workdir={workdir}: no checkpoint restores (step {newest}: "
            f"{checkpointer.restore_errors[newest]}); nothing was moved or deleted: use a new "
            "--workdir, or move its checkpoints directory aside to start again")
    state = program.init(config.seed)
    if config.resume_mode == "finetune":
        source_config = rundir.saved_config(config.finetune_from, {})
        source_ema = (None if source_config is None else
                      source_config.get("optimizer", {}).get("ema_decay", 0) > 0)
        with Checkpointer(config.finetune_from, read_only=True) as source:
            from_source = source.restore_latest(program.abstract_state(ema=source_ema))
            errors = source.restore_errors
        if from_source is None:
            reason = (f"step {max(errors)}: {errors[max(errors)]}" if errors
                      else "it holds no checkpoint")
            raise ConfigError(
                f"finetune_from={config.finetune_from!r} is invalid: no checkpoint there "
                f"restores into this config's state ({reason}); the model and optimizer "
                "structure must match")
        source_step, source_state, _ = from_source
        state["params"], state["model_state"] = (source_state["params"],
                                                 source_state["model_state"])
        if program.uses_ema:  # a new run: its EMA starts at its initial parameters
            state["ema"] = jax.tree.map(jnp.copy, state["params"])
        log.warning("fine-tuning from the weights of %s at step %d (fresh optimizer state, "
                    "step 0)", config.finetune_from, source_step)
    return 0, state, {"next_step": 0, "seed": config.seed, "skipped_steps": 0}


class _Preemption:
    """Turns SIGTERM and SIGINT into a flag (`signal`, the first received) that the loop checks
    between steps; the run then saves its current step and stops."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signal: int | None = None

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def __enter__(self):
        self.previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.signal = self.signal or signum

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def train(config, workdir: str | Path, *, checked: bool = False) -> dict:
    """Train the resolved `config` (`config.resolve`, or `train.step.resolve_for_job`) in
    `workdir`, resuming if it holds checkpoints of the same run.

    First the checks of a training run (`config.validate.check_training`: data, final sample)
    and of its run directory (writable; the same config as its checkpoints', one-line
    `ConfigError` if not), unless the caller made them (`checked`: the CLI does, before JAX
    loads). Holds the workdir lock for the whole run. Returns {"step", "eval_loss", "sample",
    "preempted"}, and "eval_loss_ema" with optimizer.ema_decay > 0; "preempted" after SIGTERM,
    once the current step is saved. Raises `Interrupted` (a KeyboardInterrupt) after SIGINT,
    once the current step is saved; `NonFiniteLoss` (with nonfinite_policy="stop") when a step
    makes the loss or state non-finite (that state is never saved); `WriteError` when a
    checkpoint or metrics.jsonl cannot be written; a data error after saving the last good state.
    """
    workdir = Path(workdir)
    program = build_program(config)
    if not checked:
        check_training(config)
        rundir.check_workdir(workdir)
    workdir.mkdir(parents=True, exist_ok=True)  # on every host (per-host disks)
    with contextlib.ExitStack() as run:
        refused = None
        if jax.process_index() == 0:  # one lock per run, also on a shared filesystem
            try:
                run.enter_context(rundir.WorkdirLock(workdir))
                if not checked:
                    rundir.check_resume(workdir, config, resolved=True)
            except ConfigError as error:
                refused = error
        if any_process(refused is not None):  # the others stop with it, not at a collective
            if refused is None:  # after it: the line that says why comes first
                time.sleep(3)
            raise refused or rundir.WorkdirError(
                f"--workdir={workdir}: process 0 of this job refused it (its line says why)")
        return _train_locked(program, config, workdir)


def _train_locked(program: TrainProgram, config, workdir: Path) -> dict:
    try:
        train_data, validation_data = load_splits(config.data)
    except ValueError as error:  # data errors name their field: report them like config errors
        raise ConfigError(str(error)) from None
    _check_splits(config, (train_data, validation_data))
    skip_nonfinite = config.nonfinite_policy == "skip"
    with contextlib.ExitStack() as stack:  # closes (and finishes saving) on any exit
        preemption = stack.enter_context(_Preemption())  # until the last save is written
        checkpointer = stack.enter_context(Checkpointer(workdir, config.keep_checkpoints))
        checkpointer.check_space(program.abstract_state())
        step, state, position = _start_state(program, config, checkpointer, workdir)
        if position["seed"] != config.seed:  # the batch order is a function of (seed, step)
            raise ConfigError(
                f"seed={config.seed} is invalid: {checkpointer.directory} was trained with "
                f"seed={position['seed']}; resume with that seed or use a new --workdir")
        if jax.process_index() == 0:
            (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
        writer = stack.enter_context(MetricsWriter(workdir, resume_step=step))
        skipped = jnp.int32(position.get("skipped_steps", 0))  # on device: no sync per step
        progress = stack.enter_context(tqdm.tqdm(
            total=config.steps, initial=step, disable=jax.process_index() != 0,
            dynamic_ncols=True))
        tokens_per_step = config.batch_size * config.seq_len
        model_flops = flops_per_token(config.model, config.seq_len) * tokens_per_step
        peak_flops = measure_matmul_peak() * jax.device_count()
        static = {}  # facts of the run's layout, logged with every record
        if program.mesh.shape["stage"] > 1:  # idle share of each device's pipeline iterations
            static["pipeline_bubble_fraction"] = bubble_fraction(
                program.mesh.shape["stage"], config.execution.pipeline.virtual_stages,
                config.execution.pipeline.microbatches)
        rows = program.process_rows()
        if jax.process_count() > 1:  # what each process reads (tests/test_multiprocess.py)
            log.warning("process %d of %d loads rows %s of each batch of %d",
                        jax.process_index(), jax.process_count(), rows.tolist(),
                        config.batch_size)
        previous = None  # (step, metrics) of the last step, checked a step late: no sync per step
        first_step = timer_step = step
        timer = time.perf_counter()
        eval_loss = eval_loss_ema = float("nan")
        batches = train_data.batches(step, config.batch_size, config.seq_len, config.seed, rows,
                                     prefetch=config.data.get("prefetch", 4),
                                     read_threads=config.data.get("read_threads", 2))
        saved = step  # the newest step saved or restored

        def save():
            if not skip_nonfinite:  # a state that is not finite is never saved
                _check_finite(step, metrics, checkpointer)
            checkpointer.save(step, state, {"next_step": step, "seed": config.seed,
                                            "skipped_steps": int(skipped)}, force=True)

        def fetch():
            """(the next step's batch, None), or (None, the error reading it)."""
            if step >= config.steps:
                return None, None
            try:
                return next(batches), None
            except Exception as error:  # noqa: BLE001 -- reported after the agreement
                return None, error

        def data_failed(error) -> None:
            """Every process: raise the data error of whichever process had one (its own
            error where it was this one's), after the last good step was saved together."""
            if error is not None:
                raise error
            if jax.process_count() > 1:  # the process that failed leaves first, and is named
                time.sleep(3)
            raise rundir.WorkdirError(
                f"another process of this job could not read its data for step {step + 1} "
                f"(its line says why); the state of step {saved} is saved: fix the data and "
                "rerun the job to resume")

        batch, data_error = fetch()  # fetched a step ahead: the processes agree on a failure
        failed = any_process(data_error is not None)  # (and a signal) in one collective
        stopping = False  # a signal reached some process: every process stops at one step
        while step < config.steps and not stopping:
            if failed:  # a data error on some process: the last good state is saved
                data_failed(data_error)
            checkpointer.check()  # a save that failed stops the run now
            state, metrics = program.train_step(state, program.put_batch(batch))
            step += 1
            if skip_nonfinite:
                skipped = skipped + metrics["skipped"]
            elif previous is not None:
                _check_finite(*previous, checkpointer)
            previous = (step, metrics)
            if step == first_step + 1 and step % config.log_every:
                jax.block_until_ready(metrics)  # keep compilation out of the first throughput
                timer_step, timer = step, time.perf_counter()
            record = {}
            if step % config.log_every == 0 or step == config.steps:
                if not skip_nonfinite:
                    _check_finite(step, metrics, checkpointer)
                elapsed, timer = time.perf_counter() - timer, time.perf_counter()
                throughput = (step - timer_step) * tokens_per_step / max(elapsed, 1e-9)
                timer_step = step
                record = {"train_loss": float(metrics["loss"]),
                          "grad_norm": float(metrics["grad_norm"]),
                          "learning_rate": float(metrics["learning_rate"]),
                          "tokens_per_sec": throughput,
                          "mfu": throughput / tokens_per_step * model_flops / peak_flops,
                          **static,
                          **({"skipped_steps": int(skipped)} if skip_nonfinite else {}),
                          **{k: float(metrics[k]) for k in metrics
                             if k in ("aux_loss", "moe_dropped_fraction", "distill_kl",
                                      "next_token_loss") or k.startswith("mtp_loss")}}
                progress.set_postfix(loss=f"{record['train_loss']:.3f}",
                                     tok_s=f"{throughput:,.0f}", mfu=f"{record['mfu']:.1%}")
            if step % config.eval_every == 0 or step == config.steps:
                eval_loss = record["eval_loss"] = evaluate(program, state, validation_data)
                progress.write(f"step {step}: eval_loss {eval_loss:.4f}")
                if program.uses_ema:
                    eval_loss_ema = record["eval_loss_ema"] = evaluate(
                        program, state, validation_data, ema=True)
                    progress.write(f"step {step}: eval_loss_ema {eval_loss_ema:.4f}")
            if record:
                try:
                    writer.write(step, record)
                except OSError as error:
                    raise checkpointer.write_error(writer.path, error) from None
            progress.update(1)
            batch, data_error = fetch()
            agreed = any_process_flags(int(preemption.requested) | (data_error is not None) << 1)
            stopping, failed = bool(agreed & 1), bool(agreed & 2)
            if step % config.checkpoint_every == 0 or step == config.steps or stopping or \
                    failed:  # a data error: keep the last good state, then report it
                save()
                saved = step
        if failed:
            data_failed(data_error)
    preempted = stopping
    if preempted:  # the ExitStack finished writing the checkpoint
        line = (f"{signal.Signals(preemption.signal or signal.SIGTERM).name}: "
                + (f"the checkpoint of step {step} is saved in {workdir / 'checkpoints'}; rerun "
                   "the same command to resume" if step else "stopped before the first step"))
        if preemption.signal == signal.SIGINT:
            raise Interrupted(line)
        log.warning(line)
    if math.isnan(eval_loss) and not preempted:
        eval_loss = evaluate(program, state, validation_data)
        if program.uses_ema:
            eval_loss_ema = evaluate(program, state, validation_data, ema=True)
    sample = ""
    if config.sample_tokens and not preempted:
        sample = generate_text(program, state, config.sample_prompt,
                               config.sample_tokens, temperature=config.temperature,
                               top_k=config.top_k, seed=config.seed)
    result = {"step": step, "eval_loss": eval_loss, "sample": sample, "preempted": preempted}
    if program.uses_ema:
        result["eval_loss_ema"] = eval_loss_ema
    return result
