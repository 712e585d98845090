"""The power plan of a study's registered claims (docs/studies.md#the-power-plan): for each claim,
from the paired differences of the runs in a sweep root, the paired standard deviation observed,
the smallest effect its registered n detects, and the n a replication needs.

Every figure is planned at 80% power (`stats.POWER`) and at the strictest level Holm's
correction can give the claim, α/m for a family of m claims, with the claim's own tails (a
direction one- or two-sided, an equivalence by the TOST with a true difference of 0):

- detectable at n: the smallest |Δ| the paired t-test detects at the registered n
  (`stats.detectable_effect`), or for an equivalence the smallest margin the TOST shows
  (`stats.equivalent_margin`);
- n for the observed Δ: the seeds that detect the observed mean difference, were it the truth;
- n for the target: the seeds that detect the paper's difference (PAPER[arm] − PAPER[reference],
  in the paper's units), or for an equivalence the seeds that show the registered margin.

The plan takes the observed SD as the truth; with few seeds it is itself uncertain, so a
replication registers more than the smallest n (docs/studies.md).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from train.studies import stats
from train.studies import study as studies


@dataclasses.dataclass(frozen=True)
class Plan:
    """One claim's power plan (see the module docstring); nan or None where it has no figure."""

    claim: studies.Claim
    level: float  # α/m
    paired: int  # the seeds both arms finished
    mean: float  # observed Δ
    std: float  # observed paired SD
    detectable: float  # the smallest |Δ| (or margin) detected at the registered n
    n_observed: float | None  # seeds for the observed Δ (directions): int, inf or None
    target: float  # the paper's Δ (directions) or the margin (equivalences); nan if none
    n_target: float | None  # seeds for the target


def _seeds(claim: studies.Claim, effect: float, std: float, level: float) -> float | None:
    """The seeds that detect `effect` (a direction) or show the margin `effect` (an
    equivalence) at 80% power: an int, inf beyond 100,000 seeds, or None without a spread or
    an effect on the claimed side."""
    wrong_side = claim.relation != "≈" and (effect < 0) != (claim.relation == "<")
    if not (std > 0 and math.isfinite(effect) and effect != 0) or wrong_side:
        return None
    if claim.relation == "≈":
        n = stats.seeds_needed(lambda n: stats.equivalence_power(effect, std, n, level))
    else:
        n = stats.seeds_needed(
            lambda n: stats.direction_power(effect, std, n, level, claim.tails))
    return math.inf if n is None else n


def plan_claims(losses: Mapping[str, Mapping[int, float]], claims: list[studies.Claim],
                paper: Mapping[str, float], tails: int | None = None) -> list[Plan]:
    """The power plan of each loss claim (compute-multiplier claims have none), from `losses`
    (cell → seed → final loss). `tails` plans every direction one- (1) or two-sided (2) in
    place of its registered tails: a replication's plan."""
    claims = [claim for claim in claims if claim.metric not in studies.MULTIPLIERS]
    family_size = {family: sum(c.family == family for c in claims)
                   for family in {c.family for c in claims}}
    plans = []
    for claim in claims:
        if tails is not None and claim.relation != "≈":
            claim = dataclasses.replace(claim, tails=tails)
        level = stats.ALPHA / family_size[claim.family]
        mean, std, paired = stats.paired_difference(losses.get(claim.arm, {}),
                                                    losses.get(claim.reference, {}))
        if claim.relation == "≈":
            detectable = stats.equivalent_margin(std, claim.n, level) if std > 0 else math.nan
            target, n_observed = claim.margin, None
        else:
            detectable = (stats.detectable_effect(std, claim.n, level, claim.tails)
                          if std > 0 else math.nan)
            target = (paper[claim.arm] - paper[claim.reference]
                      if claim.arm in paper and claim.reference in paper else math.nan)
            n_observed = _seeds(claim, mean, std, level)
        plans.append(Plan(claim, level, paired, mean, std, detectable, n_observed, target,
                          _seeds(claim, target, std, level)))
    return plans


def _number(value: float, digits: int = 4) -> str:
    return "—" if not math.isfinite(value) else f"{value:.{digits}f}"


def _count(n: float | None) -> str:
    return "—" if n is None else "> 100,000" if math.isinf(n) else str(n)


def plan_table(plans: list[Plan]) -> list[str]:
    """The Markdown table of `plan_claims`."""
    lines = ["| Family | Check | Level (α/m) | n registered / paired | Δ observed | Paired SD | "
             "Detectable at registered n | n for observed Δ | Target | n for target |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for plan in plans:
        claim = plan.claim
        kind = "margin" if claim.relation == "≈" else "|Δ|"
        target = ("—" if not math.isfinite(plan.target) else
                  f"margin {plan.target:g}" if claim.relation == "≈" else
                  f"paper Δ {plan.target:+.3f}")
        cells = [claim.family, claim.check(), f"{plan.level:.4g}", f"{claim.n} / {plan.paired}",
                 "—" if plan.paired == 0 else f"{plan.mean:+.4f}", _number(plan.std),
                 "—" if not math.isfinite(plan.detectable) else
                 f"{kind} {plan.detectable:.4f}",
                 "—" if claim.relation == "≈" else _count(plan.n_observed),
                 target, "—" if not math.isfinite(plan.target) else
                 _count(plan.n_target)]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def plan_section(losses: Mapping[str, Mapping[int, float]], claims: list[studies.Claim],
                 paper: Mapping[str, float]) -> list[str]:
    """The report's "Power plan" section (empty without loss claims)."""
    plans = plan_claims(losses, claims, paper)
    if not plans:
        return []
    return ["## Power plan", "",
            "Per registered claim, from this root's paired runs, at 80% power and Holm's "
            "strictest level for the claim (α/m, m the claims of its family; the claim's own "
            "tails; an equivalence by the TOST with a true Δ of 0): the smallest effect the "
            "registered n detects, and the seeds a replication needs for the observed Δ and "
            "for the target (the paper's Δ, in the paper's units, or the margin). The observed "
            "SD is taken as the truth, so with few seeds the figures are themselves "
            "uncertain (`train/studies/power_plan.py`).", "", *plan_table(plans), ""]


def replication_lines(plans: list[Plan]) -> list[str]:
    """What `scripts/study_report.py --plan` prints: per family, each claim's seeds for the
    observed Δ and for its target, and the n to register (the largest over the family's
    claims of the seeds for the observed Δ, for an equivalence for its margin)."""
    lines = []
    for family in dict.fromkeys(plan.claim.family for plan in plans):
        members = [plan for plan in plans if plan.claim.family == family]
        lines.append(f"family {family!r}: {len(members)} claims, level α/m = "
                     f"{members[0].level:.4g}")
        needs = []
        for plan in members:
            claim = plan.claim
            main = plan.n_target if claim.relation == "≈" else plan.n_observed
            needs.append(main)
            target = (f"margin {plan.target:g}" if claim.relation == "≈" else
                      f"paper Δ {plan.target:+.3f}" if math.isfinite(plan.target) else None)
            what = [f"  {claim.check()}: Δ {_number(plan.mean)}, paired SD "
                    f"{_number(plan.std)} (n = {plan.paired})"]
            if claim.relation != "≈":
                what.append(f"n for the observed Δ {_count(plan.n_observed)}")
            if target:
                what.append(f"n for the {target} {_count(plan.n_target)}")
            lines.append("; ".join(what))
        if needs and all(n is not None and math.isfinite(n) for n in needs):
            lines.append(f"  register n ≥ {max(needs)}")
        else:
            lines.append("  register n: no plan (a claim lacks a spread, or an effect on its "
                         "claimed side, or needs over 100,000 seeds)")
    return lines
