"""The IsoFLOP analysis (train/studies/stats.py, isoflop_report.py) and its study file
(experiments/attnres_isoflop.py): a profile's parabola minimum against the hand computation, the
frontier and the compute multiplier recovered from synthetic profiles with a known multiplier,
the bootstrap interval over seeds, the claim's verdicts, the report on hand-written run
directories, and every cell of the study building with tokens = C / (6N) — nothing trains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from arch.accounting import flops_per_token
from config import resolve
from config.cli import UsageError, load_module
from tests.helpers import tiny_config
from train.studies import stats
from train.studies import study as studies
from train.studies.report import describe, write_report

ROOT = Path(__file__).resolve().parents[1]
STUDY = "experiments/attnres_isoflop.py"
TRUE = 1.25  # block's frontier is the baseline's at 1.25·C
A, B, CURVATURE = 10.0, 0.05, 0.04  # the baseline frontier L*(C) = A·C^(−B)


def frontier(compute: float, arm: str) -> float:
    return A * (compute * (TRUE if arm == "block" else 1.0)) ** -B


def optimum(compute: float) -> float:
    return math.sqrt(compute / 120)  # N* = √(C/120), 20 tokens per parameter


def profiles(arm: str, noise: float = 0.0, seeds: int = 2,
             budgets=(2e12, 6e12, 2e13)) -> dict[float, dict[float, list[float]]]:
    """Synthetic profiles L = κ(ln N − ln N*)² + L*(C), sizes placed off-centre around N*, each
    seed's loss with Gaussian noise of std `noise`."""
    rng = np.random.default_rng(1 if arm == "block" else 0)
    result = {}
    for compute in budgets:
        star = optimum(compute)
        result[compute] = {
            n: [CURVATURE * math.log(n / star) ** 2 + frontier(compute, arm)
                + noise * rng.standard_normal() for _ in range(seeds)]
            for n in star * np.array([0.3, 0.7, 1.3, 2.9, 6.0])}
    return result


# The parabola and the frontier ------------------------------------------------------------

def test_the_parabola_minimum_is_the_hand_computation():
    # L = a(ln N − ln N*)² + L* = a·x² − 2a·ln N*·x + (a·ln²N* + L*)
    a, n_star, l_star = 0.05, 3.0e5, 2.0
    sizes = [5e4, 1e5, 4e5, 9e5, 2e6]
    minimum = stats.parabola_minimum(sizes, [a * math.log(n / n_star) ** 2 + l_star
                                             for n in sizes])
    assert minimum.n == pytest.approx(n_star, rel=1e-9)
    assert minimum.loss == pytest.approx(l_star, abs=1e-12)
    assert minimum.coefficients == pytest.approx(
        (a, -2 * a * math.log(n_star), a * math.log(n_star) ** 2 + l_star), rel=1e-9)
    assert minimum.interior and minimum.at(n_star) == pytest.approx(l_star)
    edge = stats.parabola_minimum(sizes[:3], [a * math.log(n / 1e7) ** 2 for n in sizes[:3]])
    assert not edge.interior and edge.n == pytest.approx(1e7, rel=1e-9)
    with pytest.raises(ValueError, match="opens downward"):
        stats.parabola_minimum(sizes, [-a * math.log(n / n_star) ** 2 for n in sizes])
    with pytest.raises(ValueError, match="three or more sizes"):
        stats.parabola_minimum([1e5, 1e5, 2e5], [1.0, 1.1, 1.2])


def test_the_frontier_and_multiplier_recover_a_known_multiplier():
    minima, fit = stats.isoflop_frontier(profiles("baseline"))
    assert list(minima) == [2e12, 6e12, 2e13]
    for compute, minimum in minima.items():
        assert minimum.n == pytest.approx(optimum(compute), rel=1e-6)
        assert minimum.loss == pytest.approx(frontier(compute, "baseline"), rel=1e-9)
    assert (fit.a, fit.b) == pytest.approx((A, B), rel=1e-6)
    for compute in (2e12, 2e13):
        assert stats.frontier_multiplier(profiles("block"), profiles("baseline"), compute) \
            == pytest.approx(TRUE, rel=1e-6)
    # the other way round: the baseline is worth 1/1.25 of block's compute
    assert stats.frontier_multiplier(profiles("baseline"), profiles("block"), 2e13) \
        == pytest.approx(1 / TRUE, rel=1e-6)


def test_the_bootstrap_interval_holds_the_truth_and_widens_with_noise():
    m, low, high, refits = stats.bootstrap_frontier_multiplier(
        profiles("block", 1e-5), profiles("baseline", 1e-5), 2e13, samples=200)
    assert low <= TRUE <= high and m == pytest.approx(TRUE, rel=0.01) and refits == 200
    quiet = high - low
    m, low, high, refits = stats.bootstrap_frontier_multiplier(
        profiles("block", 3e-3), profiles("baseline", 3e-3), 2e13, samples=200)
    assert low < m < high and high - low > max(10 * quiet, 0.01) and refits > 150
    # one seed per size: every resample is the data, so the interval is the point
    m, low, high, _ = stats.bootstrap_frontier_multiplier(
        profiles("block", 3e-3, seeds=1), profiles("baseline", 3e-3, seeds=1), 2e13,
        samples=20)
    assert low == pytest.approx(m) and high == pytest.approx(m)


def test_the_misfit_aware_interval_counts_the_fits_misfit():
    """On exact parabolas whose minima lie on power laws every residual is 0: the misfit-aware
    interval is the point. Minima off a power law (the middle budget's raised) widen it beyond
    the seed bootstrap, which sees no noise between seeds there."""
    m, low, high, refits = stats.misfit_bootstrap_frontier_multiplier(
        profiles("block"), profiles("baseline"), 2e13, samples=50)
    assert (m, low, high) == pytest.approx((TRUE, TRUE, TRUE), rel=1e-6) and refits == 50
    bent = profiles("baseline")
    bent[6e12] = {n: [loss + 0.05 for loss in losses] for n, losses in bent[6e12].items()}
    _, seed_low, seed_high, _ = stats.bootstrap_frontier_multiplier(
        profiles("block"), bent, 2e13, samples=50)
    m, low, high, _ = stats.misfit_bootstrap_frontier_multiplier(
        profiles("block"), bent, 2e13, samples=200)
    assert seed_high - seed_low < 1e-9 and low < m < high and high - low > 0.05


def test_the_sensitivity_frontiers_by_hand():
    """The log-loss parabolas and the best observed runs: on profiles parabolic in L, the
    log-loss parabolas' minima come within 0.1% of the same L*, and the observed frontier is the
    power law through each budget's lowest mean loss."""
    exact = profiles("baseline")
    log_law = stats.log_loss_frontier(exact)
    for compute in exact:
        assert log_law.loss(compute) == pytest.approx(frontier(compute, "baseline"), rel=1e-3)
    best = {c: min(np.mean(v) for v in p.values()) for c, p in exact.items()}
    law = stats.fit_power_law(list(best), list(best.values()))
    observed = stats.observed_frontier(exact)
    assert (observed.a, observed.b) == pytest.approx((law.a, law.b), rel=1e-12)


@pytest.mark.parametrize("interval, verdict", [
    ((1.1, 1.4), "agrees"), ((0.9, 1.6), "inconclusive"), ((1.3, 1.6), "disagrees"),
    ((1.05, 1.2), "disagrees"), ((0.7, 0.95), "disagrees"), ((math.nan, math.nan),
                                                            "inconclusive")])
def test_the_multiplier_verdict(interval, verdict):
    assert stats.multiplier_verdict(">", interval, 1.25) == verdict


@pytest.mark.parametrize("relation, interval, verdict", [
    (">", (1.02, 3.0), "agrees"), (">", (0.6, 2.7), "inconclusive"), (">", (0.5, 0.9), "disagrees"),
    ("<", (0.5, 0.9), "agrees"), (">", (math.nan, math.nan), "inconclusive")])
def test_the_misfit_aware_verdict_asks_only_that_the_interval_exclude_one(relation, interval,
                                                                         verdict):
    assert stats.excludes_one_verdict(relation, interval) == verdict


# The report --------------------------------------------------------------------------------

ISOFLOP_STUDY = '''"""An IsoFLOP study for the tests: two arms, two budgets, three widths each."""

from experiments.common import claim

ARMS = ("baseline", "block")
BASELINE = "baseline"
SEEDS = (0, 1)
SCALES = ("cpu",)
SCALING = ("c1e10-d16", "c1e10-d32", "c1e10-d64", "c1e11-d32", "c1e11-d64", "c1e11-d128")
PAPER = {"block": 1.25}
PAPER_METRIC = "compute multiplier at matched loss"
CLAIMS = (claim("block", ">", "baseline", metric="compute_multiplier", quote="1.25x",
                source="test", family="compute", n=2),)


def get_config(arg=None):
    raise RuntimeError("never trained: the test writes the run directories itself")
'''


def write_runs(root: Path, study: studies.Study, cells) -> None:
    """Each cell's seeds 0 and 1 as run directories written by hand: a resolved config.json
    with steps so that its training FLOPs are its budget, and a final loss on the synthetic
    profile of its (arm, budget), each budget's minimum off-centre at 1.3× its second size."""
    studies.record(root, study, "cpu", study.cells(), [0, 1], [])
    configs = {d: resolve(tiny_config(d_model=d), 1) for d in (16, 32, 64, 128)}
    n_of = {d: flops_per_token(c.model, c.seq_len) / 6 for d, c in configs.items()}
    star = {1e10: 1.3 * n_of[32], 1e11: 1.3 * n_of[64], 1e12: 1.3 * n_of[64]}
    for cell in cells:
        arm, size = studies.split_cell(cell)
        budget, width = studies.size_budget(size), int(size.split("-d")[1])
        config, n = configs[width], n_of[width]
        data = config.to_dict()
        data["steps"] = round(budget / (6 * n * config.batch_size * config.seq_len))
        for seed in (0, 1):
            workdir = studies.run_dir(root, cell, seed)
            workdir.mkdir(parents=True)
            (workdir / "config.json").write_text(json.dumps(data))
            loss = (CURVATURE * math.log(n / star[budget]) ** 2 + A * (budget * (
                TRUE if arm == "block" else 1)) ** -B + 1e-5 * (seed - 0.5))
            (workdir / "metrics.jsonl").write_text(
                json.dumps({"step": data["steps"], "eval_loss": loss}) + "\n")


@pytest.mark.slow
def test_the_report_fits_the_profiles_and_judges_the_claim(tmp_path):
    """The report on hand-written runs recovers the 1.25 and the claim agrees."""
    (tmp_path / "isoflop.py").write_text(ISOFLOP_STUDY)
    study = studies.load_study(str(tmp_path / "isoflop.py"))
    assert study.claims[0].metric == studies.MULTIPLIER
    root = tmp_path / "root"
    write_runs(root, study, study.cells())
    write_report(root, describe(root, None))
    report = (root / "report.md").read_text()
    assert "## IsoFLOP frontier" in report and "## Scaling" not in report
    assert "## Registered claims" not in report  # the multiplier claim is the section's
    [claim] = [line for line in report.splitlines() if line.startswith("| 1.25x |")]
    value = claim.split(" | ")[4]
    point, interval = value.split(" (")[0].split(" [")
    low, high = (float(bound) for bound in interval.rstrip("]").split(", "))
    assert float(point) == pytest.approx(TRUE, rel=0.01) and low <= TRUE <= high
    assert claim.endswith("| agrees |")
    [block] = [line for line in report.splitlines() if line.startswith("| block | ")]
    assert float(block.split(" | ")[2]) == pytest.approx(B, rel=0.01)
    assert (root / "isoflop.png").stat().st_size > 0
    assert "None: every run finished." in report


@pytest.mark.slow
def test_a_budget_without_both_minima_shows_no_multiplier(tmp_path):
    """A third budget with one size trained has no minimum: the frontier table shows no
    multiplier there (it would extrapolate both frontiers), and the claim, whose cells there
    have no seeds, is exploratory."""
    text = ISOFLOP_STUDY.replace('"c1e11-d128")', '"c1e11-d128", "c1e12-d64", "c1e12-d128")')
    (tmp_path / "isoflop.py").write_text(text)
    study = studies.load_study(str(tmp_path / "isoflop.py"))
    root = tmp_path / "root"
    write_runs(root, study, [cell for cell in study.cells() if not cell.endswith("c1e12-d128")])
    write_report(root, describe(root, None))
    report = (root / "report.md").read_text()
    [header] = [line for line in report.splitlines() if line.startswith("| Arm | a | b |")]
    assert header.endswith("| M at 1e+10 | M at 1e+11 | M at 1e+12 |")
    [block] = [line for line in report.splitlines() if line.startswith("| block | ")]
    cells = block.strip("| ").split(" | ")
    assert float(cells[3]) == pytest.approx(TRUE, rel=0.01)
    assert float(cells[4]) == pytest.approx(TRUE, rel=0.01) and cells[5] == "—"
    assert "| 1e+12 | block | 1 (2) | — | — | no fit: a parabola needs losses at three or more " \
        "sizes |" in report
    [claim] = [line for line in report.splitlines() if line.startswith("| 1.25x |")]
    assert claim.endswith("| — (a parabola needs losses at three or more sizes) | — | exploratory:"
                          " finished seeds, registered n = 2: baseline@c1e12-d128 has 0, "
                          "block@c1e12-d128 has 0 |")


def test_a_multiplier_claim_needs_an_isoflop_study_and_the_papers_number(tmp_path):
    text = ISOFLOP_STUDY.replace('"c1e10-d16", ', '"s16", ')
    (tmp_path / "fixed.py").write_text(text)
    with pytest.raises(UsageError, match="needs an IsoFLOP study"):
        studies.load_study(str(tmp_path / "fixed.py"))
    (tmp_path / "nopaper.py").write_text(ISOFLOP_STUDY.replace('PAPER = {"block": 1.25}',
                                                               "PAPER = {}"))
    with pytest.raises(UsageError, match="the paper's multiplier in PAPER"):
        studies.load_study(str(tmp_path / "nopaper.py"))
    assert studies.size_budget("c2e13-d64L8") == 2e13 and studies.size_budget("xl") is None


# The study file ----------------------------------------------------------------------------

@pytest.mark.slow
def test_the_study_file_registers_its_claims_and_every_cell_builds():
    """Every cell's config builds at the cpu scale without training: ≥ 3 budgets spanning ≥
    10×, ≥ 4 sizes per budget, ≥ 16 sublayers, and tokens = steps × batch × seq within half a
    step of C / (6N) with N = flops_per_token / 6 of the cell's resolved model, counted without
    AttnRes's depth reads (the steps were set so; the report places each run at its true C)."""
    study = studies.load_study(str(ROOT / STUDY))
    module = load_module(str(ROOT / STUDY), "--study")
    v1, v2 = study.claims
    assert (v1.arm, v1.relation, v1.reference, v1.metric, v1.n) == \
        ("block", ">", "baseline", studies.MULTIPLIER, 2)
    assert (v2.arm, v2.relation, v2.reference, v2.metric, v2.n, v2.family) == \
        ("block", ">", "baseline", "compute_multiplier_misfit", 3, "AttnRes compute v2")
    assert study.paper == {"block": 1.25} and studies.is_isoflop(study.scaling)
    budgets: dict[float, list[str]] = {}
    for size in study.scaling:
        budgets.setdefault(studies.size_budget(size), []).append(size)
    assert len(budgets) >= 3 and max(budgets) / min(budgets) >= 10
    assert all(len(sizes) >= 4 for sizes in budgets.values())
    for cell in study.cells():
        arm, size = studies.split_cell(cell)
        config = module.get_config(f"{cell},cpu")
        assert config.to_dict() == module.get_config(cell).to_dict()
        assert 2 * config.model.num_layers >= 16
        assert config.model.residual.name == {"baseline": "prenorm",
                                              "block": "block_attnres"}[arm]
        resolved = resolve(config, 1)
        n = flops_per_token(resolved.model, resolved.seq_len, training=True,
                            depth_mixing=False) / 6
        per_step = config.batch_size * config.seq_len
        tokens = studies.size_budget(size) / (6 * n)
        assert abs(config.steps * per_step - tokens) <= per_step / 2
        assert 0 < config.optimizer.warmup_steps < config.steps
        assert config.optimizer.schedule == "cosine"
