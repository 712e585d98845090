"""Reruns of a study's committed runs at today's code (`scripts/study_report.py --rerun K`): is a
committed result still what the code gives, or does float rounding decide it?

For each cell, its K lowest finished seeds are trained again into ROOT/reruns/<cell>/seed<k>
with the command their provenance records (the last launch's `python -m train` arguments, the
work directory replaced), by the sweep runner (`train.studies.sweep.run_local`: resumable, its
own provenance). Then each rerun's final eval loss is compared with the committed one:

    moved = |L_rerun − L_committed|,  scale = the cell's paired SD,

the paired SD being that of the cell's differences to the baseline over the seeds both
finished (for the baseline itself, the SD of its own seeds' losses). A cell with a rerun that
moves by more than `SENSITIVE` × its paired SD is **sensitive to rounding**: a refactor that
changes only float rounding can move it by a share of the very spread its claims are tested
against. The committed runs stay the record; the reruns are the check. No JAX.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from train.studies import provenance, stats
from train.studies import study as studies
from train.studies.sweep import Run

RERUNS = "reruns"  # ROOT/reruns/<cell>/seed<k>
SENSITIVE = 0.1  # a rerun moving by more than this share of its cell's paired SD


def _arguments(command: list[str]) -> tuple[str, list[str]] | None:
    """(the --config value, the other flags but --workdir and --config.seed) of a recorded
    `python -m train` command, or None when it is not one."""
    if "train" not in command or "--config" not in command:
        return None
    rest = command[command.index("train") + 1:]
    config, flags = rest[rest.index("--config") + 1], []
    pairs = iter(rest)
    for argument in pairs:
        if argument in ("--config", "--workdir"):
            next(pairs, None)  # its value
        elif not argument.startswith("--config.seed="):
            flags.append(argument)
    return config, flags


def plan(root: str | Path, results: dict, per_arm: int,
         description: dict) -> tuple[list[Run], list[tuple]]:
    """(the runs to train, [(cell, seed, why)] of the chosen runs that cannot be rerun): each
    cell's `per_arm` lowest finished seeds, from `results` (cell → seed → a report `Result`).
    A run without provenance (runs committed before provenance was recorded) reruns with the
    command the sweep would give it from ROOT/study.json (`description`: study, scale,
    overrides); a tuned root's runs all have provenance."""
    runs, skipped = [], []
    for cell, finished in results.items():
        for seed in sorted(finished)[:per_arm]:
            launches = finished[seed].launches
            workdir = Path(root) / RERUNS / cell / f"seed{seed}"
            if not launches:
                runs.append(Run(cell, seed, f"{description['study']}:{cell},"
                                f"{description['scale']}", workdir,
                                tuple(description.get("overrides", [])),
                                note="(command from study.json)"))
                continue
            parsed = _arguments(launches[-1].get("command", []))
            if parsed is None:
                skipped.append((cell, seed, "its provenance records no `python -m train` "
                                "command"))
                continue
            runs.append(Run(cell, seed, parsed[0], workdir, tuple(parsed[1])))
    return runs, skipped


@dataclasses.dataclass(frozen=True)
class Rerun:
    """One rerun against its committed run: the losses, |moved|, the cell's paired SD, and
    whether it is sensitive to rounding (moved > SENSITIVE × paired SD)."""

    cell: str
    seed: int
    committed: float
    rerun: float | None
    moved: float
    paired_std: float
    sensitive: bool
    commit: str


def paired_std(results: dict, cell: str, baseline_cell: str) -> float:
    """The SD of the cell's paired differences to `baseline_cell` (of the baseline's own losses
    when the cell is the baseline); nan with fewer than 2 seeds."""
    own = {seed: run.loss for seed, run in results.get(cell, {}).items()}
    if cell == baseline_cell:
        return stats.mean_std(list(own.values()))[1]
    base = {seed: run.loss for seed, run in results.get(baseline_cell, {}).items()}
    return stats.paired_difference(own, base)[1]


def compare(root: str | Path, results: dict, runs: list[Run], baseline_of) -> list[Rerun]:
    """Each of `runs` (trained or not) against its committed run; `baseline_of(cell)` names the
    cell it is paired with."""
    rows = []
    for run in runs:
        committed = results[run.cell][run.seed].loss
        state, loss = studies.run_state(run.workdir)
        launches = provenance.read(run.workdir)
        commit = (launches[-1].get("commit") or "")[:7] if launches else ""
        scale = paired_std(results, run.cell, baseline_of(run.cell))
        moved = abs(loss - committed) if state == "finished" else math.nan
        rows.append(Rerun(run.cell, run.seed, committed, loss if state == "finished" else None,
                          moved, scale, bool(moved > SENSITIVE * scale), commit))
    return rows


def table(rows: list[Rerun], skipped: list[tuple]) -> list[str]:
    """The Markdown of `compare`'s rows, with the runs that could not be rerun."""
    lines = ["| Arm | Seed | Committed | Rerun (commit) | \\|moved\\| | Paired SD | "
             "\\|moved\\| / SD | Verdict |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.rerun is None:
            lines.append(f"| {row.cell} | {row.seed} | {row.committed:.4f} | — | — | "
                         f"{row.paired_std:.4f} | — | not finished |")
            continue
        ratio = row.moved / row.paired_std if row.paired_std > 0 else math.nan
        verdict = "**sensitive to rounding**" if row.sensitive else "stable"
        lines.append(f"| {row.cell} | {row.seed} | {row.committed:.4f} | {row.rerun:.4f} "
                     f"({row.commit}) | {row.moved:.4f} | {row.paired_std:.4f} | "
                     f"{ratio:.2f} | {verdict} |")
    lines += [f"| {cell} | {seed} | — | — | — | — | — | not rerun: {why} |"
              for cell, seed, why in skipped]
    return lines
