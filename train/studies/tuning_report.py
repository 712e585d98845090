"""The report's learning rate per arm (`train.studies.tuning`): each cell's tuning grid and
the shared-rate and tuned-rate comparisons side by side (`tuning_section`)."""

from __future__ import annotations

from pathlib import Path

from train.studies import stats, tuning
from train.studies import study as studies
from train.studies.claims_report import ClaimResult, assess_claims
from train.studies.results import Result, collect, p_text, value_text


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
    return f"{difference} | {p_text(row.adjusted_p)} | {verdict}"

def _rate(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:g}"

def _losses(runs: dict[int, Result]) -> str:
    """`mean ± std (n)` of the final losses of a cell's finished runs."""
    mean, std, n = stats.mean_std([r.loss for r in runs.values()])
    return f"{value_text(mean, std, n)} ({n})"

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
