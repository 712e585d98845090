"""The statistics of a study report, in numpy (and scipy's t distribution): mean ± sample std
over seeds, paired differences to the baseline over shared seeds with a paired t-test, a power
law of loss against compute, and the compute multiplier at matched loss with a bootstrap
interval over seeds.

The power law is the plain L = a·C^(−b), fitted by least squares on log L against log C (no
irreducible term: over the one or two decades of compute a study spans, it is a straight line
on log-log axes). The compute multiplier of an arm at compute C is how much more compute the
baseline needs to reach the arm's loss at C: M(C) = C_baseline(L_arm(C)) / C, with
C_baseline(L) = (a_baseline / L)^(1/b_baseline); M > 1 means the arm is worth more compute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    """(mean, sample standard deviation (ddof=1), n) of `values`; the std is nan for n < 2 and
    both are nan for n = 0."""
    array = np.asarray(values, dtype=float)
    n = array.size
    mean = float(array.mean()) if n else math.nan
    std = float(array.std(ddof=1)) if n > 1 else math.nan
    return mean, std, n


def paired_difference(arm: Mapping[int, float],
                      baseline: Mapping[int, float]) -> tuple[float, float, int]:
    """`mean_std` of arm − baseline over the seeds both have (seed → final loss maps): seed k of
    every arm sees the same batches, so the pairing removes the data-order noise they share."""
    shared = sorted(arm.keys() & baseline.keys())
    return mean_std([arm[seed] - baseline[seed] for seed in shared])


def agreeing_seeds(arm: Mapping[int, float], reference: Mapping[int, float],
                   relation: str) -> int:
    """How many of the seeds both have show arm − reference with the sign of `relation`
    ("<": negative, the arm's loss lower; ">": positive)."""
    sign = -1.0 if relation == "<" else 1.0
    return sum(sign * (arm[seed] - reference[seed]) > 0
               for seed in arm.keys() & reference.keys())


def paired_p(mean: float, std: float, n: int) -> float:
    """Two-sided p-value of a paired t-test that the differences (mean, sample std, n) have mean
    zero: t = mean / (std/√n) on n − 1 degrees of freedom (nan for n < 2). With three seeds the
    mean must be 4.30 standard errors from zero for p < 0.05 (12.7 with two)."""
    if n < 2 or (mean == 0 and std == 0):
        return math.nan
    t = math.inf if std == 0 else abs(mean) / (std / math.sqrt(n))
    return float(2 * stats.t.sf(t, n - 1))


def claim_verdict(mean: float, std: float, n: int, relation: str) -> str:
    """The reading of a paired difference (mean, std, n) of arm − reference against a claimed
    sign ("<" negative, ">" positive): "agrees" or "disagrees" when the paired t-test rejects a
    zero mean at the 5% level (`paired_p` < 0.05), on the claimed side or the other; otherwise
    "unresolved, leans agree" (or "disagree") by the side of the mean; one seed "one seed,
    leans ..."; no seeds "no shared seeds"."""
    if n == 0:
        return "no shared seeds"
    agree = mean < 0 if relation == "<" else mean > 0
    lean = "leans agree" if agree else "leans disagree"
    if n == 1:
        return f"one seed, {lean}"
    if paired_p(mean, std, n) < 0.05:
        return "agrees" if agree else "disagrees"
    return f"unresolved, {lean}"


@dataclasses.dataclass(frozen=True)
class PowerLaw:
    """L(C) = a·C^(−b)."""

    a: float
    b: float

    def loss(self, compute: float) -> float:
        """The loss at `compute`."""
        return self.a * compute ** -self.b

    def compute(self, loss: float) -> float:
        """The compute at which the law reaches `loss` (nan unless b > 0 and loss > 0)."""
        if self.b <= 0 or loss <= 0:
            return math.nan
        return (self.a / loss) ** (1 / self.b)


def fit_power_law(compute: Sequence[float], loss: Sequence[float]) -> PowerLaw:
    """The least-squares fit of log L = log a − b·log C to the points (compute, loss); ValueError
    unless they are positive and span at least two compute values."""
    c, y = np.asarray(compute, dtype=float), np.asarray(loss, dtype=float)
    if c.shape != y.shape or c.size == 0:
        raise ValueError(f"need as many losses as computes, got {c.size} and {y.size}")
    if (c <= 0).any() or (y <= 0).any():
        raise ValueError("a power law needs positive compute and loss")
    if np.unique(c).size < 2:
        raise ValueError("a power law needs losses at two or more compute values")
    slope, intercept = np.polyfit(np.log(c), np.log(y), 1)
    return PowerLaw(a=float(np.exp(intercept)), b=float(-slope))


def compute_multiplier(arm: PowerLaw, baseline: PowerLaw, compute: float) -> float:
    """How many times `compute` the baseline needs to reach the arm's loss at `compute`."""
    return baseline.compute(arm.loss(compute)) / compute


def _fit(points: Mapping[float, Sequence[float]]) -> PowerLaw:
    """`fit_power_law` to every (compute, loss) of compute → losses."""
    compute = [c for c, losses in points.items() for _ in losses]
    return fit_power_law(compute, [loss for losses in points.values() for loss in losses])


def bootstrap_multiplier(arm: Mapping[float, Sequence[float]],
                         baseline: Mapping[float, Sequence[float]], compute: float, *,
                         samples: int = 1000, level: float = 0.95,
                         seed: int = 0) -> tuple[float, float, float]:
    """(multiplier, low, high): `compute_multiplier` of the fits to all points of `arm` and
    `baseline` (compute → the final losses of its seeds), and the `level` percentile interval
    over `samples` bootstrap refits, each resampling the seeds of every compute value of each
    arm with replacement. Resamples whose multiplier is undefined (a baseline fit with b ≤ 0)
    are left out; the interval is nan when all are."""
    point = compute_multiplier(_fit(arm), _fit(baseline), compute)
    rng = np.random.default_rng(seed)

    def resample(points: Mapping[float, Sequence[float]]) -> dict[float, np.ndarray]:
        return {c: rng.choice(np.asarray(losses, dtype=float), size=len(losses))
                for c, losses in points.items()}

    draws = np.array([compute_multiplier(_fit(resample(arm)), _fit(resample(baseline)), compute)
                      for _ in range(samples)])
    draws = draws[np.isfinite(draws)]
    if not draws.size:
        return point, math.nan, math.nan
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    return point, float(low), float(high)
