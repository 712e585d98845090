"""Run outputs: metrics.jsonl, TensorBoard event files (tensorboardX, no TensorFlow, imported
when a writer opens), and the measured matmul peak used for MFU."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from train.rundir import truncate_metrics


def _summary_writer() -> type:
    """tensorboardX's `SummaryWriter`, imported when a run writes, without PyTorch: where torch
    is installed (the tests' oracle), tensorboardX imports it only to accept its tensors, which
    these scalars never are, and that import is about 2 s of every run's start."""
    unloaded = "torch" not in sys.modules
    if unloaded:
        sys.modules["torch"] = None  # tensorboardX's optional `import torch` fails, and is skipped
    try:
        from tensorboardX import SummaryWriter
    finally:
        if unloaded:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends one JSON object per logged step to <workdir>/metrics.jsonl and mirrors scalars
    to TensorBoard. Only process 0 writes.

    A run resuming from the checkpoint at `resume_step` replays the steps after it, so those
    records are dropped from metrics.jsonl first (each step is logged once), and TensorBoard
    opens a new event file with `purge_step=resume_step + 1`: TensorBoard discards the older
    files' events at steps ≥ that."""

    def __init__(self, workdir: str | Path, resume_step: int = 0):
        self.enabled = jax.process_index() == 0
        if self.enabled:
            self.path = Path(workdir) / "metrics.jsonl"
            truncate_metrics(self.path, resume_step)
            tensorboard = Path(workdir) / "tensorboard"
            purge_step = resume_step + 1 if tensorboard.exists() else None
            self.tensorboard = _summary_writer()(str(tensorboard), purge_step=purge_step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for name, value in metrics.items():
            self.tensorboard.add_scalar(name, float(value), int(step))
        self.tensorboard.flush()

    def close(self) -> None:
        if self.enabled:
            self.tensorboard.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@functools.cache
def measure_matmul_peak(size: int = 1024, dtype=jnp.float32, repeats: int = 3,
                        chain_length: int = 4) -> float:
    """Measured FLOP/s of one device on a chain of square matmuls (best of `repeats`), once per
    process. Cost: (repeats + 1) · chain_length · 2·size³ FLOPs (34 GFLOP by default).

    A same-run baseline for MFU: an absolute peak from a datasheet holds on no shared CPU.
    """
    x = jnp.ones((size, size), dtype)

    @jax.jit
    def chain(a):
        for _ in range(chain_length):
            a = (a @ x) * (1.0 / size)
        return a

    chain(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        chain(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return chain_length * 2 * size**3 / best
