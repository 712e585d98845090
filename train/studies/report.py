"""The report of a study sweep (docs/studies.md): `write_report(ROOT, describe(ROOT, STUDY))`
(the command line: scripts/study_report.py).

Reads ROOT/study.json (written by scripts/sweep.py: the study, scale, cells, seeds, baseline
and paper numbers) and every run directory ROOT/<cell>/seed<k>, and writes:

- ROOT/report.md: per cell, the final validation loss (the run's last `eval_loss`) as mean ±
  sample std over its finished seeds (n shown), the paired difference to the baseline over the
  seeds both finished, and the paper's number (with its difference to the paper's baseline
  when the paper gives one); for a scaling study, per arm the power law L = a·C^(−b) of final
  loss against training compute C (FLOPs: `arch.accounting.flops_per_token(model, seq_len,
  training=True)` × steps × batch_size × seq_len, from each run's config.json) and the
  compute multiplier at matched loss vs the baseline at the arm's largest compute, with a 95%
  bootstrap interval over seeds (`train.studies.stats`); each of the study's registered CLAIMS
  tested on the paired seeds, Holm-corrected within its family, or marked exploratory with
  the reason (`assess_claims`, `claims_table`); and a section listing the runs that are
  missing, unfinished or without an eval_loss;
- with a learning rate per arm (`train.studies.tuning`): each cell's tuning grid from
  ROOT/tuning.json (each rate's tuning loss, the pick, whether it is interior), and when the
  tuned-rate sweep ROOT/tuned has a study.json, the shared-rate and tuned-rate final losses
  and claims side by side (`tuning_section`);
- ROOT/loss_curves.png: eval_loss against step per cell, mean ± std over seeds;
- ROOT/loss_vs_compute.png (scaling studies): final loss against compute, log-log, with fits;
- for an IsoFLOP study (`train.studies.study.is_isoflop`: sizes `c<BUDGET>-<SHAPE>`), in place
  of the scaling section: per budget and arm the minimum (N*, L*) of a parabola of final loss
  in ln N, each arm's frontier L*(C) = a·C^(−b), the compute multiplier at matched loss with
  its bootstrap interval and the registered compute-multiplier claims' verdicts
  (`isoflop_section`), and ROOT/isoflop.png, the profiles and the frontiers;
- for a study over training lengths (`SCALING_AXIS = "steps"`): per length its steps,
  training tokens, tokens per parameter and epochs over the training split, Δ = arm − baseline
  per length with its 95% t interval, the registered trend test between the shortest and the
  longest length (`length_section`), and ROOT/delta_vs_tokens.png, Δ against training tokens.

Each kind of section lives in its own module, which this one assembles: `results` (the runs
read, `collect`), `claims_report`, `tuning_report`, `scaling_report` (power laws and training
lengths) and `isoflop_report`; `power_plan` adds each claim's power plan, and the accuracy of
runs scored by scripts/evaluate.py is tabled beside the loss (`accuracy_section`).

`describe`'s study file, when given, stands in for a ROOT without study.json (its first scale,
every cell, its SEEDS), or gives newer declarations (baseline, paper numbers, claims) than those
recorded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from config.cli import UsageError
from train.studies import power_plan, stats
from train.studies import study as studies
from train.studies.claims_report import (  # noqa: F401  (the report's API: tests, scripts)
    ClaimResult,
    assess_claims,
    claims_table,
    provenance_section,
)
from train.studies.isoflop_report import isoflop_section
from train.studies.results import (  # noqa: F401  (the report's API: tests, scripts)
    Result,
    baseline_cell,
    collect,
    final_losses,
    interval_text,
    read_accuracy,
    training_flops,
    value_text,
)
from train.studies.scaling_report import (
    SCALING_PLOT,
    length_section,
    plot_scaling,
    scaling_table,
)
from train.studies.tuning_report import grid_table, regimes_table, tuning_section  # noqa: F401

REPORT, CURVES = "report.md", "loss_curves.png"


def accuracy_section(results: dict[str, dict[int, Result]], description: dict) -> list[str]:
    """Per task that some run was scored on (`scripts/evaluate.py`): each cell's accuracy and
    length-normalized accuracy, mean ± std over its scored seeds (n), and the paired difference
    to the baseline with its 95% t interval; the runs' results must share the task's SHA-256
    (else that task is listed as mixed and not tabled)."""
    found = sorted({task for runs in results.values() for run in runs.values()
                    for task in run.accuracy})
    if not found:
        return []
    lines = ["## Accuracy", "",
             "Multiple-choice accuracy by log-likelihood (`scripts/evaluate.py`, lm-eval-harness's "
             "acc and acc_norm), beside the loss above: per cell the mean ± std over its scored "
             "seeds (n), and Δ = arm − baseline paired by seed with its 95% t interval, in "
             "accuracy points.", ""]
    for task in found:
        scored = {cell: {seed: run.accuracy[task] for seed, run in runs.items()
                         if task in run.accuracy} for cell, runs in results.items()}
        digests = {r["sha256"] for runs in scored.values() for r in runs.values()}
        if len(digests) > 1:
            lines += [f"`{task}`: the runs were scored on {len(digests)} versions of the task "
                      "file; rescore them on one.", ""]
            continue
        some = next(r for runs in scored.values() for r in runs.values())
        lines += [f"`{task}`: {some['items']} items, chance {some['chance']:.4f}.", "",
                  "| Arm | n | acc | Δ acc vs baseline [95% CI] | acc_norm | "
                  "Δ acc_norm vs baseline [95% CI] |", "|---|---|---|---|---|---|"]
        for cell, runs in scored.items():
            reference = scored.get(baseline_cell(cell, description["baseline"]), {})
            row = [cell, str(len(runs))]
            for key in ("acc", "acc_norm"):
                row.append(value_text(*stats.mean_std([r[key] for r in runs.values()])))
                mean, std, n = stats.paired_difference(
                    {s: r[key] for s, r in runs.items()},
                    {s: r[key] for s, r in reference.items()})
                row.append("(baseline)" if runs is reference else interval_text(mean, std, n))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return lines

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
        reference = baseline_cell(cell, baseline)
        if cell == reference:
            difference, name = "(baseline)", f"{cell} (baseline)"
        else:
            d_mean, d_std, d_n = stats.paired_difference(
                {s: r.loss for s, r in runs.items()},
                {s: r.loss for s, r in results.get(reference, {}).items()})
            difference = f"{value_text(d_mean, d_std, d_n)} ({d_n})" if d_n else "— (0)"
            name = cell
        row = f"| {name} | {n} | {value_text(mean, std, n)} | {difference} |"
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

def plot_curves(results: dict[str, dict[int, Result]], path: Path) -> None:
    """eval_loss against step per cell: the mean over seeds at the steps every seed evaluated,
    with a ± std band. One colour per arm; an arm's sizes (cells `ARM@SIZE`) differ by line
    style."""
    import matplotlib  # heavy, and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm: dict[str, list[str]] = {}
    for cell in results:
        by_arm.setdefault(cell.partition("@")[0], []).append(cell)
    colours = {arm: f"C{i % 10}" for i, arm in enumerate(by_arm)}
    styles = ("-", "--", "-.", ":")
    figure, axes = plt.subplots(figsize=(8.5, 4.5))
    for cell, runs in results.items():
        if not runs:
            continue
        arm = cell.partition("@")[0]
        look = {"color": colours[arm],
                "linestyle": styles[by_arm[arm].index(cell) % len(styles)]}
        curves = [dict(r.curve) for r in runs.values()]
        steps = sorted(set.intersection(*(set(curve) for curve in curves)))
        if not steps:
            continue
        losses = np.array([[curve[step] for step in steps] for curve in curves])
        mean = losses.mean(axis=0)
        std = losses.std(axis=0, ddof=1) if len(curves) > 1 else np.zeros_like(mean)
        label = f"{cell} (n={len(runs)})"
        if len(steps) == 1:  # one evaluation (the final step): an error bar, not a band
            axes.errorbar(steps, mean, yerr=std, marker="o", capsize=4, label=label, **look)
            continue
        axes.plot(steps, mean, marker="o", markersize=3, label=label, **look)
        axes.fill_between(steps, mean - std, mean + std, color=look["color"], alpha=0.15)
    axes.set(xlabel="step", ylabel="eval loss", title="Validation loss (mean ± std over seeds)")
    axes.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
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
                   "claims": [], "numerics_since": "", **(recorded or {})}
    if study_path is None:
        lacking = [key for key in ("study", "scale", "baseline", "cells", "seeds")
                   if key not in description]
        if lacking:
            raise UsageError(f"--root={root}: {studies.RECORD} lacks {lacking[0]!r}; pass "
                             "--study experiments/STUDY.py")
        description["claims"] = list(studies.claims_from_record(root, description))
    else:
        study = studies.load_study(study_path)
        description.update(study=study.path, baseline=study.baseline, paper=study.paper,
                           paper_metric=study.paper_metric, scaling=list(study.scaling),
                           claims=list(study.claims), numerics_since=study.numerics_since,
                           registered=study.registered)
        if study.scaling_axis != "model":
            description["scaling_axis"] = study.scaling_axis
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
    lines += accuracy_section(results, description)
    if any(claim.metric not in studies.MULTIPLIERS for claim in description["claims"]):
        boundary, registered = description["numerics_since"], description.get("registered", "")
        lines += ["## Registered claims", "",
                  "Each claim as registered in the study file: Δ = arm − "
                  "reference in final eval loss, paired by seed, with its 95% t interval; `<` "
                  "claims Δ < 0 (the arm ends lower, better), `>` Δ > 0, `≈` |Δ| < margin. p "
                  "is the paired t-test of Δ = 0 for a direction (two-sided, or one-sided "
                  "toward the claimed side where the check says so), and for an "
                  "equivalence the TOST, max(P(T ≥ (Δ̄ + margin)/s), P(T ≤ (Δ̄ − margin)/s)) "
                  "with s = std/√n on n − 1 degrees of freedom. Holm p: Holm's step-down "
                  "adjustment over all the family's claims, p_(i) adjusted = "
                  "max_{j≤i} min(1, (m − j + 1)·p_(j)). Verdicts at 5%: a direction *agrees* "
                  "(*disagrees*) when the Holm p < 0.05 with Δ on the claimed (other) side; an "
                  "equivalence *agrees* when the Holm p < 0.05 and *disagrees* when the 95% "
                  "interval lies wholly outside [−margin, margin]; otherwise *inconclusive*. "
                  "A claim is *exploratory* (its reason shown; in the correction as untested, "
                  "p = 1) when an arm has a finished-seed count other than the registered n"
                  + (f", or a run of its arms is not known to have trained at code from "
                     f"NUMERICS_SINCE {boundary} (provenance.jsonl)" if boundary else "")
                  + (f", or a run of its arms was first launched before the claims were "
                     f"registered (REGISTERED {registered}: post hoc)" if registered else "")
                  + ".", ""]
        lines += claims_table(results, description["claims"], boundary, registered) + [""]
        lines += power_plan.plan_section(final_losses(results), description["claims"],
                                         description["paper"])
    lines += tuning_section(root, description, results)
    if studies.is_isoflop(description["scaling"]):
        lines += isoflop_section(root, description, results, arms)
    elif description["scaling"]:
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
    if description.get("scaling_axis") == "steps":
        lines += length_section(root, description, results)
    lines += provenance_section(results)
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
