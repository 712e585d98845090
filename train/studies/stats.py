"""The statistics of a study report, in numpy (and scipy's t distribution): mean ± sample std
over seeds, paired differences to the baseline over shared seeds, the registered claims' tests
(a paired t-test for a direction, two one-sided tests for an equivalence margin, Holm's
adjustment within a family, the verdict), a power law of loss against compute, and the
compute multiplier at matched loss with a bootstrap interval over seeds.

The power law is the plain L = a·C^(−b), fitted by least squares on log L against log C (no
irreducible term: over the one or two decades of compute a study spans, it is a straight line
on log-log axes). The compute multiplier of an arm at compute C is how much more compute the
baseline needs to reach the arm's loss at C: M(C) = C_baseline(L_arm(C)) / C, with
C_baseline(L) = (a_baseline / L)^(1/b_baseline); M > 1 means the arm is worth more compute.

An IsoFLOP study (Hoffmann et al. 2022, approach 2) trains several model sizes N at each compute
budget C. Per (arm, budget) a parabola L = c₂(ln N)² + c₁ ln N + c₀ through the final losses
gives the budget's optimum N* = exp(−c₁/2c₂), L* = c₀ − c₁²/4c₂; the arm's frontier is the
power law L*(C) = a·C^(−b) through its optima, and the multiplier at matched loss is M(C) above
with both arms' frontiers. Its bootstrap resamples the seeds of every (arm, budget, size) and
refits every parabola and both frontiers.
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


def paired_p(mean: float, std: float, n: int) -> float:
    """Two-sided p-value of a paired t-test that the differences (mean, sample std, n) have mean
    zero: t = mean / (std/√n) on n − 1 degrees of freedom (nan for n < 2). With three seeds the
    mean must be 4.30 standard errors from zero for p < 0.05 (12.7 with two)."""
    if n < 2 or (mean == 0 and std == 0):
        return math.nan
    t = math.inf if std == 0 else abs(mean) / (std / math.sqrt(n))
    return float(2 * stats.t.sf(t, n - 1))


def t_interval(mean: float, std: float, n: int, level: float = 0.95) -> tuple[float, float]:
    """The `level` t interval of the mean of paired differences (mean, sample std, n):
    mean ± t_{(1+level)/2, n−1} · std/√n ((nan, nan) for n < 2)."""
    if n < 2:
        return math.nan, math.nan
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * std / math.sqrt(n)
    return mean - half, mean + half


def tost_p(mean: float, std: float, n: int, margin: float) -> float:
    """p-value of two one-sided tests (TOST) that the differences (mean, sample std, n) have a
    mean inside (−margin, margin): with s = std/√n on n − 1 degrees of freedom,

        p_low  = P(T ≥ (mean + margin) / s)     H0: mean ≤ −margin
        p_high = P(T ≤ (mean − margin) / s)     H0: mean ≥ +margin
        p      = max(p_low, p_high)

    so p < α exactly when the 1 − 2α interval lies inside (−margin, margin). nan for n < 2;
    with no spread, 0 inside the margin and 1 on or outside it."""
    if n < 2:
        return math.nan
    if std == 0:
        return 0.0 if abs(mean) < margin else 1.0
    error = std / math.sqrt(n)
    p_low = stats.t.sf((mean + margin) / error, n - 1)
    p_high = stats.t.cdf((mean - margin) / error, n - 1)
    return float(max(p_low, p_high))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of m p-values, in their given order: with p_(1) ≤ … ≤ p_(m)
    sorted ascending,

        p_(i) adjusted = max_{j ≤ i} min(1, (m − j + 1) · p_(j)),

    so rejecting every adjusted p < α controls the family-wise error rate at α under any
    dependence. A nan p (no test) counts as 1."""
    values = [1.0 if math.isnan(p) else float(p) for p in p_values]
    m = len(values)
    adjusted = [math.nan] * m
    running = 0.0
    for rank, index in enumerate(sorted(range(m), key=values.__getitem__)):
        running = max(running, min(1.0, (m - rank) * values[index]))
        adjusted[index] = running
    return adjusted


ALPHA = 0.05  # the level of every claim's test, after Holm's adjustment
LEVEL = 0.95  # the interval the report shows beside each claim


def claim_verdict(relation: str, mean: float, interval: tuple[float, float],
                  adjusted_p: float, margin: float | None = None) -> str:
    """The verdict on a confirmatory claim from its paired difference Δ = arm − reference (the
    mean, its 95% interval) and its Holm-adjusted p. A direction ("<": Δ < 0, ">": Δ > 0):
    "agrees" (adjusted p < α, Δ on the claimed side), "disagrees" (adjusted p < α, the other
    side), else "inconclusive". An equivalence ("≈": |Δ| < margin): "agrees" (the TOST's
    adjusted p < α), "disagrees" (the interval lies wholly outside [−margin, margin]), else
    "inconclusive"; never from a large p alone."""
    significant = not math.isnan(adjusted_p) and adjusted_p < ALPHA
    if relation == "≈":
        low, high = interval
        if significant:
            return "agrees"
        return "disagrees" if low > margin or high < -margin else "inconclusive"
    if not significant:
        return "inconclusive"
    return "agrees" if (mean < 0) == (relation == "<") else "disagrees"


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
    arm with replacement. ValueError when the baseline's own fit has b ≤ 0 (its loss does not
    fall with compute); resamples whose multiplier is undefined (a resampled baseline with
    b ≤ 0) are left out, and the interval is nan when all are."""
    base = _fit(baseline)
    if base.b <= 0:
        raise ValueError(f"its loss does not fall with compute (b = {base.b:.3g})")
    point = compute_multiplier(_fit(arm), base, compute)
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


# IsoFLOP profiles (Hoffmann et al. 2022, approach 2) -------------------------------------------
#
# A profile maps an arm's runs at one compute budget C to final losses: N → the losses of its
# seeds, N the model's FLOP-equivalent parameter count. Profiles: C → profile.


@dataclasses.dataclass(frozen=True)
class IsoFlopMinimum:
    """The minimum of the parabola L(x) = c₂x² + c₁x + c₀ in x = ln N fitted to one budget's
    profile: N* = exp(−c₁ / 2c₂), L* = c₀ − c₁² / 4c₂, the parabola's coefficients, and whether
    N* lies within the sizes trained (else it is an extrapolation)."""

    n: float
    loss: float
    coefficients: tuple[float, float, float]
    interior: bool

    def at(self, n: float | np.ndarray) -> float | np.ndarray:
        """The fitted parabola's loss at N = `n`."""
        return np.polyval(self.coefficients, np.log(n))


def parabola_minimum(sizes: Sequence[float], losses: Sequence[float]) -> IsoFlopMinimum:
    """`IsoFlopMinimum` of the least-squares parabola of loss in ln N through the points
    (sizes[i], losses[i]) (each seed its own point); ValueError unless the sizes are positive
    and at least three distinct, and the parabola opens upward (c₂ > 0)."""
    n, y = np.asarray(sizes, dtype=float), np.asarray(losses, dtype=float)
    if n.shape != y.shape or (n <= 0).any():
        raise ValueError("an IsoFLOP profile needs a positive size for every loss")
    if np.unique(n).size < 3:
        raise ValueError("a parabola needs losses at three or more sizes")
    x = np.log(n)
    c2, c1, c0 = (float(c) for c in np.polyfit(x, y, 2))
    if c2 <= 0:
        raise ValueError("the profile's parabola opens downward: no minimum")
    x_star = -c1 / (2 * c2)
    return IsoFlopMinimum(n=math.exp(x_star), loss=c0 - c1 * c1 / (4 * c2),
                          coefficients=(c2, c1, c0),
                          interior=bool(x.min() <= x_star <= x.max()))


def _flat(profile: Mapping[float, Sequence[float]]) -> tuple[list[float], list[float]]:
    """(sizes, losses) of a profile, one point per seed."""
    return ([n for n, losses in profile.items() for _ in losses],
            [loss for losses in profile.values() for loss in losses])


def isoflop_frontier(profiles: Mapping[float, Mapping[float, Sequence[float]]]
                     ) -> tuple[dict[float, IsoFlopMinimum], PowerLaw]:
    """({C: the budget's `parabola_minimum`}, the power law L*(C) = a·C^(−b) fitted by
    `fit_power_law` to the budgets' minimum losses); ValueError from either fit."""
    minima = {c: parabola_minimum(*_flat(profile)) for c, profile in sorted(profiles.items())}
    return minima, fit_power_law(list(minima), [m.loss for m in minima.values()])


def frontier_multiplier(arm: Mapping[float, Mapping[float, Sequence[float]]],
                        baseline: Mapping[float, Mapping[float, Sequence[float]]],
                        compute: float) -> float:
    """How many times `compute` the baseline needs to reach, on its frontier, the arm's frontier
    loss at `compute`: M = C_baseline(L*_arm(C)) / C (`compute_multiplier` of the frontiers);
    M > 1: the arm is worth more compute."""
    return compute_multiplier(isoflop_frontier(arm)[1], isoflop_frontier(baseline)[1], compute)


def bootstrap_frontier_multiplier(arm: Mapping[float, Mapping[float, Sequence[float]]],
                                  baseline: Mapping[float, Mapping[float, Sequence[float]]],
                                  compute: float, *, samples: int = 1000, level: float = 0.95,
                                  seed: int = 0) -> tuple[float, float, float, int]:
    """(multiplier, low, high, refits): `frontier_multiplier` of all the runs, and the `level`
    percentile interval over `samples` bootstrap refits, each resampling with replacement the
    seeds of every (arm, budget, size) and refitting every parabola and both frontiers. A
    resample without a multiplier (a parabola opening downward, a frontier with b ≤ 0) is left
    out; `refits` counts those kept, and the interval is nan when none is."""
    point = frontier_multiplier(arm, baseline, compute)
    rng = np.random.default_rng(seed)

    def resample(profiles):
        return {c: {n: rng.choice(np.asarray(losses, dtype=float), size=len(losses))
                    for n, losses in profile.items()} for c, profile in profiles.items()}

    draws = []
    for _ in range(samples):
        try:
            draws.append(frontier_multiplier(resample(arm), resample(baseline), compute))
        except ValueError:
            continue
    kept = np.asarray(draws, dtype=float)
    kept = kept[np.isfinite(kept)]
    if not kept.size:
        return point, math.nan, math.nan, 0
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(kept, [tail, 100 - tail])
    return point, float(low), float(high), int(kept.size)


def multiplier_verdict(relation: str, interval: tuple[float, float], paper: float) -> str:
    """The verdict on a registered compute-multiplier claim from the multiplier's bootstrap
    interval (low, high) and the paper's multiplier. For ">" (the arm is worth more compute):
    "agrees" when 1 < low and low ≤ paper ≤ high (a gain, of the paper's size); "disagrees"
    when the interval excludes the paper's number or lies below 1; else "inconclusive" (it
    holds both 1 and the paper's number). "<" mirrors it (high < 1 for a loss). No interval
    (nan): "inconclusive"."""
    low, high = interval
    if math.isnan(low) or math.isnan(high):
        return "inconclusive"
    wrong_side = high < 1 if relation == ">" else low > 1
    if wrong_side or not low <= paper <= high:
        return "disagrees"
    detected = low > 1 if relation == ">" else high < 1
    return "agrees" if detected else "inconclusive"
