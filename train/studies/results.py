"""The finished runs of a sweep root, as the report reads them (`collect`: each run's final
eval loss, curve, training FLOPs, provenance and multiple-choice results), and the number
formats the report's sections share."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import ml_collections

from arch.accounting import flops_per_token
from config.defaults import base_config
from train import rundir
from train.studies import provenance, stats
from train.studies import study as studies


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

def final_losses(results: dict[str, dict[int, Result]]) -> dict[str, dict[int, float]]:
    """cell → seed → final eval loss of the finished runs."""
    return {cell: {seed: run.loss for seed, run in runs.items()}
            for cell, runs in results.items()}

def value_text(mean: float, std: float, n: int, digits: int = 4) -> str:
    """`mean ± std` to `digits` decimals; `—` for a std of one value and for no values."""
    if n == 0:
        return "—"
    spread = f"{std:.{digits}f}" if math.isfinite(std) else "—"
    return f"{mean:.{digits}f} ± {spread}"

def baseline_cell(cell: str, baseline: str) -> str:
    """The cell `cell` is compared with: the baseline arm (at the same size)."""
    _, size = studies.split_cell(cell)
    return f"{baseline}@{size}" if size else baseline

def p_text(p: float) -> str:
    return "—" if math.isnan(p) else "< 0.001" if p < 0.001 else f"{p:.3f}"

def interval_text(mean: float, std: float, n: int) -> str:
    """`Δ [low, high] (n)` with the 95% t interval; `—` without a pair."""
    if n == 0:
        return "— (0)"
    if n == 1:
        return f"{mean:+.4f} (1)"
    low, high = stats.t_interval(mean, std, n, stats.LEVEL)
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}] ({n})"

def seed_losses(results: dict[str, dict[int, Result]], cell: str) -> dict[int, float]:
    return {seed: run.loss for seed, run in results.get(cell, {}).items()}
