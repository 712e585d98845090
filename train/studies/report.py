"""The report of a study sweep (docs/studies.md).

    python scripts/study_report.py --root runs/STUDY [--study experiments/STUDY.py]

Reads ROOT/study.json (written by scripts/sweep.py: the study, scale, cells, seeds, baseline
and paper numbers) and every run directory ROOT/<cell>/seed<k>, and writes:

- ROOT/report.md: per cell, the final validation loss (the run's last `eval_loss`) as mean ±
  sample std over its finished seeds (n shown), the paired difference to the baseline over the
  seeds both finished, and the paper's number (with its difference to the paper's baseline
  when the paper gives one); for a scaling study, per arm the power law L = a·C^(−b) of final
  loss against training compute C (FLOPs: `arch.accounting.flops_per_token(model, seq_len,
  training=True)` × steps × batch_size × seq_len, from each run's config.json) and the
  compute multiplier at matched loss vs the baseline at the arm's largest compute, with a 95%
  bootstrap interval over seeds (`train.studies.stats`); each of the study's CLAIMS checked on
  the paired seeds (`claims_table`); and a section listing the runs that
  are missing, unfinished or without an eval_loss;
- ROOT/loss_curves.png: eval_loss against step per cell, mean ± std over seeds;
- ROOT/loss_vs_compute.png (scaling studies): final loss against compute, log-log, with fits.

`--study` gives the study file when ROOT has no study.json (its first scale, every cell, its
SEEDS), or newer declarations (baseline, paper numbers) than those recorded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import ml_collections
import numpy as np

from arch.accounting import flops_per_token
from config.cli import ArgumentParser, UsageError
from config.defaults import base_config
from train import rundir
from train.studies import stats
from train.studies import study as studies

REPORT, CURVES, SCALING_PLOT = "report.md", "loss_curves.png", "loss_vs_compute.png"


@dataclasses.dataclass
class Result:
    """A finished run: its final eval_loss, (step, eval_loss) curve and training FLOPs."""

    loss: float
    curve: list[tuple[int, float]]
    compute: float | None


def training_flops(workdir: str | Path) -> float:
    """Training FLOPs of the run in `workdir`: FLOPs per token of its resolved model (its
    config.json over the current defaults) × steps × batch_size × seq_len."""
    defaults = json.loads(base_config().to_json_best_effort())
    config = ml_collections.ConfigDict(rundir.saved_config(workdir, defaults))
    tokens = config.steps * config.batch_size * config.seq_len
    return flops_per_token(config.model, config.seq_len, training=True) * tokens


def collect(root: str | Path, description: dict) -> tuple[dict[str, dict[int, Result]], list]:
    """({cell: {seed: Result}} of the finished runs, [(cell, seed, why)] of the others)."""
    results: dict[str, dict[int, Result]] = {}
    missing = []
    for cell in description["cells"]:
        results[cell] = {}
        for seed in description["seeds"]:
            workdir = studies.run_dir(root, cell, seed)
            state, loss = studies.run_state(workdir)
            if state != "finished":
                log = studies.last_line(workdir / "train.log")
                missing.append((cell, seed, f"{state}: {log}" if log else state))
                continue
            records = studies.read_metrics(workdir)
            curve = [(r["step"], float(r["eval_loss"])) for r in records
                     if r.get("eval_loss") is not None]
            compute = None
            if description["scaling"]:
                try:
                    compute = training_flops(workdir)
                except (ValueError, KeyError, TypeError) as error:
                    missing.append((cell, seed, f"no FLOPs count ({error})"))
                    continue
            results[cell][seed] = Result(loss, curve, compute)
    return results, missing


def _value(mean: float, std: float, n: int, digits: int = 4) -> str:
    """`mean ± std` to `digits` decimals; `—` for a std of one value and for no values."""
    if n == 0:
        return "—"
    spread = f"{std:.{digits}f}" if math.isfinite(std) else "—"
    return f"{mean:.{digits}f} ± {spread}"


def _baseline_cell(cell: str, baseline: str) -> str:
    """The cell `cell` is compared with: the baseline arm (at the same size)."""
    _, size = studies.split_cell(cell)
    return f"{baseline}@{size}" if size else baseline


def loss_table(results: dict[str, dict[int, Result]], description: dict) -> list[str]:
    """The Markdown table of final losses per cell, with each seed's loss in the last column."""
    baseline, paper = description["baseline"], description["paper"]
    show_paper = bool(paper) and not description["scaling"]
    paper_difference = show_paper and baseline in paper  # the paper's Δ beside ours
    header = "| Arm | n | Final eval loss | Δ vs baseline (n) |"
    rule = "|---|---|---|---|"
    if description["scaling"]:
        header, rule = header + " Training FLOPs |", rule + "---|"
    if show_paper:
        header, rule = header + f" Paper ({description['paper_metric']}) |", rule + "---|"
    if paper_difference:
        header, rule = header + " Paper Δ |", rule + "---|"
    header, rule = header + " Per seed |", rule + "---|"
    lines = [header, rule]
    for cell, runs in results.items():
        arm, _ = studies.split_cell(cell)
        mean, std, n = stats.mean_std([r.loss for r in runs.values()])
        reference = _baseline_cell(cell, baseline)
        if cell == reference:
            difference, name = "(baseline)", f"{cell} (baseline)"
        else:
            d_mean, d_std, d_n = stats.paired_difference(
                {s: r.loss for s, r in runs.items()},
                {s: r.loss for s, r in results.get(reference, {}).items()})
            difference = f"{_value(d_mean, d_std, d_n)} ({d_n})" if d_n else "— (0)"
            name = cell
        row = f"| {name} | {n} | {_value(mean, std, n)} | {difference} |"
        if description["scaling"]:
            computes = [r.compute for r in runs.values()]
            row += f" {np.mean(computes):.3g} |" if computes else " — |"
        if show_paper:
            row += f" {paper[arm]:g} |" if arm in paper else " — |"
        if paper_difference:
            row += (" (baseline) |" if arm == baseline else
                    f" {paper[arm] - paper[baseline]:+.3f} |" if arm in paper else " — |")
        row += " " + (", ".join(f"{seed}: {runs[seed].loss:.4f}" for seed in sorted(runs))
                      or "—") + " |"
        lines.append(row)
    return lines


def claims_table(results: dict[str, dict[int, Result]], claims: list) -> list[str]:
    """The Markdown table checking each (arm, relation, reference, text) claim on the paired
    seeds: Δ = arm − reference, mean ± std (n), how many seeds have the claimed sign, the
    paired t-test's p and the verdict of `stats.claim_verdict`."""
    lines = ["| Claim (the paper's words) | Check | Δ = arm − reference, paired (n) | "
             "Seeds agreeing | p | Measured |", "|---|---|---|---|---|---|"]
    for arm, relation, reference, text in claims:
        losses = [{s: r.loss for s, r in results.get(cell, {}).items()}
                  for cell in (arm, reference)]
        mean, std, n = stats.paired_difference(*losses)
        difference = f"{_value(mean, std, n)} ({n})" if n else "— (0)"
        agreeing = f"{stats.agreeing_seeds(*losses, relation)} of {n}" if n else "—"
        p = stats.paired_p(mean, std, n)
        lines.append(f"| {text} | {arm} {relation} {reference} | {difference} | {agreeing} | "
                     f"{'—' if math.isnan(p) else f'{p:.3f}'} | "
                     f"{stats.claim_verdict(mean, std, n, relation)} |")
    return lines


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


def plot_curves(results: dict[str, dict[int, Result]], path: Path) -> None:
    """eval_loss against step per cell: the mean over seeds at the steps every seed evaluated,
    with a ± std band."""
    import matplotlib  # heavy, and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for cell, runs in results.items():
        if not runs:
            continue
        curves = [dict(r.curve) for r in runs.values()]
        steps = sorted(set.intersection(*(set(curve) for curve in curves)))
        if not steps:
            continue
        losses = np.array([[curve[step] for step in steps] for curve in curves])
        mean = losses.mean(axis=0)
        std = losses.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
        label = f"{cell} (n={len(runs)})"
        if len(steps) == 1:  # one evaluation (the final step): an error bar, not a band
            axes.errorbar(steps, mean, yerr=std, marker="o", capsize=4, label=label)
            continue
        line, = axes.plot(steps, mean, marker="o", markersize=3, label=label)
        axes.fill_between(steps, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    axes.set(xlabel="step", ylabel="eval loss", title="Validation loss (mean ± std over seeds)")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


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


def describe(root: str | Path, study_path: str | None) -> dict:
    """What the report covers: ROOT/study.json, with the declarations of `study_path` (when
    given) taking the place of those recorded; without a record, the study's defaults."""
    recorded = studies.read_record(root)
    if recorded is None and study_path is None:
        raise UsageError(f"--root={root} has no {studies.RECORD} (scripts/sweep.py writes it); "
                         "pass --study experiments/STUDY.py")
    description = {"paper": {}, "paper_metric": "", "scaling": [], "overrides": [],
                   "claims": [], **(recorded or {})}
    if study_path is None:
        lacking = [key for key in ("study", "scale", "baseline", "cells", "seeds")
                   if key not in description]
        if lacking:
            raise UsageError(f"--root={root}: {studies.RECORD} lacks {lacking[0]!r}; pass "
                             "--study experiments/STUDY.py")
    else:
        study = studies.load_study(study_path)
        description.update(study=study.path, baseline=study.baseline, paper=study.paper,
                           paper_metric=study.paper_metric, scaling=list(study.scaling),
                           claims=[list(claim) for claim in study.claims])
        description.setdefault("scale", study.scales[0])
        description.setdefault("cells", study.cells())
        description.setdefault("seeds", list(study.seeds))
    return description


def write_report(root: str | Path, description: dict) -> Path:
    """Write ROOT/report.md and its plots; returns the report's path."""
    root = Path(root)
    results, missing = collect(root, description)
    arms = list(dict.fromkeys(studies.split_cell(cell)[0] for cell in description["cells"]))
    overrides = " ".join(description.get("overrides", [])) or "none"
    lines = [f"# Study report: {description['study']}", "",
             f"Scale `{description['scale']}`; baseline `{description['baseline']}`; seeds "
             f"{', '.join(map(str, description['seeds']))}; overrides: `{overrides}`.", "",
             "Final eval loss: each run's last `eval_loss`, mean ± sample std (ddof=1) over its "
             "finished seeds (n). Δ vs baseline: the arm's loss minus the baseline's"
             + (" at the same size" if description["scaling"] else "")
             + ", paired by seed over the seeds both finished, mean ± std (n).", ""]
    lines += loss_table(results, description)
    plot_curves(results, root / CURVES)
    lines += ["", f"![Validation loss curves]({CURVES})", ""]
    if description["claims"]:
        lines += ["## The paper's claims", "",
                  "Each claim as a check on final eval loss: `<` the arm ends lower (better) "
                  "than the reference, `>` higher (worse). Δ is paired by seed; p is the two-sided "
                  "p-value of a paired t-test of a zero mean (n − 1 degrees of freedom). "
                  "*agrees* (*disagrees*): p < 0.05 with the mean on the claimed (other) side "
                  "of zero; *unresolved* otherwise, with the side the mean leans to.", ""]
        lines += claims_table(results, description["claims"]) + [""]
    if description["scaling"]:
        table, fits = scaling_table(results, description, arms)
        lines += ["## Scaling", "",
                  "Power law L = a·C^(−b) (no irreducible term) fitted by least squares in "
                  "log-log to every finished run's (training FLOPs C, final eval loss). The "
                  "compute multiplier is how many times the arm's compute the baseline needs to "
                  "reach the arm's loss, at the arm's largest compute; the interval is the "
                  "2.5–97.5 percentile of 1000 refits resampling each size's seeds with "
                  "replacement.", ""] + table
        plot_scaling(results, fits, arms, root / SCALING_PLOT)
        lines += ["", f"![Loss against compute]({SCALING_PLOT})", ""]
    lines += ["## Missing runs", ""]
    if missing:
        lines += ["Left out of the statistics above:", "", "| Arm | Seed | State |",
                  "|---|---|---|"]
        lines += [f"| {cell} | {seed} | {why.replace('|', '/')} |" for cell, seed, why in missing]
    else:
        lines.append("None: every run finished.")
    path = root / REPORT
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); returns the exit status."""
    parser = ArgumentParser("python scripts/study_report.py", __doc__)
    parser.add_argument("--root", required=True, metavar="DIR", help="the sweep's directory")
    parser.add_argument("--study", metavar="PATH", help="the study file (default: study.json's)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not Path(args.root).is_dir():
        parser.error(f"--root={args.root} is not a directory; pass a sweep's --root")
    try:
        description = describe(args.root, args.study)
    except UsageError as error:
        parser.error(str(error))
    print(f"wrote {write_report(args.root, description)}")
    return 0
