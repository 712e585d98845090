"""A learning rate per arm (docs/studies.md): `scripts/sweep.py --tune` trains each cell once over
the study's `TUNING` grid of rates and picks the rate of lowest loss on a tuning split; then
`scripts/sweep.py --tuned` trains the registered seeds of each cell at its own rate.

The tuning runs are ordinary runs of the sweep (`train.studies.sweep.run_local`: resumable,
with provenance), one per (cell, rate), in `ROOT/tuning/<cell>/lr<rate>`, each with
`--config.optimizer.learning_rate=RATE --config.data.tuning_fraction=F` (and
`--config.steps=N` when TUNING gives steps). With `data.tuning_fraction` F the run trains on
the train split less its last F and evaluates on that tail (`train.data.in_memory.tuning_split`),
so the rate is picked on data that neither the tuning runs train on nor the report's
validation split holds. While the best rate is the lowest (highest) of the grid, the grid
gains half the lowest (twice the highest) rate, at most `MAX_EXTENSIONS` times per cell; a run
that fails (e.g. diverges) counts as worse than any finished one.

`ROOT/tuning.json` records the grid of each cell (each rate's tuning loss and run state), its
pick, whether the pick is interior, and the cell's shared rate (its config's). The tuned-rate
runs form a sweep root of their own, `ROOT/tuned` (its study.json, `ROOT/tuned/<cell>/seed<k>`),
so they sit beside the shared-rate runs of ROOT. Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

from config import cli
from config.cli import UsageError
from train.rundir import DamagedFile, file_lock, read_json
from train.studies import study as studies
from train.studies import sweep

TUNING_RECORD = "tuning.json"
TUNING_DIR = "tuning"  # ROOT/tuning/<cell>/lr<rate>: the tuning runs
TUNED_DIR = "tuned"  # ROOT/tuned: the sweep root of the tuned-rate runs
MAX_EXTENSIONS = 4
RESERVED_FIELDS = ("optimizer.learning_rate", "data.tuning_fraction")


def rate_flag(rate: float) -> str:
    """The override that sets a run's learning rate."""
    return f"--config.optimizer.learning_rate={rate!r}"


def tuning_dir(root: str | Path, cell: str, rate: float) -> Path:
    """The run directory of the tuning run of `cell` at `rate`."""
    return Path(root) / TUNING_DIR / cell / f"lr{rate!r}"


def best_rate(losses: dict[float, float | None]) -> float | None:
    """The rate of lowest finite loss (the lowest such rate on a tie), or None when none has
    one."""
    finite = [(loss, rate) for rate, loss in losses.items()
              if loss is not None and math.isfinite(loss)]
    return min(finite)[1] if finite else None


def extension(losses: dict[float, float | None]) -> float | None:
    """The rate to add to the grid `losses` (rate → tuning loss, None for a failed run): half
    the lowest rate when the best is the lowest, twice the highest when it is the highest; None
    when the best is interior or no run has a loss."""
    best = best_rate(losses)
    if best is None:
        return None
    if best == min(losses):
        return best / 2
    if best == max(losses):
        return best * 2
    return None


def shared_rate(study: studies.Study, scale: str, cell: str, overrides: list[str]) -> float:
    """The learning rate `cell` trains at in the shared-rate sweep: its config's, with the
    sweep's overrides."""
    config = cli.load_experiment(study.config_arg(cell, scale))
    cli.apply_overrides(config, cli.split_overrides(list(overrides))[1])
    return float(config.optimizer.learning_rate)


def tuning_runs(study: studies.Study, root: str | Path, scale: str, cell: str,
                rates: list[float], overrides: list[str]) -> list[sweep.Run]:
    """The tuning runs of `cell` at `rates` (see the module docstring)."""
    tuning = study.tuning
    flags = [*overrides, f"--config.data.tuning_fraction={tuning.fraction!r}"]
    if tuning.steps is not None:
        flags.append(f"--config.steps={tuning.steps}")
    return [sweep.Run(cell, tuning.seed, study.config_arg(cell, scale),
                      tuning_dir(root, cell, rate), (*flags, rate_flag(rate)),
                      note=f"lr={rate:g} (tuning)") for rate in rates]


def cell_record(root: str | Path, cell: str, rates: list[float], extensions: int,
                shared: float) -> dict:
    """What tuning.json says of `cell`: its grid (rate, tuning loss, run state), pick, whether
    the pick is interior, the extensions made and its shared rate."""
    grid = []
    for rate in sorted(rates):
        state, loss = studies.run_state(tuning_dir(root, cell, rate))
        grid.append({"rate": rate, "loss": loss if state == "finished" else None,
                     "state": state})
    pick = best_rate({row["rate"]: row["loss"] for row in grid})
    interior = pick is not None and min(rates) < pick < max(rates)
    return {"shared_rate": shared, "grid": grid, "pick": pick, "interior": interior,
            "extensions": extensions}


# The fields of tuning.json (`_header`, `cell_record`) and their types, checked when it is read
# (float: any number; None: null); "at" may be absent (records written before it: None).
_RECORD_TYPES = {"study": str, "scale": str, "seed": int, "steps": (int, None), "fraction": float,
                 "overrides": list, "max_extensions": int, "cells": dict}
_CELL_TYPES = {"shared_rate": float, "grid": list, "pick": (float, None), "interior": bool,
               "extensions": int}
_ROW_TYPES = {"rate": float, "loss": (float, None), "state": str}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               list: "a list", dict: "an object", None: "null"}


def _is(value: object, kind: type | None) -> bool:
    """Whether the JSON value `value` is of `kind` (float: any number; None: null; true and
    false are of bool only)."""
    if kind is None:
        return value is None
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    return isinstance(value, (int, float) if kind is float else kind)


def _type_problem(record: object, types: dict, where: str) -> str | None:
    """What is wrong with the JSON object `record` (named `where`, e.g. "cells.a.") as a phrase
    after the file's name: its first field missing or not of its type in `types`; None if
    none is."""
    if not isinstance(record, dict):
        return f"has {where.rstrip('.')}={record!r}, not an object"
    for key, kinds in types.items():
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if key not in record:
            return f"has no {where}{key}"
        if not any(_is(record[key], kind) for kind in kinds):
            return (f"has {where}{key}={record[key]!r}, not "
                    + " or ".join(_TYPE_NAMES[kind] for kind in kinds))
    return None


def _record_problem(record: object) -> str | None:
    """What is wrong with tuning.json's value `record`, or None (see `_type_problem`)."""
    if not isinstance(record, dict):
        return f"holds a JSON {type(record).__name__}, not an object"
    if problem := _type_problem(record, _RECORD_TYPES, ""):
        return problem
    if not all(isinstance(flag, str) for flag in record["overrides"]):
        return f"has overrides={record['overrides']!r}, not a list of strings"
    for cell, entry in record["cells"].items():
        if problem := _type_problem(entry, _CELL_TYPES, f"cells.{cell}."):
            return problem
        for number, row in enumerate(entry["grid"]):
            if problem := _type_problem(row, _ROW_TYPES, f"cells.{cell}.grid[{number}]."):
                return problem
    return None


def read_tuning(root: str | Path) -> dict | None:
    """ROOT/tuning.json as a dict, or None when there is none; a one-line UsageError naming
    the file, what is wrong with it and the fix if it is damaged (a directory, not UTF-8, not
    JSON, or a field missing or of the wrong type: `_record_problem`); it is left as is."""
    path = Path(root) / TUNING_RECORD
    if not path.exists():
        return None
    try:
        record = read_json(path)
    except DamagedFile as problem:
        raise _damaged(root, str(problem)) from None
    if problem := _record_problem(record):
        raise _damaged(root, problem)
    return record


def _damaged(root: str | Path, problem: str) -> UsageError:
    """The one line of a damaged tuning.json: `problem`, a phrase after its path, and the fix."""
    return UsageError(f"--root={root}: {Path(root) / TUNING_RECORD} {problem}; it is left as is: "
                      "put back a copy, or move it aside and rerun scripts/sweep.py --tune with "
                      "this --root and the sweep's arguments to write it again (finished tuning "
                      "runs are kept)")


def _header(study: studies.Study, scale: str, overrides: list[str]) -> dict:
    tuning = study.tuning
    return {"study": study.path, "scale": scale, "seed": tuning.seed, "steps": tuning.steps,
            "fraction": tuning.fraction, "at": tuning.at, "overrides": list(overrides),
            "max_extensions": MAX_EXTENSIONS}


def check_root(root: str | Path, study: studies.Study, scale: str,
               overrides: list[str] | None = None) -> dict | None:
    """Refuse a ROOT whose study.json or tuning.json is of another study or scale, or (with
    `overrides`, for --tune) whose tuning.json was tuned with other TUNING or overrides: one
    line. Returns tuning.json (None when absent)."""
    expected = {"study": os.path.normpath(study.path), "scale": scale}
    for name, record in ((studies.RECORD, studies.read_record(root)),
                         (TUNING_RECORD, read_tuning(root))):
        for key, value in expected.items():
            recorded = str((record or {}).get(key, value))
            if (os.path.normpath(recorded) if key == "study" else recorded) != value:
                raise UsageError(f"--root={root}: its {name} is of {key} {recorded!r}, not "
                                 f"{value!r}; pass another --root")
    tuning = read_tuning(root)
    if tuning is not None and overrides is not None:
        header = _header(study, scale, overrides)
        changed = [key for key in header if key not in ("study", "scale")
                   and tuning.get(key) != header[key]]
        if changed:
            raise UsageError(f"--root={root}: its {TUNING_RECORD} was tuned with {changed[0]} "
                             f"{tuning.get(changed[0])!r}, not {header[changed[0]]!r}; pass "
                             "another --root")
    return tuning


def _write(root: Path, study: studies.Study, scale: str, overrides: list[str],
           cells: dict[str, dict]) -> dict:
    """Merge `cells` into ROOT/tuning.json under its lock; returns the record."""
    with file_lock(root / (TUNING_RECORD + ".lock")):
        previous = read_tuning(root) or {"cells": {}}
        record = {**_header(study, scale, overrides), "cells": {**previous["cells"], **cells}}
        path = root / TUNING_RECORD
        temporary = path.with_name(TUNING_RECORD + ".tmp")
        temporary.write_text(json.dumps(record, indent=2) + "\n")
        temporary.replace(path)
    return record


def tune(study: studies.Study, root: str | Path, scale: str, cells: list[str],
         overrides: list[str],
         runner: Callable[[list[sweep.Run]], int] | None = None) -> dict:
    """Tune the learning rate of each of `cells` (module docstring; with TUNING's `at`, of
    their arms' cells at that size), launching each round's runs with `runner` (default
    `sweep.run_local`), and record ROOT/tuning.json after each round. Returns the record."""
    root, runner = Path(root), runner or sweep.run_local
    check_root(root, study, scale, overrides)
    cells = list(dict.fromkeys(study.tuning.tuning_cell(cell) for cell in cells))
    shared = {cell: shared_rate(study, scale, cell, overrides) for cell in cells}
    grids = {cell: list(study.tuning.rates) for cell in cells}
    extensions = dict.fromkeys(cells, 0)
    new = {cell: list(rates) for cell, rates in grids.items()}
    while new:
        runner([run for cell, rates in new.items()
                for run in tuning_runs(study, root, scale, cell, rates, overrides)])
        done = {cell: cell_record(root, cell, grids[cell], extensions[cell], shared[cell])
                for cell in cells}
        record = _write(root, study, scale, overrides, done)
        new = {}
        for cell in cells:
            rate = extension({row["rate"]: row["loss"] for row in done[cell]["grid"]})
            if rate is not None and extensions[cell] < MAX_EXTENSIONS:
                grids[cell].append(rate)
                extensions[cell] += 1
                new[cell] = [rate]
    return record


def summary(record: dict, cells: list[str]) -> list[str]:
    """One line per cell: its pick and whether the grid brackets it."""
    lines = []
    for cell in cells:
        entry = record["cells"][cell]
        pick = entry["pick"]
        if pick is None:
            lines.append(f"arm={cell}: no tuning run finished; no rate picked")
            continue
        loss = next(row["loss"] for row in entry["grid"] if row["rate"] == pick)
        where = "interior" if entry["interior"] else (
            f"at the edge of the grid after {entry['extensions']} extensions: the best rate may "
            "lie beyond it")
        lines.append(f"arm={cell}: lr={pick:g} (tuning loss {loss:.4f}; shared "
                     f"{entry['shared_rate']:g}), {where}")
    return lines


def tuned_rates(root: str | Path, study: studies.Study, scale: str, cells: list[str],
                overrides: list[str]) -> dict[str, float]:
    """The picked rate of each of `cells` from ROOT/tuning.json; a one-line UsageError when
    there is none, it is of another study, scale or overrides, or a cell has no pick."""
    tuning = check_root(root, study, scale)
    if tuning is None:
        raise UsageError(f"--root={root} has no {TUNING_RECORD}; tune first: python "
                         f"scripts/sweep.py --study {study.path} --root {root} --tune")
    if list(tuning.get("overrides", [])) != list(overrides):
        raise UsageError(f"--root={root}: the rates were tuned with the overrides "
                         f"{tuning.get('overrides')!r}, not {list(overrides)!r}; pass the same "
                         "after --")
    rates = {}
    for cell in cells:
        source = study.tuning.tuning_cell(cell) if study.tuning else cell
        pick = tuning["cells"].get(source, {}).get("pick")
        if pick is None:
            raise UsageError(f"--root={root}: {TUNING_RECORD} has no tuned rate for arm "
                             f"{source!r}; tune it: --tune --arms {studies.split_cell(cell)[0]}")
        rates[cell] = float(pick)
    return rates


def tuned_plan(study: studies.Study, root: str | Path, scale: str, cells: list[str],
               seeds: list[int], overrides: list[str]) -> list[sweep.Run]:
    """The runs of `cells` × `seeds` in ROOT/tuned, each cell at its tuned rate (the last
    override of its command line)."""
    rates = tuned_rates(root, study, scale, cells, overrides)
    return [dataclasses.replace(run, note=f"lr={rates[cell]:g} (tuned)") for cell in cells
            for run in sweep.plan(study, Path(root) / TUNED_DIR, scale, [cell], seeds,
                                  [*overrides, rate_flag(rates[cell])])]
