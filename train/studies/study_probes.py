"""Per-depth probes across a study: every run of a sweep, or every cell's initialization, measured
on the same validation batch and summarized per cell over seeds (docs/studies.md): `write` (the
command line: scripts/study_probes.py).

For each (cell, seed) of the description (`train.studies.report.describe`: ROOT/study.json, or
a study file, as in `scripts/study_report.py`):
- by default, the newest checkpoint of the finished run ROOT/<cell>/seed<k>
  (`train.restore.restore_for_analysis`); unfinished runs are listed as missing;
- at initialization, the model that run starts from: the cell's config from the study file
  at the recorded scale, with the recorded overrides and `seed` = k, at step 0
  (`train.restore.initialization_for_analysis`). No run needs to exist.

Each model is measured on the first `batch` validation sequences of its config's length, in
evaluation mode: `probes.depth_profile` (hidden-state, gradient and rank-collapse profiles, FFN
dead units) and `layer_gradients.layer_gradient_norms` (‖∂loss/∂W‖_F per layer for every block
parameter). Writes, with PREFIX = "probes" (or "probes_init"):

  ROOT/PREFIX.json   every run's profile: {cell: {seed: {metric: list}}}, NaN as null
  ROOT/PREFIX.md     per cell, mean ± sample std over seeds (n): the probe batch's loss; the
                     numerical rank of the log-odds matrix of the batch's B·T contexts over
                     2(d + 1) tokens (`arch.bottleneck.model_bottleneck`: at most d for a single
                     softmax without bias, d + 1 with one; no bound for MoS); the distance
                     from rank 1 of the last hidden state, res(h_L); the curvature c of
                     log res(h_i) against depth i (least-squares fit log res = a + b·i + c·i²
                     over the boundaries with res > 1e-6: c < 0 means faster than exponential
                     decay); the fraction of FFN units never active (all layers); and the mean
                     over layers of ‖∂loss/∂W‖_F for the query, key, value and attention-output
                     projections and the FFN's down projection; and the last block's
                     ‖∂loss/∂W‖_F of the FFN's up projection over the first block's (Xiong et
                     al. 2020, Fig. 3: near 1 for Pre-LN, growing toward the output for Post-LN)
  ROOT/PREFIX_<metric>.png
                     by depth, mean over seeds with a ± std band, one line per cell, for
                     rank_collapse, gradient_rms, ffn_dead_units and the gradient norms of
                     query, key, value, output, ffn_up and ffn_down

Progress goes to stderr, one line per run.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from arch import bottleneck
from config import ConfigError, cli
from train.instruments import layer_gradients, probes
from train.restore import initialization_for_analysis, restore_for_analysis
from train.studies import study as studies

# Plotted names → the profile key they read (gradients by layer: `layer_gradient_norms` paths).
DEPTH_PLOTS = {
    "rank_collapse": "rank_collapse", "gradient_rms": "gradient_rms",
    "ffn_dead_units": "ffn_dead_units",
    "query": "grad:attention.query.kernel", "key": "grad:attention.key.kernel",
    "value": "grad:attention.value.kernel", "output": "grad:attention.output.kernel",
    "ffn_up": "grad:ffn.up.kernel", "ffn_down": "grad:ffn.down.kernel",
}
LOG_SCALE = {"rank_collapse", "gradient_rms", "query", "key", "value", "output", "ffn_up",
             "ffn_down"}
COLLAPSE_FLOOR = 1e-6  # res below this is float32 round-off, left out of the curvature fit


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(model, tokens_BxT1, sparsity_threshold: float) -> dict[str, list]:
    """One model's depth profile and per-layer gradient norms, as lists (keys: the
    `depth_profile` names, "loss", and "grad:<parameter path>")."""
    profile = probes.depth_profile(model, tokens_BxT1, sparsity_threshold=sparsity_threshold)
    result = {"loss": profile["loss"]}
    for key in ("rank_collapse", "gradient_rms", "hidden_rms", "block_influence",
                "ffn_dead_units", "ffn_sparsity"):
        result[key] = np.asarray(profile[key]).tolist()
    for path, norms in layer_gradients.layer_gradient_norms(model, tokens_BxT1).items():
        result[f"grad:{path}"] = norms.tolist()
    rank = bottleneck.model_bottleneck(model, tokens_BxT1[:, :-1])
    result["log_odds_rank"], result["log_odds_bound"] = rank["numerical_rank"], rank["bound"]
    return result


def collapse_curvature(rank_collapse) -> float:
    """c of the least-squares fit log res_i = a + b·i + c·i² over the boundaries i with res_i >
    COLLAPSE_FLOOR; NaN with fewer than 4 such points."""
    res = np.asarray(rank_collapse, np.float64)
    depth = np.flatnonzero(res > COLLAPSE_FLOOR)
    if depth.size < 4:
        return math.nan
    return float(np.polyfit(depth, np.log(res[depth]), 2)[0])


def _models(root: Path, description: dict, initialization: bool, batch: int):
    """Yields (cell, seed, (program, step, model, tokens) or the reason it is missing)."""
    for cell in description["cells"]:
        for seed in description["seeds"]:
            if initialization:
                config = cli.load_experiment(
                    f"{description['study']}:{cell},{description['scale']}")
                cli.apply_overrides(config, cli.split_overrides(description["overrides"])[1])
                config.seed = seed
                try:
                    yield cell, seed, initialization_for_analysis(config, batch)
                except ConfigError as error:
                    yield cell, seed, f"invalid config: {error}"
                continue
            workdir = studies.run_dir(root, cell, seed)
            state, _ = studies.run_state(workdir)
            yield cell, seed, (restore_for_analysis(workdir, batch) if state == "finished"
                               else state)


def _summary(runs: dict[int, dict]) -> dict[str, list[float]]:
    """Per-seed values of the table's columns."""
    columns = {"loss": [], "log-odds rank": [], "res(h_L)": [], "curvature": [],
               "dead units": []}
    for name in ("query", "key", "value", "output", "ffn_down"):
        columns[f"‖∇{name}‖"] = []
    columns["‖∇ffn_up‖ last/first"] = []
    for profile in runs.values():
        columns["loss"].append(profile["loss"])
        columns["log-odds rank"].append(profile["log_odds_rank"])
        columns["res(h_L)"].append(profile["rank_collapse"][-1])
        columns["curvature"].append(collapse_curvature(profile["rank_collapse"]))
        dead = [v for v in profile["ffn_dead_units"] if v is not None and math.isfinite(v)]
        columns["dead units"].append(float(np.mean(dead)) if dead else math.nan)
        for name in ("query", "key", "value", "output", "ffn_down"):
            norms = profile.get(DEPTH_PLOTS[name])
            columns[f"‖∇{name}‖"].append(float(np.mean(norms)) if norms else math.nan)
        up = profile.get(DEPTH_PLOTS["ffn_up"])
        columns["‖∇ffn_up‖ last/first"].append(up[-1] / up[0] if up else math.nan)
    return columns


def _cell_value(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "—"
    spread = f" ± {np.std(finite, ddof=1):.3g}" if len(finite) > 1 else ""
    return f"{np.mean(finite):.4g}{spread}"


def plot_depth(results: dict[str, dict[int, dict]], name: str, path: Path, title: str) -> bool:
    """One metric by depth, one line per cell (mean ± std over seeds); False if no run has it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = DEPTH_PLOTS[name]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for cell, runs in results.items():
        rows = [profile[key] for profile in runs.values() if profile.get(key)]
        if not rows:
            continue
        values = np.array(rows, np.float64)
        mean = values.mean(axis=0)
        std = values.std(axis=0, ddof=1) if len(rows) > 1 else np.zeros_like(mean)
        depth = np.arange(mean.size)
        line, = axes.plot(depth, mean, marker="o", markersize=3, label=f"{cell} (n={len(rows)})")
        axes.fill_between(depth, mean - std, mean + std, color=line.get_color(), alpha=0.2)
        drawn = True
    if drawn:
        axes.set(xlabel="boundary i" if name in ("rank_collapse", "gradient_rms") else "block",
                 ylabel=name if not key.startswith("grad:") else f"‖∂loss/∂W‖ ({key[5:]})",
                 title=title)
        if name in LOG_SCALE:
            axes.set_yscale("log")
        axes.legend(fontsize="small")
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    plt.close(figure)
    return drawn


def write(root: Path, description: dict, initialization: bool, batch: int,
          sparsity_threshold: float) -> Path:
    """Measure every run (or initialization), write PREFIX.json, .md and the plots; returns the
    Markdown file's path."""
    prefix = "probes_init" if initialization else "probes"
    results: dict[str, dict[int, dict]] = {cell: {} for cell in description["cells"]}
    missing, steps = [], set()
    total = len(description["cells"]) * len(description["seeds"])
    for index, (cell, seed, loaded) in enumerate(
            _models(root, description, initialization, batch), start=1):
        if isinstance(loaded, str):
            missing.append((cell, seed, loaded))
            log(f"[{index}/{total}] {cell} seed={seed}: {loaded}, skipped")
            continue
        _, step, model, tokens_BxT1 = loaded
        results[cell][seed] = measure(model, tokens_BxT1, sparsity_threshold)
        steps.add(step)
        log(f"[{index}/{total}] {cell} seed={seed} step {step}: loss "
            f"{results[cell][seed]['loss']:.4f}")
    (root / f"{prefix}.json").write_text(json.dumps(
        {"batch": batch, "sparsity_threshold": sparsity_threshold, "steps": sorted(steps),
         "runs": results}, indent=1, default=lambda v: None).replace("NaN", "null"))
    what = "at initialization (step 0)" if initialization else (
        f"at the last checkpoint (step {', '.join(map(str, sorted(steps)))})")
    lines = [f"# Probes of {description['study']} {what}", "",
             f"Scale `{description['scale']}`; the first {batch} validation sequences; FFN "
             f"units counted dead below |a| < {sparsity_threshold} on every token. Mean ± "
             "sample std over seeds (n). Definitions: train/studies/study_probes.py.", ""]
    header = None
    for cell, runs in results.items():
        columns = _summary(runs)
        if header is None:
            header = ["Cell", "n", *columns]
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines.append(f"| {cell} | {len(runs)} | "
                     + " | ".join(_cell_value(values) for values in columns.values()) + " |")
    lines.append("")
    for name in DEPTH_PLOTS:
        plot = root / f"{prefix}_{name}.png"
        if plot_depth(results, name, plot, f"{name} by depth {what}"):
            lines += [f"![{name}]({plot.name})", ""]
    if missing:
        lines += ["## Missing runs", "", "| Cell | Seed | State |", "|---|---|---|"]
        lines += [f"| {cell} | {seed} | {why} |" for cell, seed, why in missing]
    path = root / f"{prefix}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
