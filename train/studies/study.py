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
- optionally `CLAIMS`: the paper's directional claims, a tuple of (arm, relation, reference,
  text) with relation "<" (the arm ends at a lower loss than the reference: better) or ">"
  (higher: worse) and text the claim in the paper's words; the report checks each on the
  paired seeds (not in scaling studies);
- optionally `SCALING`: a tuple of size names for a scaling study. Each arm then runs at each
  size, as the run cell `ARM@SIZE` (get_config gets `"ARM@SIZE,SCALE"`), and the report fits
  a power law of loss against training compute per arm.

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
from train.rundir import file_lock

NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
RECORD = "study.json"


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
    claims: tuple[tuple[str, str, str, str], ...] = ()

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
    return Study(path=path, arms=arms, baseline=module.BASELINE,
                 seeds=tuple(int(s) for s in seeds), scales=scales,
                 paper={arm: float(number) for arm, number in paper.items()},
                 paper_metric=str(metric), scaling=scaling,
                 claims=_claims(getattr(module, "CLAIMS", ()), arms, scaling, flag))


RELATIONS = ("<", ">")  # the arm ends at a lower / higher loss than the reference


def _claims(claims, arms: tuple[str, ...], scaling: tuple[str, ...],
            flag: str) -> tuple[tuple[str, str, str, str], ...]:
    """`CLAIMS` checked: (arm, relation, reference, text) tuples over ARMS; one-line errors."""
    if not isinstance(claims, tuple | list):
        raise UsageError(f"{flag}: CLAIMS must be a tuple of (arm, relation, reference, text); "
                         f"got {claims!r}")
    if claims and scaling:
        raise UsageError(f"{flag}: CLAIMS are checked per arm, not in a scaling study")
    for claim in claims:
        if not (isinstance(claim, tuple | list) and len(claim) == 4
                and all(isinstance(part, str) for part in claim)):
            raise UsageError(f"{flag}: a claim is (arm, relation, reference, text), four "
                             f"strings; got {claim!r}")
        arm, relation, reference, text = claim
        for name in (arm, reference):
            if name not in arms:
                raise UsageError(f"{flag}: CLAIMS names {name!r}, not one of ARMS {arms}")
        if relation not in RELATIONS or arm == reference or not text.strip():
            raise UsageError(f"{flag}: claim {claim!r} needs a relation '<' or '>' between two "
                             "different arms and the paper's words")
    return tuple(tuple(claim) for claim in claims)


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
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"--root={root}: {RECORD} cannot be read ({error})") from None
    if not isinstance(record, dict):
        raise UsageError(f"--root={root}: {RECORD} is not a JSON object")
    return record


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
            "paper_metric": study.paper_metric, "claims": [list(c) for c in study.claims]}
    path = root / RECORD
    temporary = path.with_name(RECORD + ".tmp")  # one writer at a time: the lock
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    temporary.replace(path)
    return data
