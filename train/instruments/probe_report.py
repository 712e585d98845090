"""The instrument panel of a run: accounting, per-depth probes, pruning, head ablation, the softmax
bottleneck and compiled memory, as a Markdown report with PNG plots and a JSON file of every number.

The command line: scripts/probe_report.py. `measure` restores the newest checkpoint of a run (a
trained run, or a Hugging Face import from scripts/import_hf.py) and measures it on the first
validation batch of B sequences (`train.restore.restore_for_analysis`; the length defaults to
the run's) of a text (a local text file or a prepared directory), or of the run's validation
split, tokenized with the run's tokenizer (an imported checkpoint's own). The loss on that batch
is reported per token and per byte of text (`train.restore.bytes_per_token`), so runs with
different tokenizers compare. `write_report` writes into a directory:

  report.md         the tables below and the plots, with the step, batch and definitions
  report.json       every number (NaN written as null)
  depth.png         hidden-state RMS, gradient RMS, branch RMS, update-to-stream ratio, Block
                    Influence and distance from rank 1, by depth (`probes.depth_profile`)
  heads.png         head ablation (loss change when each head is zeroed, L × H) and head
                    similarity (mean cosine of a head's attention rows to the other heads')
  spectrum.png      singular values of the log-odds matrix with the numerical-rank threshold
                    and the d (+ 1) bound of a single softmax (`arch.bottleneck`)

Sections: accounting (`arch.accounting.books` at the batch's length); compiled train-step
memory per device (`step_memory.train_step_memory`, the run's batch size); per-depth table and
normalization statistics; ShortGPT pruning of the `prune` lowest-influence blocks, loss before
and after (0 skips it); head ablation; the bottleneck diagnostic. Per-depth probes cover every
residual mechanism but the reversible stack (multi-stream ones through the readout h_i of their
state, `train/instruments/probes.py`); where the probes or the pruning are not defined (the
reversible stack; pruning deepnorm, MoE groups, or width/block_attnres blocks whose removal would
move write targets or AttnRes blocks) the report says why and keeps the rest. Progress goes to
stderr.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np

from arch import accounting, bottleneck
from config.catalogue import SINGLE_STREAM, has
from config.resolution import unresolved
from train.instruments import ablation, probes, step_memory
from train.restore import bytes_per_token, restore_for_analysis
from train.step import resolve_for_job


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def measure(workdir: str, batch: int, seq_len: int | None, prune: int,
            bottleneck_tokens: int | None,
            sparsity_threshold: float, text: str | None = None) -> dict:
    """Every measurement of the report, as a nested dict of numpy arrays and numbers: `prune`
in [0, num_layers), `bottleneck_tokens` None or in [1, vocab_size) (scripts/probe_report.py
checks them against the run's config.json). Raises FileNotFoundError or ConfigError in one
line (a run that does not restore, a batch the devices do not divide)."""
    program, step, model, tokens_BxT1 = restore_for_analysis(workdir, batch, seq_len, text)
    cfg = program.config.model
    layers = cfg.num_layers
    length = tokens_BxT1.shape[1] - 1
    report = {"workdir": str(workdir), "step": step, "residual": cfg.residual.name,
              "batch": tokens_BxT1.shape[0], "seq_len": length}
    log("accounting")
    report["accounting"] = accounting.books(cfg, length)
    log("compiled train-step memory")
    training_config = unresolved(program.config)
    training_config.quantization.method = "none"  # a quantized run's float32 model: it trains
    report["memory"] = step_memory.train_step_memory(resolve_for_job(training_config))
    with jax.set_mesh(program.mesh):
        if cfg.reversible:
            report["depth_skipped"] = ("model.reversible=True: the per-depth probes walk the "
                                       "residual mechanisms, not the reversible stack")
        else:
            log("depth profile")
            report["depth"] = probes.depth_profile(model, tokens_BxT1,
                                                   sparsity_threshold=sparsity_threshold)
            if prune:
                log(f"pruning {prune} block(s) by influence")
                try:
                    report["pruning"] = ablation.prune_by_influence(
                        model, tokens_BxT1, prune,
                        block_influence=report["depth"]["block_influence"])
                except ValueError as error:  # a mechanism or a choice of blocks it cannot prune
                    report["pruning_skipped"] = str(error)
        log(f"head ablation ({layers} × {cfg.attention.num_heads} heads)")
        report["heads"] = ablation.head_ablation(model, tokens_BxT1)
        loss, per_token = float(report["heads"]["loss"]), bytes_per_token(tokens_BxT1,
                                                                          program.config)
        report["evaluation"] = {
            "text": str(text) if text else f"the run's validation split ({data_source(program)})",
            "tokenizer": program.config.data.get("tokenizer", "byte"),
            "loss_per_token": loss, "perplexity_per_token": math.exp(loss),
            "bytes_per_token": per_token, "loss_per_byte": loss / per_token,
            "bits_per_byte": loss / per_token / math.log(2)}
        log("softmax bottleneck")
        report["bottleneck"] = bottleneck.model_bottleneck(model, tokens_BxT1[:, :-1],
                                                           num_tokens=bottleneck_tokens)
    return report


def data_source(program) -> str:
    data = program.config.data
    return f"data.name={data.name}" + (f", data.path={data.path}" if data.get("path") else "")


def _plain(value):
    """JSON-ready: arrays to lists, NaN and infinities to None."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def _pyplot():
    import matplotlib  # imported on first plot: heavy, and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_depth(depth: dict, path: Path, title: str) -> None:
    plt = _pyplot()
    figure, axes = plt.subplots(2, 3, figsize=(13, 7))
    boundaries = np.arange(len(depth["hidden_rms"]))
    blocks = np.arange(len(depth["block_influence"]))
    panels = [
        ("hidden-state RMS", boundaries, {"h_i": depth["hidden_rms"]}, "linear"),
        ("gradient RMS by boundary", boundaries, {"gradient": depth["gradient_rms"]}, "log"),
        ("branch-output RMS", blocks, {"attention": depth["branch_rms"][:, 0],
                                       "ffn": depth["branch_rms"][:, 1]}, "linear"),
        ("update-to-input ratio ‖F‖/‖s‖", blocks, {"attention": depth["update_ratio"][:, 0],
                                                    "ffn": depth["update_ratio"][:, 1]}, "log"),
        ("Block Influence 1 − cos(h_i, h_i+1)", blocks,
         {"BI": depth["block_influence"]}, "linear"),
        ("distance from rank 1 ‖X − 1x̄ᵀ‖/‖X‖", boundaries,
         {"res(X)": depth["rank_collapse"]}, "linear"),
    ]
    for axis, (name, x, series, scale) in zip(axes.flat, panels, strict=True):
        for label, values in series.items():
            if np.isfinite(values).any():
                axis.plot(x, values, marker="o", label=label)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("boundary i (input of block i)" if x is boundaries else "block")
        axis.set_yscale(scale)
        axis.grid(alpha=0.3)
        if len(series) > 1:
            axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def mean_similarity_to_others(similarity_LxHxH: np.ndarray) -> np.ndarray:
    """L × H: each head's mean head_similarity to the other heads of its layer."""
    heads = similarity_LxHxH.shape[-1]
    if heads == 1:
        return np.full(similarity_LxHxH.shape[:2], np.nan)
    off_diagonal = similarity_LxHxH.sum(-1) - np.diagonal(similarity_LxHxH, axis1=1, axis2=2)
    return off_diagonal / (heads - 1)


def plot_heads(loss_change_LxH: np.ndarray, similarity_LxH: np.ndarray | None, path: Path,
               title: str) -> None:
    plt = _pyplot()
    panels = [("loss change when the head is zeroed (nats)", loss_change_LxH, "coolwarm")]
    if similarity_LxH is not None:
        panels.append(("mean attention similarity to the layer's other heads", similarity_LxH,
                       "viridis"))
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for axis, (name, matrix, cmap) in zip(axes[0], panels, strict=True):
        limit = np.nanmax(np.abs(matrix)) if cmap == "coolwarm" else None
        image = axis.imshow(matrix, aspect="auto", interpolation="nearest", cmap=cmap,
                            vmin=-limit if limit else None, vmax=limit)
        axis.set_xticks(range(matrix.shape[1]))
        axis.set_yticks(range(matrix.shape[0]))
        axis.set_xlabel("head")
        axis.set_ylabel("block")
        axis.set_title(name, fontsize=10)
        figure.colorbar(image, ax=axis)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_spectrum(result: dict, path: Path, title: str) -> None:
    plt = _pyplot()
    singular = np.asarray(result["singular_values"])
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.semilogy(np.arange(1, len(singular) + 1), np.maximum(singular, 1e-300), marker=".")
    axis.axhline(result["threshold"], color="gray", linestyle="--",
                 label=f"threshold {result['rtol']:.2g}·σ_max")
    if result["bound"] is not None:
        axis.axvline(result["bound"], color="red", linestyle=":",
                     label=f"single-softmax bound {result['bound']}")
    axis.set_xlabel("index")
    axis.set_ylabel("singular value")
    axis.set_title(f"{title}: numerical rank {result['numerical_rank']} of a "
                   f"{result['contexts']}×{result['tokens']} log-odds matrix", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _table(header: list[str], rows: list[list]) -> str:
    def cell(value) -> str:
        if isinstance(value, (float, np.floating)):
            return "–" if not math.isfinite(value) else f"{value:.4g}"
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return f"{int(value):,}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(report: dict) -> str:
    books, memory = report["accounting"], report["memory"]
    parts = [f"# Probe report: {report['workdir']}", "",
             f"Step {report['step']}, `model.residual.name={report['residual']}`; measured on the "
             f"first validation batch: {report['batch']} sequences × {report['seq_len']} "
             "tokens. Definitions: `arch/accounting.py`, `train/instruments/probes.py`, "
             "`arch/bottleneck.py`.", ""]
    if "evaluation" in report:
        evaluation = report["evaluation"]
        parts += ["## Evaluation text", "",
                  f"{evaluation['text']}, tokenized with `{evaluation['tokenizer']}`: loss "
                  f"{evaluation['loss_per_token']:.4f} nats/token (perplexity "
                  f"{evaluation['perplexity_per_token']:.2f}), {evaluation['bytes_per_token']:.3f}"
                  f" bytes/token, {evaluation['loss_per_byte']:.4f} nats/byte "
                  f"({evaluation['bits_per_byte']:.4f} bits/byte).", ""]
    parts += ["## Accounting", "",
             _table(["quantity", "value"],
                    [[f"parameters: {k}", v] for k, v in books["parameters"].items()]
                    + [[f"FLOPs per token ({k.removesuffix('_per_token')}, T = "
                        f"{books['flops']['seq_len']})", v]
                       for k, v in books["flops"].items() if k != "seq_len"]
                    + [[f"KV cache ({books['kv_cache']['dtype']}): {k}", v]
                       for k, v in books["kv_cache"].items() if k != "dtype"]
                    + [[f"residual: {k}", v] for k, v in books["residual"].items()]),
             "", "## Compiled train-step memory (per device)", "",
             _table(["quantity", "bytes"], [[k, v] for k, v in memory.items()]), ""]
    if "depth" in report:
        depth = report["depth"]
        layers = len(depth["block_influence"])
        definition = ("Hidden state h_i = x_i, block i's input; the gradient is ∂loss/∂x_i."
                      if has("residual", report["residual"], SINGLE_STREAM) else
                      "Hidden state h_i is the readout of the residual state at block i's input "
                      "(what the final norm would read there); the gradient is ∂loss/∂u_i, u_i "
                      "the embedding or the last update written before block i; the update ratio "
                      "divides by the sublayer's input before its norm (definitions by mechanism "
                      "in `train/instruments/probes.py`).")
        parts += ["## Per-depth probes", "", f"Batch loss {depth['loss']:.4f} nats. {definition}",
                  "",
                  "![depth](depth.png)", "",
                  _table(["block", "RMS h_i", "grad RMS", "attn RMS", "ffn RMS",
                          "attn ‖F‖/‖s‖", "ffn ‖F‖/‖s‖", "BI", "res(X)", "ffn sparsity",
                          "ffn mean |a|"],
                         [[i, depth["hidden_rms"][i], depth["gradient_rms"][i],
                           *depth["branch_rms"][i], *depth["update_ratio"][i],
                           depth["block_influence"][i], depth["rank_collapse"][i],
                           depth["ffn_sparsity"][i], depth["ffn_mean_abs"][i]]
                          for i in range(layers)]
                         + [["output", depth["hidden_rms"][layers], depth["gradient_rms"][layers],
                             *[float("nan")] * 5, depth["rank_collapse"][layers],
                             float("nan"), float("nan")]]),
                  "", "### Normalization statistics (input averaged over tokens)", "",
                  _table(["norm", "input mean", "input variance", "input RMS", "gain mean",
                          "gain std"],
                         [[f"block {i} {name}", *(depth["norms"][name][k][i] for k in (
                             "input_mean", "input_variance", "input_rms", "gain_mean",
                             "gain_std"))] for i in range(layers) for name in ("attention", "ffn")]
                         + [["final", *(depth["norms"]["final"][k] for k in (
                             "input_mean", "input_variance", "input_rms", "gain_mean",
                             "gain_std"))]]), ""]
        if "pruning" in report:
            pruning = report["pruning"]
            parts += ["## Pruning by Block Influence (ShortGPT)", "",
                      f"Dropped blocks {pruning['dropped']} (lowest influence), "
                      f"{pruning['num_layers']} left: loss {pruning['loss_before']:.4f} → "
                      f"{pruning['loss_after']:.4f} nats on the same batch.", ""]
        elif "pruning_skipped" in report:
            parts += ["## Pruning by Block Influence (ShortGPT)", "",
                      f"Skipped: {report['pruning_skipped']}", ""]
    else:
        parts += ["## Per-depth probes", "", f"Skipped: {report['depth_skipped']}.", ""]
    change = np.asarray(report["heads"]["loss_change"])
    order = np.argsort(-change, axis=None)[:5]
    parts += ["## Head ablation", "", f"Loss {report['heads']['loss']:.4f} nats with every "
              "head; the loss change when one head's output is zeroed (largest first):", "",
              _table(["block", "head", "loss change"],
                     [[int(i // change.shape[1]), int(i % change.shape[1]), change.flat[i]]
                      for i in order]), "", "![heads](heads.png)", ""]
    result = report["bottleneck"]
    bound = ("none (Mixture of Softmaxes)" if result["bound"] is None
             else f"{result['bound']} (a single softmax of the d-dimensional state)")
    parts += ["## Softmax bottleneck", "",
              f"Log-odds log p(v | c) − log p(v₀ | c) of {result['contexts']} contexts (every "
              f"position of the batch) over {result['tokens']} tokens against reference token "
              f"{result['reference_token']}: numerical rank **{result['numerical_rank']}** "
              f"(singular values > {result['threshold']:.3g} = {result['rtol']:.3g}·σ_max; "
              f"{result['precision']}). Bound: {bound}."
              + ("" if result["bound"] is None or min(result["contexts"], result["tokens"])
                 > result["bound"] else " The matrix is too small to test the bound (raise "
                 "--batch or --bottleneck_tokens)."), "", "![spectrum](spectrum.png)", ""]
    return "\n".join(parts)


def write_report(report: dict, out: Path) -> list[Path]:
    """Write the report's files into `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    title = f"{report['residual']}, step {report['step']}"
    written, similarity = [], None
    if "depth" in report:
        plot_depth(report["depth"], out / "depth.png", title)
        written.append(out / "depth.png")
        similarity = mean_similarity_to_others(report["depth"]["head_similarity"])
    plot_heads(np.asarray(report["heads"]["loss_change"]), similarity, out / "heads.png", title)
    plot_spectrum(report["bottleneck"], out / "spectrum.png", title)
    (out / "report.md").write_text(markdown(report))
    (out / "report.json").write_text(json.dumps(_plain(report), indent=1) + "\n")
    return [*written, out / "heads.png", out / "spectrum.png", out / "report.md",
            out / "report.json"]
