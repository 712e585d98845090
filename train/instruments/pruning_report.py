"""Pruning studies of a run, as Markdown + JSON + PNG: block pruning with healing, and head
pruning with speedups. The command lines: scripts/prune_heal.py (`measure_blocks`,
`write_blocks`) and scripts/prune_heads.py (`measure_heads`, `write_heads`), each through
`measure_and_write`, which gives their exit status.

Data: the evaluation loss is the mean next-token loss (nats) over the first `eval_batches`
validation batches of `batch` sequences of the run's seq_len (`train.restore.evaluation_split`,
VALIDATION_SEED); calibration (block selection, head importance) and healing read the run's
training split with seeds of their own (config.seed + 1, + 2), never the evaluation batches.

Block pruning (`train.instruments.pruning`): for each selection and fraction f, n = round(f·L)
blocks are dropped (influence: the n lowest Block Influence; angular: the contiguous n minimizing
d(x^l, x^{l+n})), the loss is measured, the model is healed with rank-r adapters for
`heal_steps` steps and measured again. Writes blocks.md, blocks.json, blocks.png.

Head pruning (`train.instruments.head_pruning`): iterative pruning for each structure, the loss
at every round; for the physically removable rounds ("per_group", "whole_groups") the heads are
removed, the removed model's loss is checked against the masked one, and the train-step
(`timing_batch` × seq_len, AdamW) and one-token decode-step time ratios pruned/intact are
measured interleaved. Writes heads.md, heads.json, heads.png.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import ml_collections
import numpy as np

from train.checkpoint import failure_reason
from train.data import shards
from train.data.in_memory import VALIDATION_SEED
from train.instruments import head_pruning, pruning
from train.instruments.ablation import batch_loss, prune_blocks, prune_by_influence
from train.instruments.probe_report import _plain, _pyplot, _table
from train.restore import evaluation_split, restore_for_analysis

SELECTIONS = ("influence", "angular")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _provenance(workdir: str, step: int) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"workdir": str(workdir), "step": int(step), "commit": commit,
            "machine": f"{platform.machine()}, {jax.device_count()} {jax.default_backend()} "
                       f"device(s)", "command": " ".join(sys.argv)}


def _data(workdir: str, batch: int, eval_batches: int):
    program, step, model, first = restore_for_analysis(workdir, batch)
    config = program.config
    validation = evaluation_split(config)
    evaluation = [np.asarray(first)] + [validation.batch(i, batch, config.seq_len,
                                                         VALIDATION_SEED)
                                        for i in range(1, eval_batches)]
    train_split = shards.load_split(config.data, "train")

    def train_batch(step: int, seed_offset: int) -> np.ndarray:
        return train_split.batch(step, batch, config.seq_len, config.seed + seed_offset)

    return program, step, model, evaluation, train_batch


def _mean_loss(model, batches) -> float:
    return float(np.mean([batch_loss(model, b) for b in batches]))


# Block pruning ------------------------------------------------------------------------------------

def measure_blocks(workdir: str, fractions: list[float], selections: list[str], heal_steps: int,
                   rank: int, learning_rate: float, batch: int, eval_batches: int,
                   control: bool = True) -> dict:
    """The block-pruning report (module docstring): each fraction f drops 1 ≤ round(f·L) < L
    of the L blocks, each selection one of `SELECTIONS` (scripts/prune_heal.py checks them
    against the run's config.json)."""
    program, step, model, evaluation, train_batch = _data(workdir, batch, eval_batches)
    layers = model.cfg.num_layers
    calibration = train_batch(0, 1)
    intact = _mean_loss(model, evaluation)
    log(f"intact model: {layers} blocks, loss {intact:.4f}")
    rows, healed_by_drop = [], {}  # the same blocks dropped: the same healing (same seed)
    control_loss = None
    if control:  # the intact model trained with the same adapters: what healing adds anyway
        healed, _ = pruning.heal(model, lambda s: train_batch(s, 2), heal_steps, rank=rank,
                                 learning_rate=learning_rate, seed=program.config.seed)
        control_loss = _mean_loss(healed, evaluation)
        log(f"intact model healed: {control_loss:.4f}")
    for selection in selections:
        for fraction in fractions:
            num_drop = round(fraction * layers)
            if selection == "influence":
                chosen = prune_by_influence(model, calibration, num_drop)
                dropped, score = chosen["dropped"], chosen["block_influence"]
            else:
                chosen = pruning.select_by_angular_distance(model, calibration, num_drop)
                dropped, score = chosen["dropped"], chosen["distance"]
            _, pruned = prune_blocks(model, dropped)
            pruned_loss = _mean_loss(pruned, evaluation)
            if tuple(dropped) not in healed_by_drop:
                start = time.perf_counter()
                healed, info = pruning.heal(pruned, lambda s: train_batch(s, 2), heal_steps,
                                            rank=rank, learning_rate=learning_rate,
                                            seed=program.config.seed)
                healed_by_drop[tuple(dropped)] = (_mean_loss(healed, evaluation), info,
                                                  time.perf_counter() - start)
            healed_loss, info, heal_seconds = healed_by_drop[tuple(dropped)]
            log(f"{selection} f={fraction}: dropped {dropped}, pruned {pruned_loss:.4f}, "
                f"healed {healed_loss:.4f} ({heal_seconds:.0f} s)")
            rows.append({"selection": selection, "fraction": fraction, "dropped": dropped,
                         "blocks_left": layers - num_drop, "score": score,
                         "loss_pruned": pruned_loss, "loss_healed": healed_loss,
                         "heal_first_loss": info["losses"][0] if info["losses"] else None,
                         "heal_last_loss": info["losses"][-1] if info["losses"] else None,
                         "heal_seconds": heal_seconds})
    return {**_provenance(workdir, step), "num_layers": layers, "loss_intact": intact,
            "loss_intact_healed": control_loss,
            "heal_steps": heal_steps, "rank": rank, "learning_rate": learning_rate,
            "batch": batch, "eval_batches": eval_batches, "seq_len": program.config.seq_len,
            "rows": rows}


def blocks_markdown(report: dict) -> str:
    header = ["selection", "fraction", "blocks dropped", "blocks left", "loss pruned",
              "Δ pruned", "loss healed", "Δ healed"]
    intact = report["loss_intact"]
    rows = [[r["selection"], r["fraction"], str(r["dropped"]), r["blocks_left"],
             r["loss_pruned"], r["loss_pruned"] - intact, r["loss_healed"],
             r["loss_healed"] - intact] for r in report["rows"]]
    return "\n".join([
        f"# Block pruning with healing: {report['workdir']} (step {report['step']})", "",
        f"Intact model: {report['num_layers']} blocks, validation loss {intact:.4f} nats "
        f"({report['eval_batches']} batches × {report['batch']} × {report['seq_len']} tokens). "
        f"Healing: rank-{report['rank']} adapters on every block Dense kernel, "
        f"{report['heal_steps']} Adam steps at lr {report['learning_rate']} on the training "
        "split. Δ: loss minus the intact loss (nats)." + (
            f" Control: the intact model with the same adapters and steps reaches "
            f"{report['loss_intact_healed']:.4f} (Δ "
            f"{report['loss_intact_healed'] - intact:+.4f}), the part of healing that is "
            "further training rather than repair." if report.get("loss_intact_healed") else ""),
        "",
        _table(header, rows), "", "![block pruning](blocks.png)", "",
        f"Commit {report['commit']}, {report['machine']}; command: `{report['command']}`", ""])


def write_blocks(report: dict, out: str | Path) -> None:
    """OUT/blocks.md, .json and .png of a `measure_blocks` report, and a line saying so."""
    _write(report, Path(out), "blocks", blocks_markdown, plot_blocks)


def write_heads(report: dict, out: str | Path) -> None:
    """OUT/heads.md, .json and .png of a `measure_heads` report, and a line saying so."""
    _write(report, Path(out), "heads", heads_markdown, plot_heads)


def _write(report: dict, out: Path, name: str, markdown, plot) -> None:
    """OUT/<name>.md, .json and .png of a report, and a line saying so."""
    out.mkdir(parents=True, exist_ok=True)
    plot(report, out / f"{name}.png")
    (out / f"{name}.md").write_text(markdown(report))
    (out / f"{name}.json").write_text(json.dumps(_plain(report), indent=1) + "\n")
    print(f"wrote {out / f'{name}.md'}, {out / f'{name}.json'}, {out / f'{name}.png'}")


def measure_and_write(measure: Callable[[], dict], write: Callable[[dict, str | Path], None],
                      out: str | Path) -> int:
    """The exit status of a pruning command line once its arguments are checked: 0 when the
    report `measure()` returns is written by `write(report, out)`; 2, one line on stderr, when
    measuring refuses (a run that does not restore, a ValueError such as a ConfigError); 3, one
    line naming the reason, when writing into `out` fails."""
    try:
        report = measure()
    except (FileNotFoundError, ValueError) as error:  # ConfigError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        write(report, out)
    except OSError as error:
        print(f"error: cannot write into --out={out}: {failure_reason(error)}; rerun "
              "once the directory is writable and has space", file=sys.stderr)
        return 3
    return 0


def plot_blocks(report: dict, path: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for selection, color in zip(SELECTIONS, ("C0", "C1"), strict=True):
        rows = [r for r in report["rows"] if r["selection"] == selection]
        if not rows:
            continue
        fractions = [0.0] + [r["fraction"] for r in rows]
        axes.plot(fractions, [report["loss_intact"]] + [r["loss_pruned"] for r in rows], "--o",
                  color=color, label=f"{selection}: pruned")
        axes.plot(fractions, [report["loss_intact"]] + [r["loss_healed"] for r in rows], "-s",
                  color=color, label=f"{selection}: healed ({report['heal_steps']} steps)")
    if report.get("loss_intact_healed"):
        axes.axhline(report["loss_intact_healed"], color="gray", lw=0.8, ls=":",
                     label="intact, same healing (control)")
    axes.set_xlabel("fraction of blocks removed")
    axes.set_ylabel("validation loss (nats)")
    axes.set_title(f"{report['num_layers']}-block model, step {report['step']}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# Head pruning -------------------------------------------------------------------------------------

def measure_heads(workdir: str, structures: list[str], step_fraction: float, max_fraction: float,
                  calibration_batches: int, batch: int, eval_batches: int, timing_steps: int,
                  timing_batch: int | None) -> dict:
    """The head-pruning report (module docstring) for each structure of
    `head_pruning.STRUCTURES` named (scripts/prune_heads.py checks the names)."""
    program, step, model, evaluation, train_batch = _data(workdir, batch, eval_batches)
    cfg = model.cfg
    calibration = [train_batch(i, 1) for i in range(calibration_batches)]
    timing_config = ml_collections.ConfigDict(program.config.to_dict())
    timing_config.batch_size = timing_batch or program.config.batch_size
    curves = {}
    for structure in structures:
        points = head_pruning.iterative_head_pruning(
            model, calibration, evaluation, structure=structure, step_fraction=step_fraction,
            max_fraction=max_fraction)
        for point in points:
            log(f"{structure}: fraction {point['fraction']:.3f}, loss {point['loss']:.4f}")
            if structure == "heads" or point["fraction"] == 0:
                continue
            pruned_cfg, pruned = head_pruning.prune_heads(model, point["keep"])
            point["loss_removed"] = _mean_loss(pruned, evaluation)
            point["shape"] = {"num_heads": pruned_cfg.attention.num_heads,
                              "num_kv_heads": pruned_cfg.attention.num_kv_heads}
            if timing_steps:
                point.update(head_pruning.step_time_ratios(
                    timing_config, pruned_cfg, steps=timing_steps, block=2))
                log(f"  removed: loss {point['loss_removed']:.4f}, train ratio "
                    f"{point['train_ratio']:.3f}, decode ratio {point['decode_ratio']:.3f}")
        curves[structure] = [{k: v for k, v in p.items() if k != "importance"} for p in points]
    return {**_provenance(workdir, step), "num_layers": cfg.num_layers,
            "num_heads": cfg.attention.num_heads, "num_kv_heads": cfg.attention.num_kv_heads,
            "batch": batch, "eval_batches": eval_batches, "seq_len": program.config.seq_len,
            "calibration_batches": calibration_batches, "timing_steps": timing_steps,
            "timing_batch": timing_config.batch_size, "curves": curves}


def heads_markdown(report: dict) -> str:
    header = ["structure", "fraction pruned", "heads left (H, K)", "loss (masked)", "Δ loss",
              "loss (removed)", "train step ratio", "decode step ratio"]
    rows = []
    for structure, points in report["curves"].items():
        intact = points[0]["loss"]
        for p in points:
            shape = p.get("shape")
            rows.append([structure, p["fraction"], int(np.sum(p["keep"])),
                         p["loss"], p["loss"] - intact, p.get("loss_removed", float("nan")),
                         p.get("train_ratio", float("nan")), p.get("decode_ratio", float("nan"))])
            if shape:
                rows[-1][2] = f"{int(np.sum(p['keep']))} ({shape['num_heads']}, " \
                              f"{shape['num_kv_heads']} per layer)"
    return "\n".join([
        f"# Head pruning: {report['workdir']} (step {report['step']})", "",
        f"{report['num_layers']} layers × {report['num_heads']} query heads in "
        f"{report['num_kv_heads']} KV groups. Loss: validation, {report['eval_batches']} batches"
        f" × {report['batch']} × {report['seq_len']} tokens; importance from "
        f"{report['calibration_batches']} training batches. Ratios: pruned / intact step time, "
        f"interleaved in one run ({report['timing_steps']} train steps of batch "
        f"{report['timing_batch']}, {5 * report['timing_steps']} one-token decode steps).", "",
        _table(header, rows), "", "![head pruning](heads.png)", "",
        f"Commit {report['commit']}, {report['machine']}; command: `{report['command']}`", ""])


def plot_heads(report: dict, path: Path) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for structure, points in report["curves"].items():
        axes.plot([p["fraction"] for p in points], [p["loss"] for p in points], "-o",
                  label=structure)
    axes.set_xlabel("fraction of heads pruned")
    axes.set_ylabel("validation loss (nats)")
    axes.set_title(f"iterative head pruning, step {report['step']}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
