"""Checkpoints: Orbax CheckpointManager, asynchronous saves of train state and data position.

Restoring goes through abstract targets that carry the *current* mesh's NamedShardings, so a
checkpoint written on one mesh restores onto another. When the newest checkpoints fail to
restore (corrupted, partial) and an older one restores, the trainer moves the failed ones aside
to `checkpoints/corrupt-<step>-<time>/` (never deleting them) and continues from the older one;
saving those steps again later works. Readers (analysis, generation) only skip them. Orbax
does not check an array chunk's bytes, so each save records the state's fingerprints
(`fingerprints`) in its JSON item and a restore recomputes them: a flipped bit is a checkpoint
that does not restore. With several processes, every process falls back together.

A save that cannot complete (no space, a read-only or missing directory) is a `WriteError` at
that save, not one save later: the step's directory is created before `save` returns, and the
trainer polls the background write every step (`check`). Orbax writes each step into
`<step>.orbax-checkpoint-tmp` and renames it on commit, so a failed save is never a step a
resume picks; the newest complete checkpoint is named in the error. Orbax's own error records
and the callbacks its failed writes leave on closed event loops are kept off the terminal: the
failure reaches the caller as that one exception.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from sharding.mesh import any_process
from train.rundir import WorkdirError

log = logging.getLogger(__name__)


class WriteError(RuntimeError):
    """A checkpoint or a run file could not be written (exit status 3): one line naming the path,
    the error and the newest complete checkpoint, which a rerun resumes from."""


def failure_reason(error: BaseException) -> str:
    """The system's words for a failed write ("No space left on device") where the error, or
    one it came from, carries an OS error (TensorStore's `os_error_code='28'` included), else
    its first line."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        if code := re.search(r"os_error_code='?(\d+)", str(seen)):
            return os.strerror(int(code[1]))
        seen = seen.__cause__ or seen.__context__
    return str(error).splitlines()[0][:200] if str(error) else type(error).__name__


class _OrbaxErrors(logging.Filter):
    """Drops Orbax's error records (and their tracebacks), and asyncio's reports of Orbax tasks
    or TensorStore futures whose exception nobody retrieved: each failure they describe reaches
    the caller as one exception (a `WriteError`, a restore error). TensorStore's errors are set
    from C++, without Python frames; they name their `tensorstore_spec`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        orbax = f"{os.sep}orbax{os.sep}"
        error = record.exc_info[1] if record.exc_info else None
        frames = traceback.extract_tb(error.__traceback__) if error is not None else []
        return (orbax not in record.pathname and not any(orbax in f.filename for f in frames)
                and "tensorstore_spec=" not in str(error or ""))


def _quiet_closed_loops(unraisable) -> None:
    """`sys.unraisablehook` that drops what Orbax's abandoned work leaves at exit: "Event loop
    is closed" from TensorStore callbacks that outlive a failed write, and the errors of its
    reads still pending when a restore failed (coroutines of Orbax's code collected unawaited,
    each with a TensorStore spec of dozens of lines); the failure they belong to reached the
    caller as one error. Everything else is passed on."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return
    orbax = f"{os.sep}orbax{os.sep}"
    frames = traceback.extract_tb(error.__traceback__) if error is not None else []
    if any(orbax in frame.filename for frame in frames) or "TensorStore" in str(error):
        return
    sys.__unraisablehook__(unraisable)


for _logger in ("absl", "asyncio"):  # absl.logging, which Orbax logs through; its event loops
    logging.getLogger(_logger).addFilter(_OrbaxErrors())
if sys.unraisablehook is sys.__unraisablehook__:
    sys.unraisablehook = _quiet_closed_loops


FINGERPRINTS = "fingerprints"  # the key of the state's fingerprints in a checkpoint's JSON item


def _words(leaf: jax.Array) -> jax.Array:
    """A leaf's values as uint32 words, one per element, injectively: integers (int4 included)
    and booleans converted modulo 2³², floats' bits (narrower ones widened; sub-byte floats
    through float32, which holds them exactly)."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return leaf.astype(jnp.uint32)
    if jnp.finfo(leaf.dtype).bits < 8:
        leaf = leaf.astype(jnp.float32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[leaf.dtype.itemsize]
    return jax.lax.bitcast_convert_type(leaf, unsigned).astype(jnp.uint32)


@jax.jit
def _fingerprint_leaves(leaves: list[jax.Array]) -> list[jax.Array]:
    def one(leaf):
        words = _words(leaf).ravel()
        return jnp.sum(words * (2 * jnp.arange(words.size, dtype=jnp.uint32) + 1),
                       dtype=jnp.uint32)
    return [one(leaf) for leaf in leaves]


def fingerprints(state) -> dict[str, int]:
    """{leaf path: Σ_i w_i·(2i + 1) mod 2³²} of `state`, w_i its i-th element's bytes as a
    uint32 word: a flipped bit changes w_i by ±2^k, so the sum by an odd multiple of 2^k, never
    0 mod 2³². Integer arithmetic, so any sharding gives the same sums. Cost: one pass over the
    state, on its devices."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(state)[0], strict=True)
    sums = jax.device_get(_fingerprint_leaves(list(leaves)))
    return {jax.tree_util.keystr(path): int(value) for path, value in zip(paths, sums,
                                                                          strict=True)}


def check_fingerprints(state, saved: dict[str, int] | None) -> None:
    """ValueError naming the first leaf of `state` whose fingerprint differs from `saved` (the
    checkpoint's; None for a checkpoint saved without them: nothing to check). A partial
    restore checks the leaves it read."""
    if saved is None:
        return
    for path, value in fingerprints(state).items():
        if path in saved and saved[path] != value:
            raise ValueError(f"the bytes of {path} changed since the checkpoint was saved "
                             "(its fingerprint differs)")


def _restore_error(error: BaseException) -> str:
    """A failed restore in one line: the error's type and its first line."""
    reason = str(error).splitlines()[0].split(" See full TensorStore details")[0] \
        if str(error) else ""
    return f"{type(error).__name__}: {reason[:200]}" if reason else type(error).__name__


class Checkpointer:
    """`keep` newest checkpoints are kept; `read_only` opens another run's checkpoints to read
    (nothing is created, saved or rotated there)."""

    def __init__(self, workdir: str | Path, keep: int = 3, *, read_only: bool = False):
        self.directory = Path(workdir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=not read_only, read_only=read_only,
                enable_async_checkpointing=True,
                # the step's directory is made in `save`, so a directory that cannot be made
                # fails there (made in the background, it fails after a 300 s signal timeout)
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False)))
        self.restore_errors: dict[int, str] = {}  # of the last restore_latest: step → error
        self.saving: int | None = None  # the step of the save in flight
        self.failed = False  # a save failed (and was reported)

    def save(self, step: int, state, data_position: dict, *, force: bool = False) -> None:
        """Start an asynchronous save of `state` and the JSON `data_position` at `step`, once
        the previous one completed; `WriteError` if that one or this one's start failed."""
        self.wait()
        self.saving = step
        data_position = {**data_position, FINGERPRINTS: fingerprints(state)}
        try:
            self.manager.save(step, force=force, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_position)))
        except Exception as error:  # noqa: BLE001 -- whatever stops a save is a failed write
            raise self._write_error(error) from None

    def check(self) -> None:
        """`WriteError` if the save in flight failed; returns at once while it is writing."""
        if self.saving is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight; `WriteError` if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 -- raised by the background write
            raise self._write_error(error) from None
        self.saving = None

    def _write_error(self, error: Exception) -> WriteError:
        step, self.saving, self.failed = self.saving, None, True
        # The failed save's other writes, which Orbax made and never awaited, are reported
        # when collected (at exit): the one error says what failed.
        warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
        latest = self.manager.latest_step()
        kept = ("no checkpoint is complete yet; rerun the same command to start again" if latest
                is None else f"the newest complete checkpoint, step {latest}, is kept; rerun "
                "the same command to resume from it")
        return WriteError(f"cannot write the checkpoint of step {step} to "
                          f"{self.directory / str(step)}: {failure_reason(error)}; {kept} once the "
                          "directory is writable and has space")

    def write_error(self, path: Path, error: OSError) -> WriteError:
        """The `WriteError` of a run file at `path` that failed to write (`error`), naming the
        newest complete checkpoint (after the save in flight)."""
        self.wait()
        latest = self.latest_step()
        kept = ("no checkpoint is complete yet" if latest is None else
                f"the newest complete checkpoint, step {latest}, is kept in {self.directory}")
        return WriteError(f"cannot write {path}: {failure_reason(error)}; {kept}; rerun the same "
                          "command once the directory is writable and has space")

    def check_space(self, abstract_state) -> None:
        """`WorkdirError` unless the checkpoints' filesystem has room for one checkpoint of
        `abstract_state` (the bytes of its leaves)."""
        needed = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_state))
        existing = self.directory
        while not existing.exists():
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        if free < needed:
            raise WorkdirError(
                f"--workdir={self.directory.parent}: its filesystem has {free / 2**20:.1f} MiB "
                f"free, less than one checkpoint of this run ({needed / 2**20:.1f} MiB: the "
                "parameters and optimizer state); free space there or use another --workdir")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, abstract_state, *, move_aside_corrupt: bool = False,
                       partial: bool = False, only: int | None = None):
        """(step, state, data_position) of the newest checkpoint that restores, or None (the
        errors are in `restore_errors`). With `move_aside_corrupt`, the newer checkpoints that
        failed are moved to `corrupt-<step>-<time>/` when an older one restores (by process 0;
        every process then rescans the directory). With `partial`, `abstract_state` may name a
        subset of the saved entries (e.g. no optimizer state), and only those are read. With
        `only`, only the checkpoint of that step is tried."""
        self.manager.wait_until_finished()
        self.restore_errors = {}
        if partial:
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
            state_args = ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args,
                                                partial_restore=True)
        else:
            state_args = ocp.args.StandardRestore(abstract_state)
        steps = sorted(self.manager.all_steps(), reverse=True)
        if only is not None:
            steps = [only] if only in steps else []
        for step in steps:
            error = None
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=state_args, data=ocp.args.JsonRestore()))
                check_fingerprints(restored["state"], restored["data"].pop(FINGERPRINTS, None))
            except Exception as raised:  # noqa: BLE001 -- any failure means "not usable"
                error = raised
            if any_process(error is not None):  # every process falls back together
                message = _restore_error(error) if error is not None else \
                    "another process of this job could not restore it"
                self.restore_errors[step] = message
                continue
            for failed, message in self.restore_errors.items():  # none restores: the caller's
                log.warning("checkpoint at step %d cannot be restored (%s); trying an earlier "
                            "one", failed, message)
            if move_aside_corrupt and self.restore_errors:
                self._move_aside(sorted(self.restore_errors))
            return step, restored["state"], restored["data"]
        return None

    def _move_aside(self, steps: list[int]) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        if jax.process_index() == 0:
            for step in steps:
                target = self.directory / f"corrupt-{step}-{stamp}"
                (self.directory / str(step)).rename(target)
                log.warning("moved the checkpoint at step %d, which does not restore, to %s",
                            step, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("blockbench: corrupt checkpoints moved aside")
        self.manager.reload()

    def close(self) -> None:
        """Finish the save in flight (`WriteError` if it failed) and close."""
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 -- Orbax raising a failed write again
                if not self.failed:
                    raise

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
