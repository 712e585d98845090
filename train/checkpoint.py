"""Checkpoints: Orbax CheckpointManager, asynchronous saves of train state and data position.

Restoring goes through abstract targets that carry the *current* mesh's NamedShardings, so a
checkpoint written on one mesh restores onto another. A latest checkpoint that fails to restore
(corrupted, partial) is skipped with a warning in favour of the previous one.
"""

from __future__ import annotations

import logging
from pathlib import Path

import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, workdir: str | Path, keep: int = 3):
        self.directory = Path(workdir).absolute() / "checkpoints"
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=True))

    def save(self, step: int, state, data_position: dict, *, force: bool = False) -> None:
        """Start an asynchronous save of `state` and the JSON `data_position` at `step`."""
        self.manager.save(step, force=force, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_position)))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore_latest(self, abstract_state):
        """(step, state, data_position) of the newest checkpoint that restores, or None."""
        self.manager.wait_until_finished()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
            except Exception as error:  # noqa: BLE001 -- any failure means "not usable"
                log.warning("checkpoint at step %d cannot be restored (%s: %s); trying an "
                            "earlier one", step, type(error).__name__, str(error)[:200])
                continue
            return step, restored["state"], restored["data"]
        return None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
