"""The report of an IsoFLOP study (`train.studies.study.is_isoflop`): per budget and arm the
parabola's minimum, each arm's frontier and its compute multiplier over the baseline, the
registered compute-multiplier claims, the multiplier's sensitivity to the analysis
(`isoflop_section`) and the plot of the profiles and frontiers (`plot_isoflop`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_collections
import numpy as np

from arch.accounting import flops_per_token
from config.defaults import base_config
from train import rundir
from train.studies import stats
from train.studies import study as studies
from train.studies.results import Result

ISOFLOP_PLOT = "isoflop.png"


def flop_parameters(workdir: str | Path) -> float:
    """N of the run in `workdir`, its FLOP-equivalent parameter count: FLOPs per training token
    of its resolved model / 6 (so that training FLOPs = 6·N·tokens)."""
    defaults = json.loads(base_config().to_json_best_effort())
    config = ml_collections.ConfigDict(rundir.saved_config(workdir, defaults))
    return flops_per_token(config.model, config.seq_len, training=True) / 6

Profiles = dict[float, dict[float, list[float]]]  # C → N → final losses (one per seed)

def isoflop_budgets(root: Path, results: dict[str, dict[int, Result]],
                    arm: str) -> dict[float, float]:
    """The arm's nominal budget (its size names') → its true C: the geometric mean of the
    budget's runs' training FLOPs (`training_flops`, the arm's own FLOPs per token: AttnRes's
    depth reads make Block's C a little above the nominal budget; rounding the steps moves a
    run's FLOPs by well under 1%)."""
    computes: dict[float, list[float]] = {}
    for cell, runs in results.items():
        cell_arm, size = studies.split_cell(cell)
        if cell_arm == arm and runs and size is not None:
            computes.setdefault(studies.size_budget(size), []).extend(
                run.compute for run in runs.values())
    return {budget: float(np.exp(np.mean(np.log(values))))
            for budget, values in sorted(computes.items())}

def isoflop_profiles(root: Path, results: dict[str, dict[int, Result]], arm: str) -> Profiles:
    """The arm's IsoFLOP profiles from its finished runs, keyed by each budget's true C
    (`isoflop_budgets`), each size's N its runs' `flop_parameters`."""
    budgets = isoflop_budgets(root, results, arm)
    profiles: Profiles = {compute: {} for compute in budgets.values()}
    for cell, runs in results.items():
        cell_arm, size = studies.split_cell(cell)
        if cell_arm != arm or not runs or size is None:
            continue
        n = flop_parameters(studies.run_dir(root, cell, min(runs)))
        profiles[budgets[studies.size_budget(size)]][n] = [run.loss for run in runs.values()]
    return profiles

def _multiplier_claims(description: dict, results: dict[str, dict[int, Result]],
                       profiles: dict[str, Profiles]) -> list[str]:
    """The Markdown table of the registered compute-multiplier claims: each claim's multiplier
    at the arm's largest budget with its 95% bootstrap interval (over seeds, or misfit-aware for
    metric "compute_multiplier_misfit"), the paper's number and the verdict
    (`stats.multiplier_verdict`, or `stats.excludes_one_verdict` for the misfit-aware claims),
    or "exploratory: why" when a cell of its arms has a finished-seed count other than the
    registered n."""
    claims = [claim for claim in description["claims"] if claim.metric in studies.MULTIPLIERS]
    if not claims:
        return []
    lines = ["| Claim | Source | Check | Paper | Multiplier at C [95% CI] (refits) | C (FLOPs) | "
             "Verdict |", "|---|---|---|---|---|---|---|"]
    for claim in claims:
        paper = description["paper"].get(claim.arm, math.nan)
        short = [f"{cell} has {len(runs)}" for cell, runs in results.items()
                 if studies.split_cell(cell)[0] in (claim.arm, claim.reference)
                 and len(runs) != claim.n]
        arm, reference = profiles.get(claim.arm, {}), profiles.get(claim.reference, {})
        misfit = claim.metric == "compute_multiplier_misfit"
        try:
            at = max(arm)
            m, low, high, refits = (stats.misfit_bootstrap_frontier_multiplier if misfit else
                                    stats.bootstrap_frontier_multiplier)(arm, reference, at)
        except ValueError as error:
            value, at_text, verdict = f"— ({error})", "—", "inconclusive: no fit"
        else:
            value = (f"{m:.3f} [{low:.3f}, {high:.3f}] ({refits}"
                     + (", misfit-aware)" if misfit else ")"))
            at_text = f"{at:.3g}"
            verdict = (stats.excludes_one_verdict(claim.relation, (low, high)) if misfit else
                       stats.multiplier_verdict(claim.relation, (low, high), paper))
        if short:
            verdict = (f"exploratory: finished seeds, registered n = {claim.n}: "
                       + ", ".join(short))
        cells = [claim.quote, claim.source, f"M({claim.arm} over {claim.reference}) "
                 f"{claim.relation} 1", f"{paper:g}", value, at_text, verdict]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines

def isoflop_section(root: Path, description: dict, results: dict[str, dict[int, Result]],
                    arms: list[str]) -> list[str]:
    """The report's section for an IsoFLOP study: per budget and arm the parabola's minimum
    (`stats.parabola_minimum`); per arm the frontier L*(C) = a·C^(−b) through the minima
    (`stats.isoflop_frontier`), its multiplier over the baseline at every budget where both
    have a minimum and, at the largest, with its 95% bootstrap interval
    (`stats.bootstrap_frontier_multiplier`); the registered compute-multiplier claims
    (`_multiplier_claims`); and ROOT/isoflop.png."""
    baseline = description["baseline"]
    profiles = {arm: isoflop_profiles(root, results, arm) for arm in arms}
    computes = {arm: isoflop_budgets(root, results, arm) for arm in arms}
    nominal = sorted({budget for arm in arms for budget in computes[arm]})
    minima: dict[str, dict[float, stats.IsoFlopMinimum | str]] = {}
    frontiers: dict[str, stats.PowerLaw | str] = {}
    for arm in arms:
        minima[arm] = {}
        for compute, profile in profiles[arm].items():
            sizes, losses = ([n for n, values in profile.items() for _ in values],
                             [loss for values in profile.values() for loss in values])
            try:
                minima[arm][compute] = stats.parabola_minimum(sizes, losses)
            except ValueError as error:
                minima[arm][compute] = str(error)
        fitted = {c: m for c, m in minima[arm].items() if not isinstance(m, str)}
        try:
            frontiers[arm] = stats.fit_power_law(list(fitted),
                                                 [m.loss for m in fitted.values()])
        except ValueError as error:
            frontiers[arm] = str(error)
    lines = ["## IsoFLOP frontier", "",
             "Per budget C and arm: the parabola L(x) = c₂x² + c₁x + c₀ in x = ln N fitted by "
             "least squares to every finished run's final eval loss (N: FLOPs per training "
             "token / 6, so C = 6·N·tokens), and its minimum N* = exp(−c₁/2c₂), L* = c₀ − "
             "c₁²/4c₂ (*interior*: N* within the sizes trained; else an extrapolation). C is "
             "the geometric mean of the budget's runs' training FLOPs.", "",
             "| Budget C (FLOPs) | Arm | Sizes (runs) | N* | L* | Interior |",
             "|---|---|---|---|---|---|"]
    for compute, arm in ((computes[arm][b], arm) for b in nominal for arm in arms
                         if b in computes[arm]):
        minimum, profile = minima[arm][compute], profiles[arm][compute]
        runs = f"{len(profile)} ({sum(map(len, profile.values()))})"
        if isinstance(minimum, str):
            lines.append(f"| {compute:.3g} | {arm} | {runs} | — | — | no fit: {minimum} |")
            continue
        lines.append(f"| {compute:.3g} | {arm} | {runs} | {minimum.n:.4g} | "
                     f"{minimum.loss:.4f} | {'yes' if minimum.interior else 'no'} |")
    lines += ["", "Frontier: L*(C) = a·C^(−b) fitted by least squares in log-log to each budget's "
              "(C, L*). The compute multiplier at C is how many times C the baseline needs to "
              "reach the arm's frontier loss at C on its own frontier, M(C) = "
              "(a_baseline / L*_arm(C))^(1/b_baseline) / C (M > 1: the arm is worth more "
              "compute), at each nominal budget where both arms have a minimum (elsewhere it "
              "would extrapolate both frontiers), C the arm's own compute there.", "",
              "| Arm | a | b | " + " | ".join(f"M at {c:.3g}" for c in nominal) + " |",
              "|---|---|---|" + "---|" * len(nominal)]
    base = frontiers.get(baseline)

    def fitted_at(arm: str, budget: float) -> bool:
        compute = computes[arm].get(budget)
        return isinstance(minima.get(arm, {}).get(compute), stats.IsoFlopMinimum)

    for arm in arms:
        fit = frontiers[arm]
        if isinstance(fit, str):
            lines.append(f"| {arm} | — | — | " + " | ".join(["no fit: " + fit]
                                                         + ["—"] * (len(nominal) - 1)) + " |")
            continue
        values = ["1 (baseline)" if arm == baseline else
                  f"{stats.compute_multiplier(fit, base, computes[arm][b]):.3f}"
                  if isinstance(base, stats.PowerLaw) and fitted_at(arm, b)
                  and fitted_at(baseline, b) else "—" for b in nominal]
        lines.append(f"| {arm} | {fit.a:.4g} | {fit.b:.4g} | " + " | ".join(values) + " |")
    claims = _multiplier_claims(description, results, profiles)
    lines += ["", "Compute multiplier over the baseline at the arm's largest budget with its 95% "
              "interval: the 2.5–97.5 percentile of 1000 bootstrap refits, each resampling "
              "with replacement the seeds of every (arm, budget, size) and refitting every "
              "parabola and both frontiers (refits: those with a multiplier)."
              + (" A registered claim M > 1 *agrees* when the interval lies above 1 and holds "
                 "the paper's multiplier, *disagrees* when it excludes the paper's multiplier "
                 "or lies below 1, and is *inconclusive* otherwise." if claims else ""), ""]
    if claims:
        lines += claims
    else:
        lines += ["| Arm | Multiplier at C [95% CI] (refits) | C (FLOPs) |", "|---|---|---|"]
        for arm in arms:
            if arm == baseline or not profiles[arm]:
                continue
            try:
                at = max(profiles[arm])
                m, low, high, refits = stats.bootstrap_frontier_multiplier(
                    profiles[arm], profiles.get(baseline, {}), at)
                lines.append(f"| {arm} | {m:.3f} [{low:.3f}, {high:.3f}] ({refits}) | "
                             f"{at:.3g} |")
            except ValueError as error:
                lines.append(f"| {arm} | — ({error}) | — |")
    for arm in arms:
        if arm != baseline and profiles[arm] and profiles.get(baseline):
            lines += ["", *isoflop_sensitivity(arm, profiles[arm], profiles[baseline])]
    plot_isoflop(profiles, minima, frontiers, arms, root / ISOFLOP_PLOT)
    return lines + ["", f"![IsoFLOP profiles and frontiers]({ISOFLOP_PLOT})", ""]

def _drop_size(profiles: Profiles, rank: int) -> Profiles:
    """`profiles` without the `rank`-th smallest size of every budget."""
    return {c: {n: losses for i, (n, losses) in enumerate(sorted(profile.items())) if i != rank}
            for c, profile in profiles.items()}

def isoflop_sensitivity(arm: str, arm_profiles: Profiles, base_profiles: Profiles) -> list[str]:
    """The multiplier of `arm` over the baseline under other analysis choices, beside the
    headline with its seed-bootstrap and its misfit-aware interval
    (`stats.misfit_bootstrap_frontier_multiplier`): each budget left out (the multiplier then at
    the largest budget left), each size rank left out of every budget, the parabolas fitted in
    log-loss, and the frontier through each budget's best observed run."""
    at = max(arm_profiles)

    def row(label: str, compute, at_compute: float = at) -> str:
        try:
            value = f"{compute():.3f}"
        except ValueError as error:
            value = f"— ({error})"
        return f"| {label} | {value} | {at_compute:.3g} |"

    try:
        _, seed_low, seed_high, _ = stats.bootstrap_frontier_multiplier(arm_profiles,
                                                                        base_profiles, at)
        point, low, high, refits = stats.misfit_bootstrap_frontier_multiplier(
            arm_profiles, base_profiles, at)
    except ValueError as error:
        return [f"Sensitivity of {arm}'s multiplier: none ({error})."]
    lines = [f"Sensitivity of {arm}'s multiplier to the analysis (point values; the first row "
             "with its seed-bootstrap interval and its misfit-aware interval, 1000 refits each "
             "resampling every parabola's residuals and then the frontier's log-residuals: the "
             "seeds' noise and the fits' misfit together).", "",
             "| Analysis | Multiplier | At C (FLOPs) |", "|---|---|---|",
             f"| all runs (seed bootstrap [{seed_low:.3f}, {seed_high:.3f}]; misfit-aware "
             f"[{low:.3f}, {high:.3f}], {refits} refits) | {point:.3f} | {at:.3g} |"]
    # The k-th budget of each arm is the same nominal budget (each arm at its own true C).
    for k, dropped in enumerate(sorted(arm_profiles)):
        kept_arm = {c: p for i, (c, p) in enumerate(sorted(arm_profiles.items())) if i != k}
        kept_base = {c: p for i, (c, p) in enumerate(sorted(base_profiles.items())) if i != k}
        if kept_arm:
            lines.append(row(f"without budget {dropped:.3g}", lambda a=kept_arm, b=kept_base:
                             stats.frontier_multiplier(a, b, max(a)), max(kept_arm)))
    sizes = min(len(profile) for profile in arm_profiles.values())
    for rank in range(sizes):
        lines.append(row(f"without the {_ordinal(rank + 1)} smallest size of each budget",
                         lambda r=rank: stats.frontier_multiplier(
                             _drop_size(arm_profiles, r), _drop_size(base_profiles, r), at)))
    lines.append(row("parabolas in log-loss", lambda: stats.compute_multiplier(
        stats.log_loss_frontier(arm_profiles), stats.log_loss_frontier(base_profiles), at)))
    lines.append(row("frontier through the best observed runs", lambda: stats.compute_multiplier(
        stats.observed_frontier(arm_profiles), stats.observed_frontier(base_profiles), at)))
    return lines

def _ordinal(k: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")

def plot_isoflop(profiles: dict[str, Profiles],
                 minima: dict[str, dict[float, stats.IsoFlopMinimum | str]],
                 frontiers: dict[str, stats.PowerLaw | str], arms: list[str],
                 path: Path) -> None:
    """Left: final loss against N (log x) per budget and arm, every run, the fitted parabola
    and its minimum. Right: the minima L* against C, log-log, with each arm's frontier."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ("-", "--", ":", "-.")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, arm in enumerate(arms):
        style = styles[i % len(styles)]
        for j, (compute, profile) in enumerate(profiles[arm].items()):
            colour = colours[j % len(colours)]
            sizes = [n for n, values in profile.items() for _ in values]
            left.scatter(sizes, [loss for values in profile.values() for loss in values],
                         s=12, color=colour, marker="o" if i == 0 else "^")
            minimum = minima[arm].get(compute)
            if isinstance(minimum, stats.IsoFlopMinimum):
                grid = np.geomspace(min(sizes), max(sizes), 60)
                left.plot(grid, minimum.at(grid), style, color=colour,
                          label=f"{arm}, C = {compute:.2g}")
                left.plot(minimum.n, minimum.loss, "x", color=colour, markersize=9)
        fitted = {c: m for c, m in minima[arm].items() if isinstance(m, stats.IsoFlopMinimum)}
        if not fitted:
            continue
        dots = right.scatter(list(fitted), [m.loss for m in fitted.values()], s=20, label=arm)
        fit = frontiers.get(arm)
        if isinstance(fit, stats.PowerLaw):
            grid = np.geomspace(min(fitted), max(fitted), 50)
            right.plot(grid, fit.a * grid ** -fit.b, style, color=dots.get_facecolor()[0],
                       label=f"{arm}: {fit.a:.3g}·C^-{fit.b:.3g}")
    left.set(xscale="log", xlabel="N (FLOP-equivalent parameters)", ylabel="final eval loss",
             title="IsoFLOP profiles (× marks each minimum)")
    right.set(xscale="log", yscale="log", xlabel="training compute C (FLOPs)",
              ylabel="L* (the profile's minimum)", title="Compute-optimal frontier")
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for formatter in (right.yaxis.set_major_formatter, right.yaxis.set_minor_formatter):
        formatter(matplotlib.ticker.FormatStrFormatter("%.4g"))  # losses, not powers of ten
    for axes in (left, right):
        axes.legend(fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
