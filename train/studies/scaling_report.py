"""The report of a scaling study: the power law of loss against training compute per arm
with the compute multiplier (`scaling_table`, `plot_scaling`), and for a study over training
lengths Δ per length with the registered trend test (`length_section`, `plot_length`)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import ml_collections
import numpy as np

from arch.accounting import parameter_count
from config.defaults import base_config
from train import rundir
from train.data import in_memory
from train.studies import provenance, stats
from train.studies import study as studies
from train.studies.results import Result, interval_text, p_text, seed_losses

SCALING_PLOT, LENGTH_PLOT = "loss_vs_compute.png", "delta_vs_tokens.png"


def _points(results: dict[str, dict[int, Result]], arm: str) -> dict[float, list[float]]:
    """compute → final losses of the arm's finished runs, over its sizes."""
    points: dict[float, list[float]] = {}
    for cell, runs in results.items():
        if studies.split_cell(cell)[0] == arm and runs:
            compute = float(np.mean([r.compute for r in runs.values()]))
            points[compute] = [r.loss for r in runs.values()]
    return points

def scaling_table(results: dict[str, dict[int, Result]], description: dict,
                  arms: list[str]) -> tuple[list[str], dict[str, stats.PowerLaw]]:
    """(the Markdown table of power-law fits and compute multipliers, {arm: fit})."""
    baseline, paper = description["baseline"], description["paper"]
    header = "| Arm | a | b | Compute multiplier vs baseline [95% CI] | At C (FLOPs) |"
    rule = "|---|---|---|---|---|"
    if paper:
        header, rule = header + f" Paper ({description['paper_metric']}) |", rule + "---|"
    lines, fits = [header, rule], {}
    base_points = _points(results, baseline)
    for arm in arms:
        points = _points(results, arm)
        try:
            fit = fits[arm] = stats.fit_power_law(
                [c for c, losses in points.items() for _ in losses],
                [loss for losses in points.values() for loss in losses])
        except ValueError as error:
            row = f"| {arm} | — | — | no fit: {error} | — |"
        else:
            at = max(points)
            if arm == baseline:
                multiplier = "1 (baseline)"
            else:
                try:
                    m, low, high = stats.bootstrap_multiplier(points, base_points, at)
                    multiplier = f"{m:.3f} [{low:.3f}, {high:.3f}]"
                except ValueError as error:
                    multiplier = f"— (baseline: {error})"
            row = f"| {arm} | {fit.a:.4g} | {fit.b:.4g} | {multiplier} | {at:.3g} |"
        if paper:
            row += f" {paper[arm]:g} |" if arm in paper else " — |"
        lines.append(row)
    return lines, fits

def plot_scaling(results: dict[str, dict[int, Result]], fits: dict[str, stats.PowerLaw],
                 arms: list[str], path: Path) -> None:
    """Final loss against training compute, log-log: every run, and each arm's fit."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for arm in arms:
        points = _points(results, arm)
        if not points:
            continue
        computes = [c for c, losses in points.items() for _ in losses]
        losses = [loss for values in points.values() for loss in values]
        dots = axes.scatter(computes, losses, s=14, label=arm)
        if arm in fits:
            grid = np.geomspace(min(computes), max(computes), 50)
            fit = fits[arm]
            axes.plot(grid, fit.a * grid ** -fit.b, color=dots.get_facecolor()[0],
                      label=f"{arm}: {fit.a:.3g}·C^-{fit.b:.3g}")
    axes.set(xscale="log", yscale="log", xlabel="training compute C (FLOPs)",
             ylabel="final eval loss", title="Loss against compute")
    for formatter in (axes.yaxis.set_major_formatter, axes.yaxis.set_minor_formatter):
        formatter(matplotlib.ticker.FormatStrFormatter("%.4g"))  # losses, not powers of ten
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)

@dataclasses.dataclass(frozen=True)
class Length:
    """One training length of a study over lengths: its size name, steps, training tokens
    (steps × batch_size × seq_len), tokens per parameter of the baseline's model and epochs
    over the training split (nan when the split cannot be read)."""

    size: str
    steps: int
    tokens: int
    tokens_per_parameter: float
    epochs: float

def _saved_config(workdir: Path) -> ml_collections.ConfigDict:
    """The run's config.json over the current defaults; FileNotFoundError without one (a run
    not started, or a size not yet trained)."""
    defaults = json.loads(base_config().to_json_best_effort())
    saved = rundir.saved_config(workdir, defaults)
    if saved is None:
        raise FileNotFoundError(workdir / "config.json")
    return ml_collections.ConfigDict(saved)

def _train_windows(config: ml_collections.ConfigDict) -> int:
    """Windows of seq_len + 1 tokens in the run's training split (loaded as it trained)."""
    return in_memory.load(config.data, "train").num_windows(config.seq_len)

def lengths(root: Path, description: dict) -> list[Length]:
    """Each size's `Length`, read from the config.json of its baseline runs (the first seed
    that has one); a size without one is left out."""
    found, windows = [], {}
    for size in description["scaling"]:
        cell = f"{description['baseline']}@{size}"
        for seed in description["seeds"]:
            workdir = studies.run_dir(root, cell, seed)
            try:
                config = _saved_config(workdir)
            except (OSError, ValueError, KeyError, TypeError):
                continue
            tokens = config.steps * config.batch_size * config.seq_len
            key = (config.data.to_json_best_effort(), config.seq_len)
            if key not in windows:
                try:
                    windows[key] = _train_windows(config)
                except (OSError, ValueError) as error:
                    windows[key] = error
            epochs = (config.steps * config.batch_size / windows[key]
                      if isinstance(windows[key], int) and windows[key] else math.nan)
            found.append(Length(size, config.steps, tokens,
                                tokens / parameter_count(config.model), epochs))
            break
    return found

def _relative(delta: float, baseline: float) -> str:
    """`; −2.4%`: Δ as a share of the baseline's loss ("" without one)."""
    if not (math.isfinite(delta) and baseline > 0):
        return ""
    return f"; {100 * delta / baseline:+.1f}%"

def length_deltas(results: dict[str, dict[int, Result]], description: dict,
                  arm: str) -> dict[str, tuple[float, float, int]]:
    """size → (mean, std, n) of Δ = arm − baseline at that size, paired by seed."""
    baseline = description["baseline"]
    return {size: stats.paired_difference(seed_losses(results, f"{arm}@{size}"),
                                          seed_losses(results, f"{baseline}@{size}"))
            for size in description["scaling"]}

@dataclasses.dataclass(frozen=True)
class Trend:
    """The registered trend test of an arm: per seed s, the shrink σ·(Δ(s) at the shortest
    length − Δ(s) at the longest), σ the sign of the mean Δ at the shortest length, so that a
    positive shrink means |Δ| is smaller at the longest length; its mean, std, n, 95% interval,
    the paired t-test's p, Holm's adjustment over the arms (nan when exploratory) and the
    verdict."""

    arm: str
    mean: float
    std: float
    n: int
    interval: tuple[float, float]
    p: float
    adjusted_p: float
    verdict: str

def trends(results: dict[str, dict[int, Result]], description: dict, n: int) -> list[Trend]:
    """`Trend` of each arm but the baseline over the seeds with all four runs it pairs: it
    "shrinks" (|Δ| smaller at the longest length) when the Holm-adjusted p < 0.05 with a
    positive mean shrink, "grows" when p < 0.05 with a negative one, and "stays" otherwise; it is
    exploratory (no verdict, counted in the correction as untested, p = 1) unless exactly `n`
    seeds pair and every run they pair names its code (`provenance.launch_reason`)."""
    baseline = description["baseline"]
    shortest, longest = description["scaling"][0], description["scaling"][-1]
    arms = [arm for arm in dict.fromkeys(studies.split_cell(c)[0] for c in description["cells"])
            if arm != baseline]
    rows = []
    for arm in arms:
        losses = {(cell_arm, size): seed_losses(results, f"{cell_arm}@{size}")
                  for cell_arm in (arm, baseline) for size in (shortest, longest)}
        seeds = sorted(set.intersection(*(set(runs) for runs in losses.values())))
        short = [losses[arm, shortest][s] - losses[baseline, shortest][s] for s in seeds]
        long = [losses[arm, longest][s] - losses[baseline, longest][s] for s in seeds]
        sign = -1.0 if short and np.mean(short) < 0 else 1.0
        mean, std, count = stats.mean_std([sign * (a - b) for a, b in zip(short, long,
                                                                            strict=True)])
        unnamed = sorted({f"{cell_arm}@{size}" for cell_arm in (arm, baseline)
                          for size in (shortest, longest) for seed in seeds
                          if provenance.launch_reason(
                              results[f"{cell_arm}@{size}"][seed].launches)})
        why = (f"{count} paired seeds, registered n = {n}" if count != n else
               f"runs of {', '.join(unnamed)} do not name their code (provenance)"
               if unnamed else "")
        rows.append(Trend(arm, mean, std, count, stats.t_interval(mean, std, count, stats.LEVEL),
                          stats.paired_p(mean, std, count), math.nan,
                          f"exploratory: {why}" if why else ""))
    untested = [math.nan if row.verdict else row.p for row in rows]
    for i, adjusted in enumerate(stats.holm(untested)):
        row = rows[i]
        if row.verdict:
            continue
        verdict = ("shrinks" if adjusted < 0.05 and row.mean > 0 else
                   "grows" if adjusted < 0.05 and row.mean < 0 else "stays")
        rows[i] = dataclasses.replace(row, adjusted_p=adjusted, verdict=verdict)
    return rows

def length_section(root: Path, description: dict,
                   results: dict[str, dict[int, Result]]) -> list[str]:
    """The report's section for a study over training lengths: a table of each length (steps,
    tokens, tokens per parameter, epochs) with Δ = arm − baseline [95% CI] (n) per arm, the
    trend test (`trends`) and the plot of Δ against training tokens (ROOT/delta_vs_tokens.png)."""
    baseline = description["baseline"]
    arms = [arm for arm in dict.fromkeys(studies.split_cell(c)[0] for c in description["cells"])
            if arm != baseline]
    found = {length.size: length for length in lengths(root, description)}
    deltas = {arm: length_deltas(results, description, arm) for arm in arms}
    lines = ["## Training length", "",
             "Per length: training tokens = steps × batch × sequence length, tokens per "
             "parameter of the baseline's model, epochs = steps × batch / the training split's "
             "windows. Δ = arm − baseline in final eval loss at that length, paired by seed, "
             "with its 95% t interval (n), and Δ relative to the baseline's mean loss there "
             "(a scale-free size: compare it, not Δ, with a paper's numbers in other units).",
             "",
             "| Length | Steps | Training tokens | Tokens/param | Epochs | "
             + " | ".join(f"{arm} Δ [95% CI] (n)" for arm in arms) + " |",
             "|---" * (5 + len(arms)) + "|"]
    for size in description["scaling"]:
        length = found.get(size)
        facts = (["—"] * 4 if length is None else
                 [str(length.steps), f"{length.tokens:,}", f"{length.tokens_per_parameter:.1f}",
                  "—" if math.isnan(length.epochs) else f"{length.epochs:.2f}"])
        base = stats.mean_std(list(seed_losses(results, f"{baseline}@{size}").values()))[0]
        lines.append(f"| {size} | " + " | ".join(facts + [
            interval_text(*deltas[arm][size]) + _relative(deltas[arm][size][0], base)
            for arm in arms]) + " |")
    n = max((claim.n for claim in description["claims"]), default=len(description["seeds"]))
    shortest, longest = description["scaling"][0], description["scaling"][-1]
    lines += ["", f"Trend, per arm: shrink = σ·(Δ at {shortest} − Δ at {longest}), paired by "
              f"seed, σ the sign of the mean Δ at {shortest} (shrink > 0: |Δ| is smaller at "
              f"{longest}). *shrinks* when the paired t-test's Holm-adjusted p (over the arms) "
              "< 0.05 with a positive mean shrink, *grows* when < 0.05 with a negative one, "
              f"*stays* otherwise; exploratory unless exactly n = {n} seeds have all four "
              "runs.", "",
              "| Arm | Shrink [95% CI] (n) | p | Holm p | Verdict |", "|---|---|---|---|---|"]
    for row in trends(results, description, n):
        lines.append(f"| {row.arm} | {interval_text(row.mean, row.std, row.n)} | {p_text(row.p)} | "
                     f"{p_text(row.adjusted_p)} | {row.verdict} |")
    plot_length(deltas, found, description, root / LENGTH_PLOT)
    return lines + ["", f"![Δ against training tokens]({LENGTH_PLOT})", ""]

def plot_length(deltas: dict[str, dict[str, tuple[float, float, int]]],
                found: dict[str, Length], description: dict, path: Path) -> None:
    """Δ = arm − baseline against training tokens (log x), each point with its 95% t interval,
    and the paper's Δ, where it gives one, as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paper, baseline = description["paper"], description["baseline"]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.axhline(0, color="grey", linewidth=0.8)
    for arm, by_size in deltas.items():
        points = [(found[size].tokens, mean, *stats.t_interval(mean, std, n, stats.LEVEL))
                  for size, (mean, std, n) in by_size.items() if size in found and n]
        if not points:
            continue
        tokens, means, lows, highs = np.array(points, dtype=float).T
        errors = np.nan_to_num(np.stack([means - lows, highs - means]))
        bars = axes.errorbar(tokens, means, yerr=errors, marker="o", capsize=4, label=arm)
        if arm in paper and baseline in paper:
            axes.axhline(paper[arm] - paper[baseline], color=bars[0].get_color(),
                         linestyle="--", linewidth=0.8, label=f"{arm}: paper Δ")
    axes.set(xscale="log", xlabel="training tokens", ylabel="Δ final eval loss vs baseline",
             title="Δ against training length (95% t intervals over seeds)")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
