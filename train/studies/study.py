"""Studies: an experiment file that declares several arms, and the run directories of a sweep of
them (docs/studies.md). Imports only the standard library and `config`: the runner
(`train.studies.sweep`) reads a study and its runs without JAX.

A study file `experiments/<study>.py` is an experiment file (`get_config(arg)`, with arg
`"ARM,SCALE"`) that also declares, at module level:

- `ARMS`: tuple of arm names (letters, digits, `_`, `-`, `.`);
- `BASELINE`: the arm the others are compared with, one of ARMS;
- `SEEDS`: the default seeds, distinct non-negative ints;
- `SCALES`: the scales get_config knows, e.g. `("cpu", "paper")`; the first is the default;
- optionally `PAPER` (dict arm → the paper's number) with `PAPER_METRIC` (str: what it is);
- optionally `CLAIMS`: the registered claims, each a dict of `experiments.common.claim`
  (`Claim` below: the arms compared, a direction "<" / ">" or an equivalence "≈" with its
  margin, the quote and its source, the family Holm's correction runs in, the seed count n),
  registered before the runs that test them; the report tests each (not in scaling studies);
- optionally `NUMERICS_SINCE`: the commit from which the code gives the study's numbers; a
  claim whose runs trained at older code, or have no provenance record, is exploratory;
- optionally `REGISTERED`: when the claims were registered (an ISO 8601 date or time in UTC,
  e.g. "2026-12-06T05:30"), for claims registered after some of their runs: a claim with a run
  first launched before it, or without a provenance record, is exploratory (post hoc);
- optionally `TUNING`: the learning-rate grid of `scripts/sweep.py --tune` (`Tuning`), e.g.
  `dict(rates=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2), seed=0)` with optional `steps` (the tuning
  runs' length; default the arm's), `fraction` (the tail of the train split they evaluate on;
  default 0.1) and, in a scaling study, `at` (a SCALING size: each arm is tuned at that size
  only and every size of the arm trains at its rate): at least 5 rates, ascending, each twice
  the one before;
- optionally `SCALING`: a tuple of size names for a scaling study. Each arm then runs at each
  size, as the run cell `ARM@SIZE` (get_config gets `"ARM@SIZE,SCALE"`), and the report fits
  a power law of loss against training compute per arm;
- optionally `SCALING_AXIS`: what the SCALING sizes vary, "model" (default: the model's size)
  or "steps" (one model trained for several lengths, each with its own schedule); the report
  of a "steps" study adds Δ per length (`train.studies.scaling_report.length_section`). In a scaling
  study, CLAIMS compare cells `ARM@SIZE` (e.g. `claim("block@steps3200", "<",
  "baseline@steps3200", ...)`). An IsoFLOP study (`is_isoflop`) names every size
  `c<BUDGET>-<SHAPE>`, e.g. `c2e13-d64L8` (`size_budget`): the report then fits, per arm and
  budget, a parabola of final loss in log N and a power law through the minima
  (`train.studies.stats`); its claims may be about the frontier's compute multiplier
  (`metric="compute_multiplier"`: arms, not cells, a direction about 1, the paper's number in
  PAPER).

A sweep root holds one run directory per (cell, seed): `ROOT/<cell>/seed<k>`, and
`ROOT/study.json`, what the runner was asked to run (`record`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

from config.cli import UsageError, load_module
from train.rundir import DamagedFile, file_lock, read_json
from train.studies import provenance

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
RECORD = "study.json"
SCALING_AXES = ("model", "steps")  # what a scaling study's sizes vary
RELATIONS = ("<", ">", "≈")  # the arm ends lower / higher than the reference / within a margin
# A run's final eval_loss; an IsoFLOP frontier's compute multiplier, judged by its interval over
# seeds or by its misfit-aware interval (train.studies.stats.misfit_bootstrap_frontier_multiplier).
METRICS = ("eval_loss", "compute_multiplier", "compute_multiplier_misfit")
MULTIPLIER = "compute_multiplier"
MULTIPLIERS = ("compute_multiplier", "compute_multiplier_misfit")
BUDGET = re.compile(r"^c(\d+(?:\.\d+)?(?:e\d+)?)-[A-Za-z0-9_.-]+$")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A registered claim: Δ = arm − reference in the final `metric`, paired by seed, is
    negative ("<": the arm ends lower, better), positive (">") or within (−margin, margin)
    ("≈", margin in the metric's units); `quote` says it in its source's words, `source` where
    it comes from; the report corrects its p with the other claims of `family` (Holm) and
    counts it confirmatory only with exactly `n` finished seeds of each arm; a direction is
    tested two-sided (`tails` 2) or one-sided toward the claimed side (1)."""

    arm: str
    relation: str
    reference: str
    quote: str
    source: str
    family: str
    n: int
    margin: float | None = None
    metric: str = "eval_loss"
    tails: int = 2

    def check(self) -> str:
        """The claim as a check: `full < baseline`, `block < baseline (one-sided)`,
        `gr_top2 ≈ gr (|Δ| < 0.005)`."""
        bound = f" (|Δ| < {self.margin:g})" if self.relation == "≈" else \
            " (one-sided)" if self.tails == 1 else ""
        return f"{self.arm} {self.relation} {self.reference}{bound}"


@dataclasses.dataclass(frozen=True)
class Tuning:
    """A study's learning-rate grid (`TUNING`): each cell trains once, at `seed`, for `steps`
    (None: its config's), at each of `rates`, evaluating on the tuning split, the last
    `fraction` of its train split (`data.tuning_fraction`); `train.studies.tuning` extends the
    grid by a factor of 2 at an edge while the best rate lies there. With `at` (a scaling
    study's size), each arm is tuned at `ARM@at` only and every cell of the arm takes its
    rate (`tuning_cell`)."""

    rates: tuple[float, ...]
    seed: int
    steps: int | None = None
    fraction: float = 0.1
    at: str | None = None

    def tuning_cell(self, cell: str) -> str:
        """The cell whose tuned rate `cell` trains at: itself, or `ARM@at`."""
        return cell if self.at is None else f"{split_cell(cell)[0]}@{self.at}"


TUNING_FIELDS = tuple(field.name for field in dataclasses.fields(Tuning))
MIN_RATES = 5


@dataclasses.dataclass(frozen=True)
class Study:
    """The declarations of a study file (see the module docstring)."""

    path: str
    arms: tuple[str, ...]
    baseline: str
    seeds: tuple[int, ...]
    scales: tuple[str, ...]
    paper: dict[str, float]
    paper_metric: str
    scaling: tuple[str, ...]
    claims: tuple[Claim, ...] = ()
    numerics_since: str = ""
    registered: str = ""
    tuning: Tuning | None = None
    scaling_axis: str = "model"

    def cells(self, arms: tuple[str, ...] | None = None,
              sizes: tuple[str, ...] | None = None) -> list[str]:
        """The run cells of `arms` (default all): the arm names, or `ARM@SIZE` for each of
        `sizes` (default all) of a scaling study, in declaration order."""
        arms = self.arms if arms is None else arms
        if not self.scaling:
            return list(arms)
        return [f"{arm}@{size}" for arm in arms for size in self.scaling
                if sizes is None or size in sizes]

    def config_arg(self, cell: str, scale: str) -> str:
        """The `--config` value of a cell at a scale: `PATH:CELL,SCALE`."""
        return f"{self.path}:{cell},{scale}"


def size_budget(size: str) -> float | None:
    """The compute budget (FLOPs) an IsoFLOP size name carries, `c2e13-d64L8` → 2e13; None for
    another name."""
    match = BUDGET.match(size)
    return float(match.group(1)) if match else None


def is_isoflop(scaling) -> bool:
    """Whether every size of a scaling study names its budget (`size_budget`)."""
    return bool(scaling) and all(size_budget(size) is not None for size in scaling)


def split_cell(cell: str) -> tuple[str, str | None]:
    """(arm, size or None) of a run cell `ARM` or `ARM@SIZE`."""
    arm, _, size = cell.partition("@")
    return arm, size or None


def _names(value, what: str, flag: str, *, empty: bool = False) -> tuple[str, ...]:
    """`value` as a tuple of distinct names (none allowed if `empty`), else a one-line
    UsageError about `what`."""
    if not isinstance(value, tuple | list) or (not value and not empty):
        raise UsageError(f"{flag}: {what} must be a non-empty tuple of names, e.g. "
                         f"('a', 'b'); got {value!r}")
    for name in value:
        if not isinstance(name, str) or not NAME.match(name):
            raise UsageError(f"{flag}: {what} has {name!r}, not a name of letters, digits, "
                             "'_', '-', '.' (it names run directories)")
    if len(set(value)) != len(value):
        raise UsageError(f"{flag}: {what} repeats a name: {value!r}")
    return tuple(value)


def load_study(path: str) -> Study:
    """The declarations of the study file `path`; a one-line UsageError (naming `--study`) for a
    file that does not load, has no docstring or get_config, or declares something wrong."""
    flag = f"--study={path}"
    module = load_module(path, "--study")
    if not (module.__doc__ or "").strip():
        raise UsageError(f"{flag} has no docstring; a study says where it comes from (the paper, "
                         "its claim, the hardware it needs)")
    if not callable(getattr(module, "get_config", None)):
        raise UsageError(f"{flag} defines no get_config(arg); a study's get_config takes "
                         "'ARM,SCALE'")
    for name in ("ARMS", "BASELINE", "SEEDS", "SCALES"):
        if not hasattr(module, name):
            raise UsageError(f"{flag} declares no {name}; a study declares ARMS, BASELINE, SEEDS "
                             "and SCALES (docs/studies.md)")
    arms = _names(module.ARMS, "ARMS", flag)
    if module.BASELINE not in arms:
        raise UsageError(f"{flag}: BASELINE={module.BASELINE!r} is not one of ARMS {arms}")
    seeds = module.SEEDS
    if (not isinstance(seeds, tuple | list) or not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                       for s in seeds)):
        raise UsageError(f"{flag}: SEEDS must be a non-empty tuple of distinct non-negative "
                         f"ints, e.g. (0, 1, 2); got {seeds!r}")
    scales = _names(module.SCALES, "SCALES", flag)
    paper = getattr(module, "PAPER", {})
    if not isinstance(paper, dict):
        raise UsageError(f"{flag}: PAPER must be a dict arm → number; got {paper!r}")
    for arm, number in paper.items():
        if arm not in arms:
            raise UsageError(f"{flag}: PAPER names {arm!r}, not one of ARMS {arms}")
        if not isinstance(number, int | float) or isinstance(number, bool) \
                or not math.isfinite(number):
            raise UsageError(f"{flag}: PAPER[{arm!r}]={number!r} is not a finite number")
    metric = getattr(module, "PAPER_METRIC", "")
    if paper and (not isinstance(metric, str) or not metric.strip()):
        raise UsageError(f"{flag} declares PAPER without PAPER_METRIC, the string saying what "
                         "its numbers are (e.g. 'final validation loss')")
    scaling = _names(getattr(module, "SCALING", ()), "SCALING", flag, empty=True)
    if len(scaling) == 1:
        raise UsageError(f"{flag}: SCALING={scaling!r} has one size; a power-law fit needs "
                         "at least two")
    axis = getattr(module, "SCALING_AXIS", "model")
    if axis not in SCALING_AXES or (axis != "model" and not scaling):
        raise UsageError(f"{flag}: SCALING_AXIS={axis!r} must be one of {SCALING_AXES}, and "
                         "other than 'model' only in a scaling study (with SCALING)")
    return Study(path=path, arms=arms, baseline=module.BASELINE,
                 seeds=tuple(int(s) for s in seeds), scales=scales,
                 paper={arm: float(number) for arm, number in paper.items()},
                 paper_metric=str(metric), scaling=scaling,
                 claims=_claims(getattr(module, "CLAIMS", ()), arms, scaling, flag, paper),
                 numerics_since=_numerics_since(getattr(module, "NUMERICS_SINCE", ""), flag),
                 registered=_registered(getattr(module, "REGISTERED", ""), flag),
                 tuning=_tuning(getattr(module, "TUNING", None), flag, scaling),
                 scaling_axis=axis)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


def _tuning(value, flag: str, scaling: tuple[str, ...] = ()) -> Tuning | None:
    """`TUNING` checked (None when not declared): a dict of `Tuning`'s fields with at least
    MIN_RATES positive rates, ascending, each twice the one before (to 1e-6), and `at` one of
    the `scaling` sizes; one-line UsageErrors."""
    if value is None:
        return None
    example = "e.g. TUNING = dict(rates=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2), seed=0)"
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: TUNING must be a dict, {example}; got {value!r}")
    unknown = [key for key in value if key not in TUNING_FIELDS]
    if unknown or "rates" not in value or "seed" not in value:
        what = f"has an unknown field {unknown[0]!r}" if unknown else "lacks 'rates' or 'seed'"
        raise UsageError(f"{flag}: TUNING {what}; its fields are {', '.join(TUNING_FIELDS)}, "
                         f"{example}")
    rates = value["rates"]
    if not isinstance(rates, tuple | list) or len(rates) < MIN_RATES \
            or not all(_is_number(rate) and rate > 0 for rate in rates):
        raise UsageError(f"{flag}: TUNING rates must be a tuple of at least {MIN_RATES} "
                         f"positive numbers; got {rates!r}")
    if any(not math.isclose(high, 2 * low, rel_tol=1e-6)
           for low, high in zip(rates, rates[1:], strict=False)):
        raise UsageError(f"{flag}: TUNING rates {tuple(rates)!r} must be ascending, each twice "
                         "the one before (a factor-of-2 grid)")
    seed, steps = value["seed"], value.get("steps")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"{flag}: TUNING seed={seed!r} must be a non-negative int")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool)
                              or steps <= 0):
        raise UsageError(f"{flag}: TUNING steps={steps!r} must be a positive int (or absent: "
                         "the arm's own steps)")
    fraction = value.get("fraction", Tuning.fraction)
    if not _is_number(fraction) or not 0 < fraction < 1:
        raise UsageError(f"{flag}: TUNING fraction={fraction!r} must be in (0, 1): the tail "
                         "of the train split the tuning runs evaluate on")
    at = value.get("at")
    if at is not None and at not in scaling:
        raise UsageError(f"{flag}: TUNING at={at!r} must be one of the study's SCALING sizes "
                         f"{scaling or '(none: it is not a scaling study)'}")
    return Tuning(rates=tuple(float(rate) for rate in rates), seed=seed, steps=steps,
                  fraction=float(fraction), at=at)


FIELDS = tuple(field.name for field in dataclasses.fields(Claim))
REQUIRED = tuple(field.name for field in dataclasses.fields(Claim)
                 if field.default is dataclasses.MISSING)
HOW = ("register it as claim(arm, relation, reference, quote=..., source=..., family=..., n=...) "
       "from experiments.common (docs/studies.md)")


def _claims(claims, arms: tuple[str, ...], scaling: tuple[str, ...], flag: str,
            paper: dict | None = None) -> tuple[Claim, ...]:
    """`CLAIMS` (or a record's "claims") checked: dicts of `experiments.common.claim` over ARMS,
    the claims of one family registering one n; one-line UsageErrors."""
    if not isinstance(claims, tuple | list):
        raise UsageError(f"{flag}: CLAIMS must be a tuple of claims; {HOW}")
    names = arms
    if scaling:  # a claim compares two cells ARM@SIZE
        names = tuple(f"{arm}@{size}" for arm in arms for size in scaling)
        for claim in claims:
            named = [claim.get(field) for field in ("arm", "reference")
                     if isinstance(claim, dict) and claim.get(field) in arms
                     and claim.get("metric") not in MULTIPLIERS]
            if named:
                raise UsageError(f"{flag}: CLAIMS name arms ({named[0]!r}), not in a scaling "
                                 f"study: there a claim compares cells ARM@SIZE, e.g. "
                                 f"{names[-1]!r}")
    checked = tuple(_claim(claim, arms if _multiplier(claim) else names, flag)
                    for claim in claims)
    for claim in checked:
        if claim.metric not in MULTIPLIERS:
            continue
        name = f"{flag}: claim {claim.check()} ({claim.metric})"
        if not is_isoflop(scaling):
            raise UsageError(f"{name} needs an IsoFLOP study: SCALING sizes named "
                             "c<BUDGET>-<SHAPE>, e.g. 'c2e13-d64L8'")
        if claim.relation == "≈" or claim.arm not in (paper or {}):
            raise UsageError(f"{name}: a compute-multiplier claim is a direction ('>': the "
                             "arm's multiplier exceeds 1) with the paper's multiplier in PAPER")
    families: dict[str, int] = {}
    for claim in checked:
        if families.setdefault(claim.family, claim.n) != claim.n:
            raise UsageError(f"{flag}: family {claim.family!r} registers n = "
                             f"{families[claim.family]} and n = {claim.n}; the claims of a "
                             "family share one seed count")
    return checked


def _multiplier(claim) -> bool:
    """Whether a declared claim is about an IsoFLOP frontier's compute multiplier."""
    return isinstance(claim, dict) and claim.get("metric") in MULTIPLIERS


def _claim(claim, arms: tuple[str, ...], flag: str) -> Claim:
    """One claim checked field by field; a one-line UsageError naming the claim and the fix."""
    if isinstance(claim, tuple | list) and len(claim) == 4:
        raise UsageError(f"{flag}: claim {tuple(claim)!r} is an unregistered (arm, relation, "
                         f"reference, text) tuple; {HOW}")
    if not isinstance(claim, dict):
        raise UsageError(f"{flag}: a claim is a dict of claim(...); got {claim!r}; {HOW}")
    name = f"{flag}: claim {claim.get('arm')!r} {claim.get('relation')} " \
           f"{claim.get('reference')!r}"
    missing = [field for field in REQUIRED if field not in claim]
    unknown = [field for field in claim if field not in FIELDS]
    if missing or unknown:
        what = f"lacks {missing[0]!r}" if missing else f"has an unknown field {unknown[0]!r}"
        raise UsageError(f"{name} {what}; a claim has the fields {', '.join(FIELDS)}")
    for field in ("arm", "reference"):
        if claim[field] not in arms:
            what = "the cells" if "@" in "".join(arms) else "ARMS"
            raise UsageError(f"{name}: {field} {claim[field]!r} is not one of {what} {arms}")
    if claim["arm"] == claim["reference"]:
        raise UsageError(f"{name} compares an arm with itself; name two different arms")
    relation, margin = claim["relation"], claim.get("margin")
    if relation not in RELATIONS:
        raise UsageError(f"{name}: relation {relation!r} is not '<' (the arm ends lower), '>' "
                         "(higher) or '≈' (within a margin)")
    if relation == "≈" and not (isinstance(margin, int | float) and not isinstance(margin, bool)
                                and math.isfinite(margin) and margin > 0):
        raise UsageError(f"{name}: an equivalence needs margin=M > 0 in the metric's units "
                         f"(|Δ| < M); got margin={margin!r}")
    if relation != "≈" and margin is not None:
        raise UsageError(f"{name}: a direction takes no margin (got margin={margin!r}); use "
                         "relation '≈' for an equivalence")
    for field in ("quote", "source", "family"):
        if not isinstance(claim[field], str) or not claim[field].strip():
            raise UsageError(f"{name}: {field} must be a non-empty string; got "
                             f"{claim[field]!r}")
    n = claim["n"]
    if not isinstance(n, int) or isinstance(n, bool) or n < 2:
        raise UsageError(f"{name}: n={n!r} must be the registered seed count, an int ≥ 2 (a "
                         "paired test needs two seeds)")
    tails = claim.get("tails", 2)
    if tails not in (1, 2) or isinstance(tails, bool) or (tails == 1 and relation == "≈"):
        raise UsageError(f"{name}: tails={tails!r} must be 2 (two-sided) or, for a direction, 1 "
                         "(one-sided toward the claimed side)")
    metric = claim.get("metric", "eval_loss")
    if metric not in METRICS:
        raise UsageError(f"{name}: metric {metric!r} is not one of {METRICS} (the run's final "
                         "value of it)")
    return Claim(**{**claim, "margin": None if margin is None else float(margin)})


def claims_from_record(root: str | Path, record: dict) -> tuple[Claim, ...]:
    """The claims recorded in ROOT/study.json, checked as the study file's are; a record of
    the old (arm, relation, reference, text) form is a one-line UsageError asking for --study."""
    claims = record.get("claims", [])
    if any(isinstance(claim, list) for claim in claims):
        raise UsageError(f"--root={root}: {RECORD} records claims in the old (arm, relation, "
                         "reference, text) form; pass --study experiments/STUDY.py to report "
                         "its registered claims")
    # A sweep of some arms (--arms, --tuned) records every claim of the study: the claims'
    # arms need not all have been swept, and a claim without runs is reported exploratory.
    arms = tuple(dict.fromkeys(
        [*(split_cell(cell)[0] for cell in record.get("cells", [])),
         *(split_cell(c[f])[0] for c in claims if isinstance(c, dict)
           for f in ("arm", "reference") if isinstance(c.get(f), str))]))
    return _claims(claims, arms, tuple(record.get("scaling", [])), f"--root={root}",
                   record.get("paper", {}))


def _numerics_since(value, flag: str) -> str:
    """`NUMERICS_SINCE` checked: "" or a commit id of 7–40 lowercase hex digits."""
    if value == "" or (isinstance(value, str) and COMMIT.match(value)):
        return value
    raise UsageError(f"{flag}: NUMERICS_SINCE={value!r} is not a commit id (7–40 lowercase hex "
                     "digits, e.g. 'a954c45')")


def _registered(value, flag: str) -> str:
    """`REGISTERED` checked: "" or an ISO 8601 date or time (UTC), returned as given."""
    if value == "":
        return value
    try:
        if isinstance(value, str) and provenance.utc_time(value):
            return value
    except ValueError:
        pass
    raise UsageError(f"{flag}: REGISTERED={value!r} is not an ISO 8601 date or time in UTC "
                     "(e.g. '2026-12-06T05:30')")


def run_dir(root: str | Path, cell: str, seed: int) -> Path:
    """The run directory of (cell, seed) in a sweep root: `ROOT/<cell>/seed<k>`."""
    return Path(root) / cell / f"seed{seed}"


def read_metrics(workdir: str | Path) -> list[dict]:
    """The records of `workdir/metrics.jsonl` ([] if absent); a torn line is skipped."""
    path = Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def final_eval_loss(records: list[dict]) -> float | None:
    """The last `eval_loss` of a run's metrics records, or None."""
    losses = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
    return float(losses[-1]) if losses else None


def run_steps(workdir: str | Path) -> int | None:
    """`steps` of the run's config.json, or None without a readable one."""
    try:
        return int(json.loads((Path(workdir) / "config.json").read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_state(workdir: str | Path, steps: int | None = None) -> tuple[str, float | None]:
    """(state, final eval_loss) of a run directory: "missing" (no directory), "not started (no
    metrics.jsonl)", "unfinished (step S of N)", "no eval_loss", or "finished". `steps`, the
    step the run must reach, defaults to its config.json's."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        return "missing", None
    steps = run_steps(workdir) if steps is None else steps
    records = read_metrics(workdir)
    if not records:
        return "not started (no metrics.jsonl)", None
    last = max(r["step"] for r in records)
    if steps is None or last < steps:
        return f"unfinished (step {last} of {steps if steps is not None else '?'})", None
    loss = final_eval_loss(records)
    return ("finished", loss) if loss is not None else ("no eval_loss", None)


def last_line(path: str | Path) -> str:
    """The last non-blank line of a text file (a run's train.log), or "" if there is none."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def read_record(root: str | Path) -> dict | None:
    """`ROOT/study.json` as a dict, or None when there is none; UsageError if unreadable."""
    path = Path(root) / RECORD
    if not path.exists():
        return None
    try:
        record = read_json(path)
    except DamagedFile as problem:
        raise _damaged_record(root, str(problem)) from None
    if not isinstance(record, dict):
        raise _damaged_record(root, f"holds a JSON {type(record).__name__}, not an object")
    for key, kind in RECORD_TYPES.items():
        value = record.get(key)
        if value is None:
            continue
        if kind is list and (not isinstance(value, list) or not all(
                isinstance(item, RECORD_ITEMS[key]) and not isinstance(item, bool)
                for item in value)):
            items = RECORD_ITEMS[key] if isinstance(RECORD_ITEMS[key], tuple) else (
                RECORD_ITEMS[key],)
            raise _damaged_record(root, f"has {key}={value!r}, not a list of "
                                  f"{' or '.join(kind.__name__ for kind in items)}")
        if kind is not list and not isinstance(value, kind):
            raise _damaged_record(root, f"has {key}={value!r}, not a {kind.__name__}")
    return record


# The types of study.json's fields (a list's items: RECORD_ITEMS), checked when it is read.
RECORD_TYPES = {"study": str, "scale": str, "baseline": str, "scaling": list, "cells": list,
                "seeds": list, "overrides": list, "paper": dict, "paper_metric": str,
                "claims": list, "numerics_since": str, "registered": str}
# A claim is a dict; a list is one written before claims were registered, which
# `claims_from_record` refuses with how to report the study's registered claims.
RECORD_ITEMS = {"scaling": str, "cells": str, "seeds": int, "overrides": str,
                "claims": (dict, list)}


def _damaged_record(root: str | Path, problem: str) -> UsageError:
    return UsageError(f"--root={root}: {Path(root) / RECORD} {problem}; it is left as is: put "
                      "back a copy, or move it aside and rerun scripts/sweep.py with this --root "
                      "and the sweep's arguments to write it again")


def record(root: str | Path, study: Study, scale: str, cells: list[str], seeds: list[int],
           overrides: list[str]) -> dict:
    """Write `ROOT/study.json`: the study path, scale, baseline, paper numbers, the overrides
    and the cells and seeds asked for, merged with what earlier sweeps into ROOT asked for
    (under a lock, so concurrent sweeps into ROOT lose nothing). A root holds one study at one
    scale: another is a UsageError. Returns the record."""
    with file_lock(Path(root) / (RECORD + ".lock")):
        return _merge_record(Path(root), study, scale, cells, seeds, overrides)


def _merge_record(root: Path, study: Study, scale: str, cells: list[str], seeds: list[int],
                  overrides: list[str]) -> dict:
    previous = read_record(root) or {}
    for key, value in (("study", study.path), ("scale", scale)):
        same = os.path.normpath if key == "study" else str
        if same(previous.get(key, value)) != same(value):
            raise UsageError(f"--root={root} holds a sweep of {key} {previous[key]!r}, not "
                             f"{value!r}; pass another --root")
    merged_cells = list(previous.get("cells", []))
    merged_cells += [cell for cell in cells if cell not in merged_cells]
    order = {cell: i for i, cell in enumerate(study.cells())}
    merged_cells.sort(key=lambda cell: order.get(cell, len(order)))
    data = {"study": study.path, "scale": scale, "baseline": study.baseline,
            "scaling": list(study.scaling), "cells": merged_cells,
            "seeds": sorted(set(previous.get("seeds", [])) | set(seeds)),
            "overrides": list(overrides), "paper": study.paper,
            "paper_metric": study.paper_metric,
            "claims": [dataclasses.asdict(claim) for claim in study.claims],
            "numerics_since": study.numerics_since, "registered": study.registered}
    if study.scaling_axis != "model":
        data["scaling_axis"] = study.scaling_axis
    path = root / RECORD
    temporary = path.with_name(RECORD + ".tmp")  # one writer at a time: the lock
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    temporary.replace(path)
    return data


def check_root(root: str, study: str | None, *, exists: bool = True) -> None:
    """A report's or probe's ROOT (with `exists`, an existing directory) holds a readable
    study.json, or `study` (--study) names a study file: one-line UsageError."""
    if exists and not Path(root).is_dir():
        raise UsageError(f"--root={root} is not a directory; pass a sweep's --root")
    if read_record(root) is None and study is None:
        raise UsageError(f"--root={root} has no {RECORD} (scripts/sweep.py writes it); "
                         "pass --study experiments/STUDY.py")
    if study is not None:
        load_study(study)
