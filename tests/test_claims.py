"""Registered claims (docs/studies.md): Holm's adjustment and the TOST against hand
computations, the verdicts, a claim made exploratory by an unregistered seed count or by code
older than NUMERICS_SINCE (counted as untested in its family's correction), the loader's one-line
errors on a malformed claim, and the provenance record the sweep runner writes before a run."""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as scipy_stats

from config.cli import UsageError
from scripts import study_report
from scripts import sweep as sweep_script
from tests.helpers import EXPLORATORY
from train import rundir
from train.studies import power_plan, provenance, stats, sweep
from train.studies import report as report_module
from train.studies import study as studies
from train.studies.report import Result, assess_claims, claims_table, describe, write_report

ROOT = Path(__file__).resolve().parents[1]


# Holm and TOST, by hand ----------------------------------------------------------------------

def test_holm_equals_the_hand_computation_and_steps_down_monotonically():
    # sorted 0.01, 0.03, 0.04, 0.2 → 4·0.01, 3·0.03, max(0.09, 2·0.04), max(0.09, 0.2)
    p = [0.01, 0.04, 0.03, 0.2]
    adjusted = stats.holm(p)
    assert adjusted == pytest.approx([0.04, 0.09, 0.09, 0.2])
    ordered = [adjusted[i] for i in sorted(range(4), key=p.__getitem__)]
    assert ordered == sorted(ordered) and all(a >= raw for a, raw in zip(adjusted, p, strict=True))
    assert stats.holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1, and monotone after the cap
    assert stats.holm([0.02, math.nan]) == pytest.approx([0.04, 1.0])  # no test counts as 1
    assert stats.holm([]) == []


def test_tost_equals_the_two_one_sided_t_tests_by_hand():
    differences = [0.01, 0.02, 0.03, 0.02]  # mean 0.02, sample std √(0.0002/3), n = 4
    mean, std, n = stats.mean_std(differences)
    assert mean == pytest.approx(0.02) and std == pytest.approx(math.sqrt(0.0002 / 3))
    error = math.sqrt(0.0002 / 3) / 2
    margin = 0.05
    p_low = scipy_stats.t.sf((0.02 + margin) / error, 3)  # H0: Δ ≤ −margin
    p_high = scipy_stats.t.cdf((0.02 - margin) / error, 3)  # H0: Δ ≥ +margin
    assert stats.tost_p(mean, std, n, margin) == pytest.approx(max(p_low, p_high), rel=1e-12)
    assert p_high > p_low  # the margin the mean is nearer decides
    # p = α exactly when the 1 − 2α interval touches the margin
    edge = 0.02 + scipy_stats.t.ppf(0.95, 3) * error
    assert stats.tost_p(mean, std, n, edge) == pytest.approx(0.05, rel=1e-9)
    assert stats.tost_p(-mean, std, n, margin) == pytest.approx(stats.tost_p(mean, std, n,
                                                                            margin))
    assert stats.tost_p(0.001, 0.0, 3, 0.005) == 0.0 and stats.tost_p(0.01, 0.0, 3, 0.005) == 1
    assert math.isnan(stats.tost_p(0.01, math.nan, 1, 0.05))


def test_the_t_interval_is_the_mean_plus_minus_t_standard_errors():
    low, high = stats.t_interval(0.02, 0.01, 4)
    half = scipy_stats.t.ppf(0.975, 3) * 0.01 / 2
    assert (low, high) == pytest.approx((0.02 - half, 0.02 + half))


@pytest.mark.parametrize("relation, mean, interval, adjusted, margin, verdict", [
    ("<", -0.1, (-0.2, -0.01), 0.03, None, "agrees"),
    ("<", 0.1, (0.01, 0.2), 0.03, None, "disagrees"),
    (">", 0.1, (-0.01, 0.2), 0.2, None, "inconclusive"),
    ("≈", 0.001, (-0.002, 0.004), 0.01, 0.005, "agrees"),
    ("≈", 0.02, (0.01, 0.03), 1.0, 0.005, "disagrees"),  # wholly above the margin
    ("≈", -0.02, (-0.03, -0.01), 1.0, 0.005, "disagrees"),  # wholly below it
    ("≈", 0.001, (-0.05, 0.05), 0.8, 0.005, "inconclusive"),  # a large p is not equivalence
    ("≈", 0.004, (0.003, 0.006), 0.3, 0.005, "inconclusive"),  # straddles the margin
])
def test_the_verdicts(relation, mean, interval, adjusted, margin, verdict):
    assert stats.claim_verdict(relation, mean, interval, adjusted, margin) == verdict


@pytest.mark.parametrize("relation, mean, interval, adjusted, verdict", [
    ("<", -0.1, (-0.2, 0.01), 0.03, "agrees"),  # one-sided: significant though the CI holds 0
    ("<", 0.1, (0.01, 0.2), 0.97, "disagrees"),  # the 95% interval wholly on the other side
    ("<", 0.1, (-0.01, 0.2), 0.9, "inconclusive"),
    (">", -0.1, (-0.2, -0.01), 0.97, "disagrees"),
])
def test_the_one_sided_verdicts(relation, mean, interval, adjusted, verdict):
    assert stats.claim_verdict(relation, mean, interval, adjusted, tails=1) == verdict


def test_the_one_sided_p_is_the_t_tail_on_the_claimed_side():
    mean, std, n = -0.03, 0.04, 6
    t = mean / (std / math.sqrt(n))
    assert stats.paired_p(mean, std, n, "<") == pytest.approx(scipy_stats.t.cdf(t, 5), rel=1e-12)
    assert stats.paired_p(mean, std, n, ">") == pytest.approx(scipy_stats.t.sf(t, 5), rel=1e-12)
    assert stats.paired_p(mean, std, n, "<") == pytest.approx(stats.paired_p(mean, std, n) / 2)


# The power plan, by hand -----------------------------------------------------------------------

def test_seeds_needed_match_published_power_tables():
    """G*Power's paired t-test (80% power): d = 0.5 two-sided at α = 0.05 needs 34 pairs, d = 1
    one-sided 8; and n is the smallest: the power at n − 1 falls short."""
    for effect, tails, n in ((0.5, 2, 34), (1.0, 1, 8)):
        power_at = lambda k, e=effect, t=tails: stats.direction_power(e, 1.0, k, 0.05, t)
        assert stats.seeds_needed(power_at) == n
        assert power_at(n - 1) < stats.POWER <= power_at(n)


def test_the_direction_power_is_the_noncentral_t_by_hand():
    effect, std, n, alpha = 0.03, 0.04, 8, 0.0125
    shift, critical = effect * math.sqrt(n) / std, scipy_stats.t.ppf(1 - alpha, n - 1)
    one = scipy_stats.nct.sf(critical, n - 1, shift)
    assert stats.direction_power(effect, std, n, alpha, 1) == pytest.approx(one, rel=1e-10)
    critical = scipy_stats.t.ppf(1 - alpha / 2, n - 1)
    two = scipy_stats.nct.sf(critical, n - 1, shift) + scipy_stats.nct.cdf(-critical, n - 1,
                                                                            shift)
    assert stats.direction_power(-effect, std, n, alpha, 2) == pytest.approx(two, rel=1e-10)
    detectable = stats.detectable_effect(std, n, alpha, 1)
    assert stats.direction_power(detectable, std, n, alpha, 1) == pytest.approx(0.8, abs=1e-9)
    assert stats.seeds_needed(lambda k: stats.direction_power(0.5, 1e-6, k, 0.01, 1)) == 2


def test_the_equivalence_power_bounds_a_simulated_tost():
    """10,000 simulated TOSTs of n = 12 normal differences (SD 1, true Δ 0, margin 1, α 0.05):
    the share that reject is the power, which the Bonferroni bound meets within 0.02."""
    rng = np.random.default_rng(0)
    draws = rng.normal(0.0, 1.0, size=(10_000, 12))
    means, stds = draws.mean(axis=1), draws.std(axis=1, ddof=1)
    rejected = np.mean([stats.tost_p(m, s, 12, 1.0) < 0.05 for m, s in zip(means, stds,
                                                                          strict=True)])
    bound = stats.equivalence_power(1.0, 1.0, 12, 0.05)
    assert bound <= rejected + 0.01 and rejected - bound < 0.02
    margin = stats.equivalent_margin(1.0, 12, 0.05)
    assert stats.equivalence_power(margin, 1.0, 12, 0.05) == pytest.approx(0.8, abs=1e-9)


# Exploratory claims --------------------------------------------------------------------------

def claim(arm, relation, reference, family="F", n=4, margin=None) -> studies.Claim:
    return studies.Claim(arm, relation, reference, quote=f"{arm} {relation} {reference}",
                         source="a test", family=family, n=n, margin=margin)


def runs(*losses, launches=None) -> dict[int, Result]:
    return {seed: Result(loss, [], None, list(launches or [])) for seed, loss in
            enumerate(losses)}


def test_an_unregistered_seed_count_makes_a_claim_exploratory_and_untested_in_the_correction():
    """`c` has 3 finished seeds against the registered 4: its claim is exploratory with that
    reason, and Holm adjusts the family's three claims with c's p counted as 1 (no test)."""
    results = {"base": runs(2.0, 2.1, 2.2, 2.3), "a": runs(1.90, 2.02, 2.09, 2.21),
               "b": runs(2.05, 2.13, 2.26, 2.33), "c": runs(1.9, 2.15, 2.1)}
    claims = [claim("a", "<", "base"), claim("b", ">", "base"), claim("c", "<", "base"),
              claim("b", "≈", "a", family="G", margin=0.2)]
    rows = assess_claims(results, claims)
    a, b, c, equivalence = rows
    assert c.exploratory == "c has 3 finished seeds, registered n = 4"
    assert c.verdict == "exploratory" and math.isnan(c.adjusted_p) and c.n == 3
    assert c.p == pytest.approx(stats.paired_p(*stats.paired_difference(
        {s: r.loss for s, r in results["c"].items()},
        {s: r.loss for s, r in results["base"].items()})))  # still reported
    assert [a.adjusted_p, b.adjusted_p] == pytest.approx(stats.holm([a.p, b.p, 1.0])[:2])
    assert a.adjusted_p == pytest.approx(min(1.0, 3 * a.p))  # a family of 3, not 2
    assert not a.exploratory and not b.exploratory
    assert equivalence.adjusted_p == pytest.approx(equivalence.p)  # alone in its family
    table = claims_table(results, claims)
    [line] = [line for line in table if line.startswith("| F | c < base ")]
    assert line.endswith("| — | exploratory: c has 3 finished seeds, registered n = 4 |")
    assert "| 4 / 3 |" in line
    assert "b ≈ a (\\|Δ\\| < 0.2)" in table[-1]  # the pipes of |Δ| escaped in Markdown


def test_arms_that_do_not_share_their_seeds_are_exploratory():
    results = {"base": runs(2.0, 2.1, 2.2), "a": {1: Result(1.9, [], None),
                                                  2: Result(2.0, [], None),
                                                  3: Result(2.1, [], None)}}
    [row] = assess_claims(results, [claim("a", "<", "base", n=3)])
    assert row.exploratory == "a and base share 2 of their 3 seeds" and row.n == 2


def git(repository: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=repository, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_runs_older_than_numerics_since_or_without_provenance_are_exploratory(tmp_path,
                                                                            monkeypatch):
    """A repository with commits old → boundary → new: runs launched at `new` or at the
    boundary count, one at `old` or one without provenance makes its claims exploratory."""
    git(tmp_path, "init", "-q")
    commits = {}
    for name in ("old", "boundary", "new"):
        git(tmp_path, "commit", "-q", "--allow-empty", "-m", name)
        commits[name] = git(tmp_path, "rev-parse", "HEAD")
    monkeypatch.setattr(provenance, "REPOSITORY", tmp_path)
    boundary = commits["boundary"]

    def at(*names):
        return [{"commit": commits[name], "dirty": False} for name in names]

    losses = (2.0, 2.1, 2.2)
    results = {"base": runs(*losses, launches=at("boundary")),
               "fresh": runs(*(x - 0.1 for x in losses), launches=at("new")),
               "resumed": runs(*(x - 0.1 for x in losses), launches=at("old", "new")),
               "unknown": runs(*(x - 0.1 for x in losses))}
    claims = [claim(arm, "<", "base", n=3) for arm in ("fresh", "resumed", "unknown")]
    fresh, resumed, unknown = assess_claims(results, claims, boundary)
    assert not fresh.exploratory and fresh.verdict == "agrees"
    assert resumed.exploratory == (f"resumed seeds 0, 1, 2: trained at {commits['old'][:7]}, "
                                   f"before {boundary[:7]} (NUMERICS_SINCE {boundary[:7]})")
    assert unknown.exploratory == ("unknown seeds 0, 1, 2: no provenance (NUMERICS_SINCE "
                                   f"{boundary[:7]})")
    assert fresh.adjusted_p == pytest.approx(fresh.p)  # the only confirmatory claim
    assert provenance.descends_from(commits["new"], boundary) is True
    assert provenance.descends_from(commits["old"], boundary) is False
    assert provenance.descends_from("0" * 40, boundary) is None


def test_runs_launched_before_the_claims_were_registered_make_them_exploratory():
    """REGISTERED 2026-12-06T05:30: a run first launched before it (even if resumed after) or
    without provenance makes its claims post hoc; runs launched at or after it count."""
    head = git(ROOT, "rev-parse", "HEAD")  # a commit HEAD descends from: provenance passes

    def at(*dates):
        return [{"commit": head, "dirty": False, "date": date} for date in dates]

    losses = (2.0, 2.1, 2.2)
    results = {"base": runs(*losses, launches=at("2026-12-06T05:30:00+00:00")),
               "fresh": runs(*(x - 0.1 for x in losses),
                             launches=at("2026-12-06T07:00:00+00:00")),
               "old": runs(*(x - 0.1 for x in losses),
                           launches=at("2026-12-01T10:00:00+00:00", "2026-12-07T10:00:00+00:00")),
               "unknown": runs(*(x - 0.1 for x in losses))}
    claims = [claim(arm, "<", "base", n=3) for arm in ("fresh", "old", "unknown")]
    fresh, old, unknown = assess_claims(results, claims, registered="2026-12-06T05:30")
    assert not fresh.exploratory and fresh.verdict == "agrees"
    assert old.exploratory == ("old seeds 0, 1, 2: launched 2026-12-01T10:00, before the claims "
                               "were registered (REGISTERED 2026-12-06T05:30)")
    assert unknown.exploratory == ("unknown seeds 0, 1, 2: no provenance (REGISTERED "
                                   "2026-12-06T05:30)")
    assert fresh.adjusted_p == pytest.approx(fresh.p)  # the only confirmatory claim


def test_registered_must_be_an_iso_time(tmp_path):
    path = write(tmp_path, extra="REGISTERED = 'yesterday'")
    with pytest.raises(UsageError, match="REGISTERED='yesterday' is not an ISO 8601 date or time"):
        studies.load_study(str(path))
    study = studies.load_study(str(write(tmp_path, extra="REGISTERED = '2026-12-06'")))
    assert study.registered == "2026-12-06"
    record = studies.record(tmp_path / "root", study, "cpu", ["a", "b"], [0, 1], [])
    assert record["registered"] == "2026-12-06"


# The loader ----------------------------------------------------------------------------------

STUDY = '''"""A study with claims."""

from experiments.common import claim

ARMS = ("a", "b", "c")
BASELINE = "a"
SEEDS = (0, 1)
SCALES = ("cpu",)
{extra}
CLAIMS = ({claims},)


def get_config(arg=None):
    return None
'''
GOOD = "claim('b', '<', 'a', quote='b helps', source='a paper, Table 1', family='F', n=2)"


def write(tmp_path: Path, claims: str = GOOD, extra: str = "") -> Path:
    path = tmp_path / "claims_study.py"
    path.write_text(STUDY.format(claims=claims, extra=extra))
    return path


MALFORMED = [
    ("('b', '<', 'a', 'b helps')",
     "claim ('b', '<', 'a', 'b helps') is an unregistered (arm, relation, reference, text) "
     "tuple; register it as claim(arm, relation, reference, quote=..., source=..., "
     "family=..., n=...) from experiments.common"),
    (GOOD.replace("'a', quote", "'z', quote"), "reference 'z' is not one of ARMS"),
    (GOOD.replace("'<'", "'<='"), "relation '<=' is not '<' (the arm ends lower)"),
    (GOOD.replace("'<'", "'≈'"), "an equivalence needs margin=M > 0"),
    (GOOD.replace("'<'", "'≈'").replace("n=2", "n=2, margin=-0.1"),
     "an equivalence needs margin=M > 0 in the metric's units (|Δ| < M); got margin=-0.1"),
    (GOOD.replace("n=2", "n=2, margin=0.01"), "a direction takes no margin"),
    (GOOD.replace("n=2", "n=1"), "n=1 must be the registered seed count, an int ≥ 2"),
    (GOOD.replace("family='F'", "family=' '"), "family must be a non-empty string"),
    (GOOD.replace("n=2", "n=2, metric='train_loss'"), "metric 'train_loss' is not one of"),
    (GOOD.replace("'b', '<', 'a'", "'b', '<', 'b'"), "compares an arm with itself"),
    (GOOD.replace("n=2", "n=2, tails=3"), "tails=3 must be 2 (two-sided) or, for a direction"),
    (GOOD.replace("'<'", "'≈'").replace("n=2", "n=2, margin=0.1, tails=1"),
     "tails=1 must be 2 (two-sided) or, for a direction, 1"),
    ("dict(arm='b', relation='<', reference='a', quote='q', source='s', n=2)",
     "claim 'b' < 'a' lacks 'family'"),
    (GOOD + ", " + GOOD.replace("'b', '<'", "'c', '<'").replace("n=2", "n=3"),
     "family 'F' registers n = 2 and n = 3; the claims of a family share one seed count"),
    ("'b < a'", "a claim is a dict of claim(...)"),
]


@pytest.mark.parametrize("claims, message", MALFORMED, ids=[m[:40] for _, m in MALFORMED])
def test_a_malformed_claim_is_refused_in_one_line(tmp_path, claims, message):
    path = write(tmp_path, claims)
    with pytest.raises(UsageError) as error:
        studies.load_study(str(path))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith(f"--study={path}")


def test_a_missing_keyword_of_claim_is_a_one_line_load_error(tmp_path):
    path = write(tmp_path, GOOD.replace(", family='F'", ""))
    with pytest.raises(UsageError, match="fails to load: .*missing 1 required keyword-only "
                                         "argument: 'family'") as error:
        studies.load_study(str(path))
    assert "\n" not in str(error.value)


def test_numerics_since_must_be_a_commit_id(tmp_path):
    path = write(tmp_path, extra="NUMERICS_SINCE = 'HEAD~3'")
    with pytest.raises(UsageError, match="NUMERICS_SINCE='HEAD~3' is not a commit id"):
        studies.load_study(str(path))
    study = studies.load_study(str(write(tmp_path, extra="NUMERICS_SINCE = 'a954c45'")))
    assert study.numerics_since == "a954c45"


def write_runs(root: Path, **losses: tuple[float, ...]) -> None:
    """Finished 10-step runs ROOT/<cell>/seed<k>, seed k of a cell ending at losses[cell][k]."""
    for cell, values in losses.items():
        for seed, loss in enumerate(values):
            workdir = studies.run_dir(root, cell, seed)
            workdir.mkdir(parents=True)
            (workdir / "config.json").write_text(json.dumps({"steps": 10}))
            (workdir / "metrics.jsonl").write_text(json.dumps({"step": 10, "eval_loss": loss}))


def test_registered_claims_reach_the_record_and_the_report(tmp_path):
    study = studies.load_study(str(write(tmp_path, extra="NUMERICS_SINCE = 'a954c45'")))
    assert study.claims == (studies.Claim("b", "<", "a", quote="b helps",
                                          source="a paper, Table 1", family="F", n=2),)
    root = tmp_path / "root"
    record = studies.record(root, study, "cpu", ["a", "b"], [0, 1], [])
    assert record["claims"][0]["relation"] == "<" and record["numerics_since"] == "a954c45"
    write_runs(root, a=(2.0, 2.2), b=(1.5, 1.8))
    description = describe(root, None)
    assert description["claims"] == list(study.claims)
    report = write_report(root, description).read_text()
    assert "| F | b helps | a paper, Table 1 | b < a | 2 / 2 |" in report
    assert ("exploratory: b seeds 0, 1: no provenance (NUMERICS_SINCE a954c45); a seeds 0, 1: "
            "no provenance (NUMERICS_SINCE a954c45) |") in report


def test_a_sweep_of_some_arms_reports_the_other_arms_claims_as_exploratory(tmp_path):
    study = studies.load_study(str(write(tmp_path)))
    root = tmp_path / "root"
    studies.record(root, study, "cpu", ["a"], [0, 1], [])  # `--arms a`: b not swept
    write_runs(root, a=(2.0, 2.2))
    description = describe(root, None)
    assert description["claims"] == list(study.claims)
    report = write_report(root, description).read_text()
    assert ("| b < a | 2 / 0 | — | — | — | — | exploratory: b has 0 finished seeds, "
            "registered n = 2 |") in report


def test_a_record_with_old_claims_asks_for_the_study_file(tmp_path):
    (tmp_path / "study.json").write_text(json.dumps({
        "study": "s.py", "scale": "cpu", "baseline": "a", "cells": ["a", "b"], "seeds": [0],
        "claims": [["b", "<", "a", "b helps"]]}))
    with pytest.raises(UsageError) as error:
        describe(tmp_path, None)
    assert str(error.value) == (f"--root={tmp_path}: study.json records claims in the old (arm, "
                                "relation, reference, text) form; pass --study "
                                "experiments/STUDY.py to report its registered claims")


# Provenance ----------------------------------------------------------------------------------

TINY = '''"""A one-arm study for the provenance test."""

from experiments.common import base_config

ARMS = ("only",)
BASELINE = "only"
SEEDS = (0,)
SCALES = ("cpu",)


def get_config(arg=None):
    config = base_config()
    config.steps = 3
    return config
'''


def test_the_sweep_records_provenance_before_each_launch(tmp_path, monkeypatch):
    """A fake trainer: the first launch stops at step 1 (exit 1), the rerun finishes. Each
    launch finds its provenance line already written; the rerun adds a second one."""
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    study = studies.load_study(str(path))
    [run] = sweep.plan(study, tmp_path / "root", "cpu", ["only"], [0], [])
    seen = []

    def train(command, **_):
        seen.append(len(provenance.read(run.workdir)))
        (run.workdir / "config.json").write_text(json.dumps({"steps": 3}))
        last = 1 if len(seen) == 1 else 3
        records = [{"step": step, "eval_loss": 2.0} for step in range(1, last + 1)]
        (run.workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n"
                                                           for r in records))
        return subprocess.CompletedProcess(command, 1 if len(seen) == 1 else 0)

    class Launched:  # the fake trainer, run at once: `wait` gives its status
        def __init__(self, command, **_):
            self.status = train(command).returncode

        def wait(self):
            return self.status

    monkeypatch.setattr(sweep, "subprocess", types.SimpleNamespace(
        Popen=Launched, STDOUT=subprocess.STDOUT))
    assert sweep.run_local([run]) == 1
    assert sweep.run_local([run]) == 0
    assert seen == [1, 2]
    launches = provenance.read(run.workdir)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    for launch in launches:
        assert launch["commit"] == head and isinstance(launch["dirty"], bool)
        assert launch["command"][1:] == ["-P", "-m", "train", *run.train_args()]
        assert launch["cpu"] and isinstance(launch["gpus"], list)
        assert datetime.datetime.fromisoformat(launch["date"]).tzinfo is not None


def test_the_sweep_launches_nothing_into_a_run_another_trainer_holds(tmp_path, monkeypatch,
                                                                    capsys):
    """Two sweeps sharing a root: a run whose lock a live trainer holds is reported as failed,
    naming the holder, with no launch and no provenance line; once released, it launches."""
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    [run] = sweep.plan(studies.load_study(str(path)), tmp_path / "root", "cpu", ["only"], [0],
                       [])
    launched = []

    class Launched:
        def __init__(self, command, **_):
            launched.append(command)
            (run.workdir / "config.json").write_text(json.dumps({"steps": 3}))
            (run.workdir / "metrics.jsonl").write_text(
                json.dumps({"step": 3, "eval_loss": 2.0}) + "\n")

        def wait(self):
            return 0

    monkeypatch.setattr(sweep, "subprocess", types.SimpleNamespace(
        Popen=Launched, STDOUT=subprocess.STDOUT))
    with rundir.WorkdirLock(run.workdir):
        assert sweep.run_local([run]) == 1
    out = capsys.readouterr().out
    assert f"failed: --workdir={run.workdir} is in use by pid {os.getpid()}" in out
    assert f"busy: --workdir={run.workdir} is in use" in out
    assert launched == [] and provenance.read(run.workdir) == []
    assert sweep.run_local([run]) == 0
    assert len(launched) == 1 and len(provenance.read(run.workdir)) == 1


def test_the_sweep_and_its_trainers_run_this_checkout_whatever_shadows_it(tmp_path,
                                                                          monkeypatch):
    """Another checkout's `train` first on the path (on PYTHONPATH, and as the working
    directory) replaces neither the code scripts/sweep.py imports nor the code its trainers run
    (`sweep.environment` and `-P`), so the commit provenance names is the code that trained."""
    shadow = tmp_path / "other_checkout"
    (shadow / "train").mkdir(parents=True)
    (shadow / "train" / "__init__.py").write_text("raise ImportError('the other checkout')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sweep.py"), *EXPLORATORY,
                           "--study",
                           str(ROOT / "experiments" / "attnres_ablation.py"), "--root",
                           str(tmp_path / "root"), "--arms", "baseline", "--seeds", "0",
                           "--launch", "print"], cwd=shadow, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    [run] = sweep.plan(studies.load_study(str(path)), tmp_path / "root2", "cpu", ["only"],
                       [0], [])
    python = sweep._command([run])[:2]
    assert python == [sys.executable, "-P"]
    imported = subprocess.run([*python, "-c", "import train; print(train.__file__)"],
                              cwd=shadow, env=sweep.environment(), capture_output=True,
                              text=True)
    assert imported.stdout.strip() == str(ROOT / "train" / "__init__.py"), imported.stderr


def test_the_power_plan_of_a_family_by_hand(tmp_path, capsys):
    """A family of two claims (level α/2) and an equivalence alone in its family: each figure
    equals its computation from the paired differences, and --plan prints the n to register."""
    losses = {"a": {0: 2.00, 1: 2.10, 2: 2.20, 3: 2.30}, "b": {0: 1.95, 1: 2.01, 2: 2.18, 3: 2.22},
              "c": {0: 2.04, 1: 2.12, 2: 2.26, 3: 2.31}}
    claims = [claim("b", "<", "a"), claim("c", ">", "a"),
              claim("c", "≈", "b", family="G", margin=0.1)]
    b, c, equivalence = power_plan.plan_claims(losses, claims, {"a": 1.8, "b": 1.75})
    mean, std, n = stats.paired_difference(losses["b"], losses["a"])
    assert (b.level, b.paired, b.mean, b.std) == pytest.approx((0.025, 4, mean, std))
    assert b.detectable == pytest.approx(stats.detectable_effect(std, 4, 0.025, 2))
    assert b.n_observed == stats.seeds_needed(
        lambda k: stats.direction_power(mean, std, k, 0.025, 2))
    assert b.n_target == stats.seeds_needed(
        lambda k: stats.direction_power(0.05, std, k, 0.025, 2)) and b.target == pytest.approx(
        -0.05)
    assert c.n_observed is not None and math.isnan(c.target) and c.n_target is None
    _, std, _ = stats.paired_difference(losses["c"], losses["b"])
    assert equivalence.level == 0.05 and equivalence.target == 0.1
    assert equivalence.n_target == stats.seeds_needed(
        lambda k: stats.equivalence_power(0.1, std, k, 0.05))
    one_sided = power_plan.plan_claims(losses, claims, {}, tails=1)[0]
    assert one_sided.claim.tails == 1 and one_sided.n_observed <= b.n_observed
    wrong_side = power_plan.plan_claims({"a": losses["a"], "b": losses["c"]},
                                        [claim("b", "<", "a")], {})[0]
    assert wrong_side.n_observed is None  # no plan for an effect on the other side

    root = tmp_path / "root"  # the study's SEEDS are 0 and 1: the report reads those
    write_runs(root, a=tuple(losses["a"].values()), b=tuple(losses["b"].values()))
    study = write(tmp_path, extra="PAPER = {'a': 1.8, 'b': 1.75}\nPAPER_METRIC = 'loss'")
    assert study_report.main(["--root", str(root), "--study", str(study), "--plan"]) == 0
    out = capsys.readouterr().out.splitlines()
    first_two = {cell: {seed: losses[cell][seed] for seed in (0, 1)} for cell in ("a", "b")}
    [plan] = power_plan.plan_claims(first_two, [studies.load_study(str(study)).claims[0]],
                                    {"a": 1.8, "b": 1.75})
    assert out == ["family 'F': 1 claims, level α/m = 0.05",
                   f"  b < a: Δ {plan.mean:.4f}, paired SD {plan.std:.4f} (n = 2); n for the "
                   f"observed Δ {plan.n_observed}; n for the paper Δ -0.050 {plan.n_target}",
                   f"  register n ≥ {plan.n_observed}"]
    assert study_report.main(["--root", str(root), "--study", str(study)]) == 0
    report = (root / "report.md").read_text()
    assert "## Power plan" in report and f"| {plan.n_observed} | paper Δ -0.050 |" in report


def test_a_sweep_refuses_a_checkout_that_cannot_name_its_code(tmp_path, monkeypatch, capsys):
    """Clean at main: none. Dirty, a commit off main, or no git: one line naming why, and
    scripts/sweep.py exits 2 with it unless --exploratory."""
    repository = tmp_path / "repository"
    repository.mkdir()
    assert "not a git checkout" in provenance.checkout_problem(repository)
    git(repository, "init", "-q", "-b", "main")
    (repository / "file.txt").write_text("one")
    git(repository, "add", "file.txt")
    git(repository, "commit", "-q", "-m", "one")
    assert provenance.checkout_problem(repository) is None
    (repository / "file.txt").write_text("two")
    assert "(a dirty tree): commit them" in provenance.checkout_problem(repository)
    git(repository, "checkout", "-q", "-b", "side")
    git(repository, "commit", "-q", "-am", "two")
    side = git(repository, "rev-parse", "HEAD")
    assert provenance.checkout_problem(repository) == (f"HEAD {side[:7]} is not on main: run "
                                                       "from a commit on main")
    monkeypatch.setattr(provenance, "REPOSITORY", repository)
    study = tmp_path / "tiny.py"
    study.write_text(TINY)
    args = ["--study", str(study), "--root", str(tmp_path / "root"), "--launch", "print"]
    with pytest.raises(SystemExit) as exit_:
        sweep_script.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"this checkout cannot launch confirmatory runs: HEAD {side[:7]} is not "
                        "on main: run from a commit on main; or pass --exploratory (its runs "
                        "then count toward no claim)") and "\n" not in err
    assert sweep_script.main([*EXPLORATORY, *args]) == 0


def test_runs_that_do_not_name_their_code_are_exploratory_and_listed(tmp_path, monkeypatch):
    """A repository main: one → two, and a side branch: a run launched at `one` or `two` counts;
    one from a dirty tree, at the side branch's commit or at an unknown one does not."""
    git(tmp_path, "init", "-q", "-b", "main")
    commits = {}
    for name in ("one", "two"):
        git(tmp_path, "commit", "-q", "--allow-empty", "-m", name)
        commits[name] = git(tmp_path, "rev-parse", "HEAD")
    git(tmp_path, "checkout", "-q", "-b", "side", commits["one"])
    git(tmp_path, "commit", "-q", "--allow-empty", "-m", "side")
    commits["side"] = git(tmp_path, "rev-parse", "HEAD")
    git(tmp_path, "checkout", "-q", "main")
    monkeypatch.setattr(provenance, "REPOSITORY", tmp_path)

    def at(name, dirty=False):
        return [{"commit": commits.get(name, name), "dirty": dirty}]

    losses = (2.0, 2.1, 2.2)
    better = tuple(x - 0.1 for x in losses)
    results = {"base": runs(*losses, launches=at("one")), "clean": runs(*better,
                                                                        launches=at("two")),
               "dirty": runs(*better, launches=at("two", dirty=True)),
               "side": runs(*better, launches=at("side")),
               "unknown": runs(*better, launches=at("f" * 40))}
    claims = [claim(arm, "<", "base", n=3) for arm in ("clean", "dirty", "side", "unknown")]
    clean, dirty, side, unknown = assess_claims(results, claims)
    assert not clean.exploratory and clean.verdict == "agrees"
    assert dirty.exploratory == (f"dirty seeds 0, 1, 2: launched from a dirty tree at "
                                 f"{commits['two'][:7]} (provenance)")
    assert side.exploratory == (f"side seeds 0, 1, 2: commit {commits['side'][:7]} is not an "
                                "ancestor of HEAD (provenance)")
    assert unknown.exploratory == "unknown seeds 0, 1, 2: commit fffffff unknown here (provenance)"
    section = "\n".join(report_module.provenance_section({**results, "none": runs(2.0)}))
    assert f"| side | 2 | commit {commits['side'][:7]} is not an ancestor of HEAD |" in section
    assert "| clean |" not in section and "Without a provenance record (1): none/seed0." in section


def test_reruns_compare_each_committed_run_with_its_rerun_at_todays_code(tmp_path, monkeypatch,
                                                                          capsys):
    """--rerun 1 on a root of two cells: each cell's lowest seed trains again with the command
    its provenance records (flags kept, work directory and seed its own); a rerun equal to the
    committed run is stable, one that moves by more than a tenth of the paired SD is sensitive
    to rounding, and a run without provenance is listed as not rerun."""
    study = tmp_path / "study.py"
    study.write_text(STUDY.format(claims=GOOD, extra="").replace(
        "    return None", "    from experiments.common import base_config\n\n"
        "    config = base_config()\n    config.steps = 10\n    return config"))
    root = tmp_path / "root"
    studies.record(root, studies.load_study(str(study)), "cpu", ["a", "b"], [0, 1], [])
    write_runs(root, a=(2.0, 2.2), b=(1.5, 1.8))  # paired SD of b − a: 0.0707
    for cell in ("a", "b"):
        (studies.run_dir(root, cell, 0) / "provenance.jsonl").write_text(json.dumps({
            "commit": "0" * 40, "dirty": False, "date": "2026-12-07T00:00:00+00:00",
            "command": ["python", "-P", "-m", "train", "--config", f"{study}:{cell},cpu",
                        "--workdir", "elsewhere", "--config.seed=0",
                        "--config.eval_every=5"]}) + "\n")
    today = {"a": 2.0, "b": 1.52}  # b moves by 0.02 > 0.1 × 0.0707
    launched = []

    class Launched:  # the fake trainer: today's code ends each run at `today`
        def __init__(self, command, **_):
            launched.append(command)
            workdir = Path(command[command.index("--workdir") + 1])
            cell = workdir.parent.name
            (workdir / "config.json").write_text(json.dumps({"steps": 10}))
            (workdir / "metrics.jsonl").write_text(json.dumps({"step": 10,
                                                               "eval_loss": today[cell]}))

        def wait(self):
            return 0

    monkeypatch.setattr(sweep, "subprocess", types.SimpleNamespace(
        Popen=Launched, STDOUT=subprocess.STDOUT))
    assert study_report.main(["--root", str(root), "--rerun", "1"]) == 0
    assert [c[c.index("--workdir") + 1:] for c in launched] == [
        [str(root / "reruns" / cell / "seed0"), "--config.seed=0", "--config.eval_every=5"]
        for cell in ("a", "b")]
    text = (root / "reruns.md").read_text()
    assert "| a | 0 | 2.0000 | 2.0000 (" in text and "| 0.0000 | 0.1414 | 0.00 | stable |" in text
    assert "| b | 0 | 1.5000 | 1.5200 (" in text
    assert "| 0.0200 | 0.0707 | 0.28 | **sensitive to rounding** |" in text
    (studies.run_dir(root, "b", 0) / "provenance.jsonl").write_text(json.dumps({
        "commit": "0" * 40, "command": ["python", "-c", "pass"]}) + "\n")
    shutil.rmtree(root / "reruns")
    (studies.run_dir(root, "a", 0) / "provenance.jsonl").unlink()  # from study.json instead
    launched.clear()
    assert study_report.main(["--root", str(root), "--rerun", "1"]) == 0
    assert launched[0][launched[0].index("--config") + 1:] == [
        f"{study}:a,cpu", "--workdir", str(root / "reruns" / "a" / "seed0"), "--config.seed=0"]
    assert "| b | 0 | — | — | — | — | — | not rerun: its provenance records no" in (
        root / "reruns.md").read_text()
