"""Run outputs: metrics.jsonl, TensorBoard event files (tensorboardX, no TensorFlow), and the
measured matmul peak used for MFU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from tensorboardX import SummaryWriter


class MetricsWriter:
    """Appends one JSON object per logged step to <workdir>/metrics.jsonl and mirrors scalars
    to TensorBoard. Only process 0 writes."""

    def __init__(self, workdir: str | Path):
        self.enabled = jax.process_index() == 0
        if self.enabled:
            self.path = Path(workdir) / "metrics.jsonl"
            self.tensorboard = SummaryWriter(str(Path(workdir) / "tensorboard"))

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


def measure_matmul_peak(size: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
    """Measured FLOP/s of one device on a square matmul chain (best of `repeats`).

    A same-run baseline for MFU: an absolute peak from a datasheet holds on no shared CPU.
    """
    x = jnp.ones((size, size), dtype)

    @jax.jit
    def chain(a):
        for _ in range(8):
            a = (a @ x) * (1.0 / size)
        return a

    chain(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        chain(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 8 * 2 * size**3 / best
