"""The report's registered claims (docs/studies.md#registered-claims): each claim tested on
its paired seeds, Holm-corrected within its family, or exploratory with the reason
(`assess_claims`, `claims_table`), and the runs whose provenance does not name their code
(`provenance_section`)."""

from __future__ import annotations

import dataclasses
import math

from train.studies import provenance, stats
from train.studies import study as studies
from train.studies.results import Result, p_text


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
                     difference, f"{row.agreeing} of {row.n}" if row.n else "—", p_text(row.p),
                     p_text(row.adjusted_p), verdict]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines
