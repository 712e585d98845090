"""The statistics of a study report, in numpy (and scipy's t distribution): mean ± sample std
over seeds, paired differences to the baseline over shared seeds, the registered claims' tests
(a paired t-test for a direction, two one-sided tests for an equivalence margin, Holm's
adjustment within a family, the verdict), the power plan of a claim (the seeds it needs, the
smallest effect its seeds detect), a power law of loss against compute, and the
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
refits every parabola and both frontiers; a misfit-aware bootstrap resamples instead each
parabola's residuals and then the frontier's (`misfit_bootstrap_frontier_multiplier`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import optimize, stats


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


def paired_p(mean: float, std: float, n: int, relation: str | None = None) -> float:
    """p-value of a paired t-test that the differences (mean, sample std, n) have mean zero,
    t = mean / (std/√n) on n − 1 degrees of freedom (nan for n < 2): two-sided by default
    (with three seeds the mean must be 4.30 standard errors from zero for p < 0.05, 12.7 with
    two), or one-sided against the direction `relation` claims ("<": P(T ≤ t), ">": P(T ≥ t))."""
    if n < 2 or (mean == 0 and std == 0):
        return math.nan
    t = math.copysign(math.inf, mean) if std == 0 else mean / (std / math.sqrt(n))
    if relation == "<":
        return float(stats.t.cdf(t, n - 1))
    if relation == ">":
        return float(stats.t.sf(t, n - 1))
    return float(2 * stats.t.sf(abs(t), n - 1))


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
                  adjusted_p: float, margin: float | None = None, tails: int = 2) -> str:
    """The verdict on a confirmatory claim from its paired difference Δ = arm − reference (the
    mean, its 95% interval) and its Holm-adjusted p. A direction ("<": Δ < 0, ">": Δ > 0):
    "agrees" (adjusted p < α, Δ on the claimed side), "disagrees" (adjusted p < α, the other
    side; for a one-sided test, whose p is small only on the claimed side: the 95% interval
    lies wholly on the other side), else "inconclusive". An equivalence ("≈": |Δ| < margin):
    "agrees" (the TOST's adjusted p < α), "disagrees" (the interval lies wholly outside
    [−margin, margin]), else "inconclusive"; never from a large p alone."""
    significant = not math.isnan(adjusted_p) and adjusted_p < ALPHA
    if relation == "≈":
        low, high = interval
        if significant:
            return "agrees"
        return "disagrees" if low > margin or high < -margin else "inconclusive"
    claimed_side = (mean < 0) == (relation == "<")
    if tails == 1 and not significant:
        low, high = interval
        wrong_side = low > 0 if relation == "<" else high < 0
        return "disagrees" if wrong_side else "inconclusive"
    if not significant:
        return "inconclusive"
    return "agrees" if claimed_side else "disagrees"


# Power plans ----------------------------------------------------------------------------------
#
# Planned at the strictest level Holm's correction can give a claim, α/m for a family of m claims
# (the first step of the step-down), so that each claim has its power wherever it ranks.

POWER = 0.8  # the power a plan asks for


def _nct_sf(critical: float, df: int, shift: float) -> float:
    """P(T′ > critical) of a noncentral t (df, shift); where scipy's is nan (far out in its
    tail, with a large shift) the normal approximation P(Z > critical − shift)."""
    tail = float(stats.nct.sf(critical, df, shift))
    return tail if math.isfinite(tail) else float(stats.norm.sf(critical - shift))


def direction_power(effect: float, std: float, n: int, alpha: float, tails: int = 2) -> float:
    """The power of the paired t-test at level `alpha` (`tails` 1: one-sided toward the effect,
    2: two-sided) to reject Δ = 0 when the true mean difference is `effect` and the paired
    differences' standard deviation `std`, with n seeds: with c = t_{1−α/tails, n−1} and T′ a
    noncentral t on n − 1 degrees of freedom with noncentrality |effect|·√n / std,

        power = P(T′ > c) + [tails = 2] · P(T′ < −c)."""
    if n < 2:
        return 0.0
    df, shift = n - 1, abs(effect) * math.sqrt(n) / std
    critical = stats.t.ppf(1 - alpha / tails, df)
    power = _nct_sf(critical, df, shift)
    if tails == 2:
        power += 1 - _nct_sf(-critical, df, shift)
    return float(power)


def equivalence_power(margin: float, std: float, n: int, alpha: float,
                      true: float = 0.0) -> float:
    """The power of the TOST at level `alpha` (`tost_p` < α) to show |Δ| < `margin` when the
    true mean difference is `true`, with n seeds of paired standard deviation `std`: with
    c = t_{1−α, n−1} and noncentral t's T₊, T₋ on n − 1 degrees of freedom with
    noncentralities (true ± margin)·√n / std, the Bonferroni lower bound

        power ≥ P(T₊ > c) + P(T₋ < −c) − 1

    (both one-sided tests reject; clipped at 0), close to exact once the power is useful."""
    if n < 2:
        return 0.0
    df, scale = n - 1, math.sqrt(n) / std
    critical = stats.t.ppf(1 - alpha, df)
    power = (_nct_sf(critical, df, (true + margin) * scale)
             - _nct_sf(-critical, df, (true - margin) * scale))
    return float(max(power, 0.0))


def seeds_needed(power_at, target: float = POWER, limit: int = 100_000) -> int | None:
    """The smallest n ≥ 2 with `power_at(n)` ≥ `target` (power rises with n), or None when even
    `limit` seeds fall short."""
    if power_at(limit) < target:
        return None
    low, high = 1, 2  # power_at(low) < target ≤ power_at(high) once the doubling stops
    while power_at(high) < target:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if power_at(middle) >= target else (middle, high)
    return high


def _smallest(power_at, scale: float, target: float) -> float:
    """The smallest x > 0 with `power_at(x)` = `target` (power rises with x), bracketed from
    `scale` by doubling (scipy's noncentral t is nan far out in its tail, so no wide bracket)."""
    high = scale
    while power_at(high) < target:
        high *= 2
    return float(optimize.brentq(lambda x: power_at(x) - target, 0.0, high))


def detectable_effect(std: float, n: int, alpha: float, tails: int = 2,
                      target: float = POWER) -> float:
    """The smallest |Δ| the paired t-test detects with power `target` at n seeds of paired
    standard deviation `std` (`direction_power` = target); nan for n < 2."""
    if n < 2 or not std > 0:
        return math.nan
    return _smallest(lambda effect: direction_power(effect, std, n, alpha, tails),
                     std / math.sqrt(n), target)


def equivalent_margin(std: float, n: int, alpha: float, target: float = POWER) -> float:
    """The smallest margin the TOST shows with power `target` at n seeds of paired standard
    deviation `std` when the true difference is 0 (`equivalence_power` = target); nan for n < 2."""
    if n < 2 or not std > 0:
        return math.nan
    return _smallest(lambda margin: equivalence_power(margin, std, n, alpha),
                     std / math.sqrt(n), target)


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

    return point, *_refit_interval(
        lambda: frontier_multiplier(resample(arm), resample(baseline), compute), samples, level)


def _refit_interval(refit, samples: int, level: float) -> tuple[float, float, int]:
    """(low, high, refits): the `level` percentile interval of `samples` calls of `refit`,
    leaving out those that raise ValueError or give no finite value (nan, nan, 0 when none
    does)."""
    draws = []
    for _ in range(samples):
        try:
            draws.append(refit())
        except ValueError:
            continue
    kept = np.asarray(draws, dtype=float)
    kept = kept[np.isfinite(kept)]
    if not kept.size:
        return math.nan, math.nan, 0
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(kept, [tail, 100 - tail])
    return float(low), float(high), int(kept.size)


def _regroup(profile: Mapping[float, Sequence[float]], values: np.ndarray) -> dict:
    """`values`, in `_flat(profile)`'s order, as a profile of the same sizes and seed counts."""
    grouped, start = {}, 0
    for n, losses in profile.items():
        grouped[n] = values[start:start + len(losses)]
        start += len(losses)
    return grouped


def _misfit_resample(profiles: Mapping[float, Mapping[float, Sequence[float]]],
                     rng: np.random.Generator) -> PowerLaw:
    """One refit of a frontier that counts its misfit: each budget's losses redrawn as its
    parabola's fitted values plus its residuals resampled with replacement (the seeds' noise and
    the parabola's misfit together), the minima refitted, then the minima redrawn as the refitted
    frontier times its log-residuals resampled with replacement, and the frontier refitted."""
    drawn = {}
    for c, profile in profiles.items():
        sizes, losses = _flat(profile)
        fitted = np.asarray(parabola_minimum(sizes, losses).at(np.asarray(sizes)))
        residuals = np.asarray(losses) - fitted
        drawn[c] = _regroup(profile, fitted + rng.choice(residuals, size=residuals.size))
    minima, law = isoflop_frontier(drawn)
    computes = np.array(list(minima))
    log_residuals = np.log([m.loss for m in minima.values()]) - np.log(law.loss(computes))
    redrawn = law.loss(computes) * np.exp(rng.choice(log_residuals, size=log_residuals.size))
    return fit_power_law(computes, redrawn)


def misfit_bootstrap_frontier_multiplier(
        arm: Mapping[float, Mapping[float, Sequence[float]]],
        baseline: Mapping[float, Mapping[float, Sequence[float]]], compute: float, *,
        samples: int = 1000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float, int]:
    """(multiplier, low, high, refits) as `bootstrap_frontier_multiplier`, but each refit counts
    the fits' misfit (`_misfit_resample`: each parabola's residuals, then the frontier's
    log-residuals, resampled with replacement) where the seed bootstrap counts the seeds'
    noise alone. With three budgets the frontier's residuals are three values, so this interval
    is coarse; it is wide exactly when the minima do not lie on one power law."""
    point = frontier_multiplier(arm, baseline, compute)
    rng = np.random.default_rng(seed)
    return point, *_refit_interval(
        lambda: compute_multiplier(_misfit_resample(arm, rng), _misfit_resample(baseline, rng),
                                   compute), samples, level)


def log_loss_frontier(profiles: Mapping[float, Mapping[float, Sequence[float]]]) -> PowerLaw:
    """The frontier with each budget's parabola fitted to ln L instead of L (its minimum
    exp(min ln L)): a sensitivity check of the parabola's form."""
    minima = {}
    for c, profile in sorted(profiles.items()):
        sizes, losses = _flat(profile)
        minima[c] = math.exp(parabola_minimum(sizes, np.log(losses)).loss)
    return fit_power_law(list(minima), list(minima.values()))


def observed_frontier(profiles: Mapping[float, Mapping[float, Sequence[float]]]) -> PowerLaw:
    """The frontier through each budget's best observed size (the lowest mean loss over its
    seeds), no parabola: a sensitivity check of the interpolation."""
    best = {c: min(float(np.mean(losses)) for losses in profile.values())
            for c, profile in sorted(profiles.items())}
    return fit_power_law(list(best), list(best.values()))


def excludes_one_verdict(relation: str, interval: tuple[float, float]) -> str:
    """The verdict on a compute-multiplier claim judged by its misfit-aware interval: for ">",
    "agrees" when the interval lies above 1, "disagrees" when it lies below 1, else
    "inconclusive" ("<" mirrors it); nan: "inconclusive". The paper's number is shown beside it,
    not required: with the fits' misfit counted, a gain of any size is what can be shown."""
    low, high = interval
    if math.isnan(low) or math.isnan(high):
        return "inconclusive"
    above, below = low > 1, high < 1
    if relation == "<":
        above, below = below, above
    return "agrees" if above else "disagrees" if below else "inconclusive"


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
