"""Checkpoints: Orbax CheckpointManager, asynchronous saves of train state and data position.

Restoring goes through abstract targets that carry the *current* mesh's NamedShardings, so a
checkpoint written on one mesh restores onto another. When the newest checkpoints fail to
restore (corrupted, partial) and an older one restores, the trainer moves the failed ones aside
to `checkpoints/corrupt-<step>-<time>/` (never deleting them) and continues from the older one;
saving those steps again later works. Readers (analysis, generation) only skip them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)


class Checkpointer:
    """`keep` newest checkpoints are kept; `read_only` opens another run's checkpoints to read
    (nothing is created, saved or rotated there)."""

    def __init__(self, workdir: str | Path, keep: int = 3, *, read_only: bool = False):
        self.directory = Path(workdir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                                 read_only=read_only,
                                                 enable_async_checkpointing=True))
        self.restore_errors: dict[int, str] = {}  # of the last restore_latest: step → error

    def save(self, step: int, state, data_position: dict, *, force: bool = False) -> None:
        """Start an asynchronous save of `state` and the JSON `data_position` at `step`."""
        self.manager.save(step, force=force, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_position)))

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
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=state_args, data=ocp.args.JsonRestore()))
            except Exception as error:  # noqa: BLE001 -- any failure means "not usable"
                reason = str(error).splitlines()[0].split(" See full TensorStore details")[0] \
                    if str(error) else ""
                message = f"{type(error).__name__}: {reason[:200]}" if reason \
                    else type(error).__name__
                self.restore_errors[step] = message
                log.warning("checkpoint at step %d cannot be restored (%s); trying an earlier "
                            "one", step, message)
                continue
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

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
