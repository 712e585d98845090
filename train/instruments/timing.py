"""Timing by interleaved rounds: the programs being compared run in alternating blocks (ABBA),
and a ratio of step times is the median over rounds of the per-round ratio of medians, so that
drifts in the machine's speed (which last minutes on a shared CPU) cancel within a round. The
method and why: docs/performance.md#method-paired-abba-ratios."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable


def time_interleaved(runners: dict[str, Callable[[], None]], steps: int,
                     block: int) -> dict[str, list[float]]:
    """Per-step seconds of each runner: two warm-up steps each, then alternating blocks."""
    for run in runners.values():
        run(), run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for i in range(math.ceil(steps / block)):
        for name in names if i % 2 == 0 else names[::-1]:  # ABBA: neither always goes first
            for _ in range(min(block, steps - i * block)):
                start = time.perf_counter()
                runners[name]()
                times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(times: dict[str, list[float]], label: str, other: str, block: int) -> float:
    """`label`'s step time over `other`'s from `time_interleaved`'s samples: the median over the
    rounds of blocks of `block` steps of the ratio of their medians within the round."""
    return statistics.median(
        statistics.median(times[label][i:i + block]) / statistics.median(times[other][i:i + block])
        for i in range(0, len(times[label]), block))
