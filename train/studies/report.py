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

`describe`'s study file, when given, stands in for a ROOT without study.json (its first scale,
every cell, its SEEDS), or gives newer declarations (baseline, paper numbers, claims) than those
recorded.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import ml_collections
import numpy as np

from arch.accounting import flops_per_token, parameter_count
from config.cli import UsageError
from config.defaults import base_config
from train import rundir
from train.data import in_memory
from train.studies import power_plan, provenance, stats, tuning
from train.studies import study as studies

REPORT, CURVES, SCALING_PLOT = "report.md", "loss_curves.png", "loss_vs_compute.png"
ISOFLOP_PLOT = "isoflop.png"
LENGTH_PLOT = "delta_vs_tokens.png"


@dataclasses.dataclass
class Result:
    """A finished run: its final eval_loss, (step, eval_loss) curve, training FLOPs, the
    provenance of its launches (`train.studies.provenance`) and its multiple-choice results
    (`scripts/evaluate.py`'s WORKDIR/eval_<task>.json)."""

    loss: float
    curve: list[tuple[int, float]]
    compute: float | None
    launches: list[dict] = dataclasses.field(default_factory=list)
    accuracy: dict[str, dict] = dataclasses.field(default_factory=dict)  # task → eval_<task>.json


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
            results[cell][seed] = Result(loss, curve, compute, provenance.read(workdir),
                                         read_accuracy(workdir))
    return results, missing


def read_accuracy(workdir: Path) -> dict[str, dict]:
    """task → the run's `scripts/evaluate.py` result (WORKDIR/eval_<task>.json); a file that
    does not parse is left out."""
    found = {}
    for path in sorted(workdir.glob("eval_*.json")):
        try:
            result = json.loads(path.read_text())
            found[result["task"]] = result
        except (json.JSONDecodeError, KeyError, TypeError, OSError):
            continue
    return found


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
            reference = scored.get(_baseline_cell(cell, description["baseline"]), {})
            row = [cell, str(len(runs))]
            for key in ("acc", "acc_norm"):
                row.append(_value(*stats.mean_std([r[key] for r in runs.values()])))
                mean, std, n = stats.paired_difference(
                    {s: r[key] for s, r in runs.items()},
                    {s: r[key] for s, r in reference.items()})
                row.append("(baseline)" if runs is reference else _interval(mean, std, n))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    return lines


def final_losses(results: dict[str, dict[int, Result]]) -> dict[str, dict[int, float]]:
    """cell → seed → final eval loss of the finished runs."""
    return {cell: {seed: run.loss for seed, run in runs.items()}
            for cell, runs in results.items()}


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


@dataclasses.dataclass(frozen=True)
class ClaimResult:
    """A claim tested on the paired seeds: Δ = arm − reference (mean, std, n seeds, the 95% t
    interval), how many seeds agree (the claimed sign; |Δ| < margin for "≈"), the raw p (a
    two-sided paired t-test, or the TOST), the Holm-adjusted p within the family (nan for an
    exploratory claim), the verdict, and why the claim is exploratory ("" if confirmatory)."""

    claim: studies.Claim
    mean: float
    std: float
    n: int
    interval: tuple[float, float]
    agreeing: int
    p: float
    adjusted_p: float
    verdict: str
    exploratory: str


def _seed_list(seeds: list[int]) -> str:
    """`0, 1, 2`."""
    return ", ".join(map(str, sorted(seeds)))


def _exploratory(claim: studies.Claim, losses: list[dict[int, float]],
                 numerics: dict[tuple[str, int], str | None], boundary: str,
                 post_hoc: dict[tuple[str, int], str | None], registered: str,
                 launched: dict[tuple[str, int], str | None]) -> str:
    """Why `claim` is exploratory ("" when it is not): an arm whose finished-seed count is not
    the registered n, arms that do not share their seeds, runs not known to have trained at
    code from the study's NUMERICS_SINCE, runs launched before its REGISTERED time, or runs
    whose provenance does not name their code (`provenance.launch_reason`)."""
    reasons = [f"{cell} has {len(runs)} finished seeds, registered n = {claim.n}"
               for cell, runs in zip((claim.arm, claim.reference), losses, strict=True)
               if len(runs) != claim.n]
    shared = losses[0].keys() & losses[1].keys()
    if not reasons and len(shared) != claim.n:
        reasons.append(f"{claim.arm} and {claim.reference} share {len(shared)} of their "
                       f"{claim.n} seeds")
    for rule, label in ((numerics, f"NUMERICS_SINCE {boundary[:7]}"),
                        (post_hoc, f"REGISTERED {registered}"), (launched, "provenance")):
        if not rule:
            continue
        stale: dict[tuple[str, str], list[int]] = {}
        for cell, runs in zip((claim.arm, claim.reference), losses, strict=True):
            for seed in runs:
                why = rule[cell, seed]
                if why:
                    stale.setdefault((cell, why), []).append(seed)
        reasons += [f"{cell} seeds {_seed_list(seeds)}: {why} ({label})"
                    for (cell, why), seeds in stale.items()]
    return "; ".join(reasons)


def assess_claims(results: dict[str, dict[int, Result]], claims: list[studies.Claim],
                  numerics_since: str = "", registered: str = "") -> list[ClaimResult]:
    """Each claim tested on the seeds both arms finished (`ClaimResult`), in the given order.

    A claim is exploratory when an arm's finished-seed count is not the registered n, when the
    arms do not share all n seeds, (with `numerics_since`) when a run of its arms has no
    provenance or trained at a commit that does not descend from that one, (with
    `registered`) when a run of its arms was first launched before that time, or when a run of
    its arms was launched from a dirty tree or at a commit that is not an ancestor of HEAD; it is
    reported with the reason and no verdict. The claims of a family share one Holm adjustment
    (`stats.holm`) of their raw p: the paired t-test (`stats.paired_p`, two-sided or one-sided
    as the claim registers) for a direction, the TOST
    (`stats.tost_p`) for an equivalence; an exploratory claim counts in it as untested (p = 1),
    so the family's other verdicts never get easier while some of its claims wait for runs.
    Compute-multiplier claims are left out: `isoflop_section` assesses them."""
    claims = [claim for claim in claims if claim.metric not in studies.MULTIPLIERS]
    def per_run(reason) -> dict[tuple[str, int], str | None]:
        return {(cell, seed): reason(run.launches) for claim in claims
                for cell in (claim.arm, claim.reference)
                for seed, run in results.get(cell, {}).items()}

    numerics = per_run(lambda launches: provenance.numerics_reason(
        launches, numerics_since)) if numerics_since else {}
    post_hoc = per_run(lambda launches: provenance.registration_reason(
        launches, registered)) if registered else {}
    launched = per_run(provenance.launch_reason)
    rows = []
    for claim in claims:
        losses = [{s: r.loss for s, r in results.get(cell, {}).items()}
                  for cell in (claim.arm, claim.reference)]
        mean, std, n = stats.paired_difference(*losses)
        differences = [losses[0][s] - losses[1][s] for s in losses[0].keys() & losses[1].keys()]
        if claim.relation == "≈":
            p = stats.tost_p(mean, std, n, claim.margin)
            agreeing = sum(abs(d) < claim.margin for d in differences)
        else:
            p = stats.paired_p(mean, std, n, claim.relation if claim.tails == 1 else None)
            agreeing = sum(d < 0 if claim.relation == "<" else d > 0 for d in differences)
        rows.append(ClaimResult(claim, mean, std, n, stats.t_interval(mean, std, n, stats.LEVEL),
                                agreeing, p, math.nan, "",
                                _exploratory(claim, losses, numerics, numerics_since,
                                             post_hoc, registered, launched)))
    for family in dict.fromkeys(row.claim.family for row in rows):
        members = [i for i, row in enumerate(rows) if row.claim.family == family]
        untested = [math.nan if rows[i].exploratory else rows[i].p for i in members]
        for i, adjusted in zip(members, stats.holm(untested), strict=True):
            row = rows[i]
            if row.exploratory:
                continue
            verdict = stats.claim_verdict(row.claim.relation, row.mean, row.interval, adjusted,
                                          row.claim.margin, row.claim.tails)
            rows[i] = dataclasses.replace(row, adjusted_p=adjusted, verdict=verdict)
    return [row if not row.exploratory else dataclasses.replace(row, verdict="exploratory")
            for row in rows]


def provenance_section(results: dict[str, dict[int, Result]]) -> list[str]:
    """The "Provenance" section: the finished runs whose launches do not name the code that
    trained them (`provenance.launch_reason`: a dirty tree, a commit that is not an ancestor of
    HEAD), and those without a provenance record."""
    failing = [(cell, seed, why) for cell, runs in results.items()
               for seed, run in sorted(runs.items())
               if (why := provenance.launch_reason(run.launches))]
    unrecorded = [f"{cell}/seed{seed}" for cell, runs in results.items()
                  for seed, run in sorted(runs.items()) if not run.launches]
    lines = ["## Provenance", "",
             "Each run's launches (provenance.jsonl) checked against this checkout: a run "
             "launched from a dirty tree, or at a commit that is not an ancestor of HEAD, does "
             "not name the code that trained it, so no claim counts it as confirmatory.", ""]
    if failing:
        lines += ["| Arm | Seed | Why |", "|---|---|---|"]
        lines += [f"| {cell} | {seed} | {why} |" for cell, seed, why in failing]
    else:
        lines.append("Every run with a record names a clean commit that HEAD descends from.")
    if unrecorded:
        lines += ["", f"Without a provenance record ({len(unrecorded)}): "
                  f"{', '.join(unrecorded)}."]
    return lines + [""]


def _p(p: float) -> str:
    return "—" if math.isnan(p) else "< 0.001" if p < 0.001 else f"{p:.3f}"


def claims_table(results: dict[str, dict[int, Result]], claims: list[studies.Claim],
                 numerics_since: str = "", registered: str = "") -> list[str]:
    """The Markdown table of `assess_claims`, family by family (in order of first mention):
    the claim, its source, the check, n registered / paired, Δ [95% CI], the seeds agreeing,
    the raw and the Holm-adjusted p, and the verdict (or "exploratory: why")."""
    rows = assess_claims(results, claims, numerics_since, registered)
    lines = ["| Family | Claim | Source | Check | n (registered / paired) | "
             "Δ = arm − reference [95% CI] | Seeds agreeing | p | Holm p | Verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for family in dict.fromkeys(row.claim.family for row in rows):
        for row in rows:
            if row.claim.family != family:
                continue
            claim = row.claim
            low, high = row.interval
            difference = ("—" if row.n == 0 else f"{row.mean:+.4f}" if row.n == 1 else
                          f"{row.mean:+.4f} [{low:+.4f}, {high:+.4f}]")
            verdict = f"exploratory: {row.exploratory}" if row.exploratory else row.verdict
            cells = [family, claim.quote, claim.source, claim.check(), f"{claim.n} / {row.n}",
                     difference, f"{row.agreeing} of {row.n}" if row.n else "—", _p(row.p),
                     _p(row.adjusted_p), verdict]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def grid_table(record: dict) -> list[str]:
    """The Markdown table of each cell's tuning grid (ROOT/tuning.json): every rate with its
    tuning loss (— for a run that did not finish, the pick in bold), the pick, whether it is
    interior, and the shared rate."""
    lines = ["| Arm | Tuning loss per learning rate | Pick | Interior | Shared rate |",
             "|---|---|---|---|---|"]
    for cell, entry in record["cells"].items():
        rates = []
        for row in entry["grid"]:
            text = f"{row['rate']:g}: " + ("—" if row["loss"] is None else f"{row['loss']:.4f}")
            rates.append(f"**{text}**" if row["rate"] == entry["pick"] else text)
        pick = "—" if entry["pick"] is None else f"{entry['pick']:g}"
        interior = "yes" if entry["interior"] else \
            f"no: at an edge after {entry['extensions']} extensions"
        lines.append(f"| {cell} | {', '.join(rates)} | {pick} | {interior} | "
                     f"{entry['shared_rate']:g} |")
    return lines


def _claim_cells(row: ClaimResult) -> str:
    """`Δ [CI], Holm p, verdict` of a claim in one regime."""
    low, high = row.interval
    difference = ("—" if row.n == 0 else f"{row.mean:+.4f}" if row.n == 1 else
                  f"{row.mean:+.4f} [{low:+.4f}, {high:+.4f}]")
    verdict = f"exploratory: {row.exploratory}" if row.exploratory else row.verdict
    return f"{difference} | {_p(row.adjusted_p)} | {verdict}"


def _rate(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:g}"


def _losses(runs: dict[int, Result]) -> str:
    """`mean ± std (n)` of the final losses of a cell's finished runs."""
    mean, std, n = stats.mean_std([r.loss for r in runs.values()])
    return f"{_value(mean, std, n)} ({n})"


def regimes_table(shared: dict[str, dict[int, Result]], tuned: dict[str, dict[int, Result]],
                  rates: dict[str, dict], claims: list[studies.Claim],
                  numerics_since: str = "", registered: str = "") -> list[str]:
    """The shared-rate and tuned-rate sweeps side by side: per cell its rate and final loss in
    each; then per claim (`assess_claims` in each regime) Δ [95% CI], the Holm p and the
    verdict in each."""
    lines = ["| Arm | Shared rate | Final eval loss (n) | Tuned rate | Final eval loss (n) |",
             "|---|---|---|---|---|"]
    for cell in dict.fromkeys([*shared, *tuned]):
        entry = rates.get(cell, {})
        row = [cell, _rate(entry.get("shared_rate")), _losses(shared.get(cell, {})),
               _rate(entry.get("pick")), _losses(tuned.get(cell, {}))]
        lines.append("| " + " | ".join(row) + " |")
    if claims:
        lines += ["", "| Claim | Check | Shared rate: Δ [95% CI] | Holm p | Verdict | "
                  "Tuned rate: Δ [95% CI] | Holm p | Verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        pairs = zip(assess_claims(shared, claims, numerics_since, registered),
                    assess_claims(tuned, claims, numerics_since, registered), strict=True)
        for at_shared, at_tuned in pairs:
            cells = [at_shared.claim.quote.replace("|", "\\|"), at_shared.claim.check(),
                     _claim_cells(at_shared), _claim_cells(at_tuned)]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def tuning_section(root: Path, description: dict,
                   results: dict[str, dict[int, Result]]) -> list[str]:
    """The report's learning-rate section: `grid_table` of ROOT/tuning.json, and
    `regimes_table` when ROOT/tuned holds a tuned-rate sweep ([] when there is neither)."""
    record = tuning.read_tuning(root)
    tuned_root = root / tuning.TUNED_DIR
    tuned_record = studies.read_record(tuned_root)
    if record is None and tuned_record is None:
        return []
    lines = ["## Learning rate per arm", ""]
    if record is not None:
        steps = record.get("steps") or "the arm's"
        lines += [f"Each arm trained once (seed {record['seed']}, {steps} steps) at each rate, "
                  f"evaluated on the last {record['fraction']:g} of the train split (held out "
                  "from those runs, apart from the validation split); the grid was widened by "
                  "a factor of 2 at an edge while the best rate lay there (at most "
                  f"{record['max_extensions']} times). The pick is the rate of lowest tuning "
                  "loss.", ""] + grid_table(record) + [""]
    if tuned_record is not None:
        tuned_description = {**description, "cells": tuned_record.get("cells", []),
                             "seeds": tuned_record.get("seeds", [])}
        tuned, _ = collect(tuned_root, tuned_description)
        lines += ["### Shared rate and tuned rate", "",
                  f"The shared-rate runs of this root beside the tuned-rate runs of "
                  f"`{tuning.TUNED_DIR}/` (each arm at its pick; their own report: "
                  f"`python scripts/study_report.py --root {tuned_root}`). Final eval loss on "
                  "the validation split, mean ± std (n); claims tested as above, in each "
                  "regime.", ""]
        lines += regimes_table(results, tuned, (record or {"cells": {}})["cells"],
                               description["claims"], description["numerics_since"],
                               description.get("registered", "")) + [""]
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


def _seed_losses(results: dict[str, dict[int, Result]], cell: str) -> dict[int, float]:
    return {seed: run.loss for seed, run in results.get(cell, {}).items()}


def _interval(mean: float, std: float, n: int) -> str:
    """`Δ [low, high] (n)` with the 95% t interval; `—` without a pair."""
    if n == 0:
        return "— (0)"
    if n == 1:
        return f"{mean:+.4f} (1)"
    low, high = stats.t_interval(mean, std, n, stats.LEVEL)
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}] ({n})"


def _relative(delta: float, baseline: float) -> str:
    """`; −2.4%`: Δ as a share of the baseline's loss ("" without one)."""
    if not (math.isfinite(delta) and baseline > 0):
        return ""
    return f"; {100 * delta / baseline:+.1f}%"


def length_deltas(results: dict[str, dict[int, Result]], description: dict,
                  arm: str) -> dict[str, tuple[float, float, int]]:
    """size → (mean, std, n) of Δ = arm − baseline at that size, paired by seed."""
    baseline = description["baseline"]
    return {size: stats.paired_difference(_seed_losses(results, f"{arm}@{size}"),
                                          _seed_losses(results, f"{baseline}@{size}"))
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
        losses = {(cell_arm, size): _seed_losses(results, f"{cell_arm}@{size}")
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
        base = stats.mean_std(list(_seed_losses(results, f"{baseline}@{size}").values()))[0]
        lines.append(f"| {size} | " + " | ".join(facts + [
            _interval(*deltas[arm][size]) + _relative(deltas[arm][size][0], base)
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
        lines.append(f"| {row.arm} | {_interval(row.mean, row.std, row.n)} | {_p(row.p)} | "
                     f"{_p(row.adjusted_p)} | {row.verdict} |")
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
