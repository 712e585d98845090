"""Depth-mixing heatmaps of a trained run: which sources each sublayer reads, how it writes.

`run` (the command line: scripts/depth_mixing.py) restores the newest checkpoint of a run, or
the one at a given step (`train.restore.restore_run`, as `python -m train.generate` does), runs
the model on the first
batch of the run's validation data under `nnx.capture(model, nnx.Intermediate)`, and plots
every quantity the residual mechanism recorded with `arch.residual.record` (depth_weights,
read_weights, write_strengths, mixing_matrix, read_gates, ...), one heatmap per quantity:

  rows     the sublayers in order (layer 0 attention, layer 0 ffn, layer 1 attention, ...), plus
           a last row "output" when the model-level stream records the same quantity for the
           final read (e.g. Full AttnRes's output pseudo-query);
  columns  what the quantity ranges over (sources, streams, n×n matrix entries row-major),
           averaged over the batch and positions (a value whose leading axes are B×T) and over
           channels (a trailing axis of length d_model, e.g. channel-wise read gates).

The numbers are written as JSON beside the PNG (same name, .json): for each quantity its row
labels, the per-row shape after averaging and the per-row values. For weights over depth
sources (AttnRes's depth_weights) the JSON's "summary" and the printed lines state the AttnRes
report's qualitative claims as figures (`depth_summary`). For mixing matrices (mHC) the JSON's
"stochastic_error" and a printed line give their distance from doubly stochastic over every
token, before averaging (`stochastic_error`). Plain sums record nothing: `run` then says so in
one line and returns 1. The batch must be divisible by the mesh's data axis (all local devices,
as in generation).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from train.restore import restore_for_analysis

RESIDUAL_MODULES = ("attention_residual", "ffn_residual")
STREAM_MODULE = "residual_stream"


def _per_row(value: np.ndarray, batch: int, seq_len: int, d_model: int) -> np.ndarray:
    """One sublayer's recorded value averaged over batch and positions (leading B×T axes) and
    over channels (a trailing d_model axis), trailing size-1 axes dropped."""
    if value.ndim >= 2 and value.shape[:2] == (batch, seq_len):
        value = value.mean(axis=(0, 1))
    if value.ndim >= 1 and value.shape[-1] == d_model:
        value = value.mean(axis=-1)
    while value.ndim >= 2 and value.shape[-1] == 1:  # e.g. scalar (not channel-wise) gates
        value = value[..., 0]
    return value


def _sublayer_label(block: int, module: str) -> str:
    return f"layer {block} {module.removesuffix('_residual')}"


def recorded(intermediates: nnx.State) -> tuple[dict[str, dict], dict[str, np.ndarray]]:
    """The recorded values of a captured State as float32 arrays, unaveraged: ({name: {"rows":
    [labels], "values": [per-sublayer arrays]}}, rows in network order; {name: array} for the
    model-level stream's records).

    Paths are ("blocks", module, name) with a leading layers axis, ("blocks", "block_j",
    module, name) with a leading groups axis when MoE blocks are interleaved (block g·k + j), and
    ("residual_stream", name) for the model-level stream. A name sown k > 1 times per call
    becomes k names "name[i]"."""
    per_sublayer: dict[str, dict[tuple[int, int, int], np.ndarray]] = {}
    stream: dict[str, np.ndarray] = {}
    group_size = 1
    for path, variable in nnx.to_flat_state(intermediates):
        path = tuple(str(p) for p in path)
        sown = variable.get_value() if hasattr(variable, "get_value") else variable.value
        for index, value in enumerate(sown):
            name = path[-1] if len(sown) == 1 else f"{path[-1]}[{index}]"
            value = np.asarray(jax.device_get(value), dtype=np.float32)
            if path[0] == STREAM_MODULE:
                stream[name] = value
                continue
            if path[0] != "blocks" or path[-2] not in RESIDUAL_MODULES:
                continue
            grouped = path[1].startswith("block_")  # arch.model.BlockGroup member j
            member = int(path[1].removeprefix("block_")) if grouped else 0
            if grouped:
                group_size = max(group_size, member + 1)
            order = RESIDUAL_MODULES.index(path[-2])
            for stacked, row in enumerate(value):
                per_sublayer.setdefault(name, {})[(stacked, member, order)] = row
    quantities = {}
    for name, rows in per_sublayer.items():
        keys = sorted(rows)  # (stacked index, member of the group, attention before ffn)
        quantities[name] = {
            "rows": [_sublayer_label(g * group_size + j, RESIDUAL_MODULES[o]) for g, j, o in keys],
            "values": [rows[key] for key in keys]}
    return quantities, stream


def mixing_quantities(intermediates: nnx.State, *, batch: int, seq_len: int,
                      d_model: int) -> dict[str, dict]:
    """The recorded quantities of a captured State (`recorded`), one entry per name, each row
    averaged (`_per_row`): {"rows": [labels], "values": [per-row arrays]}, rows in network
    order, plus a row "output" for a model-level record of the same shape (a model-level record
    of another shape becomes its own quantity "name (output)")."""
    def average(value):
        return _per_row(value, batch, seq_len, d_model)

    recorded_rows, stream = recorded(intermediates)
    output = {name: average(value) for name, value in stream.items()}
    quantities = {}
    for name, quantity in recorded_rows.items():
        quantities[name] = {"rows": quantity["rows"],
                            "values": [average(v) for v in quantity["values"]]}
        if name in output and output[name].shape == quantities[name]["values"][0].shape:
            quantities[name]["rows"].append("output")
            quantities[name]["values"].append(output.pop(name))
    for name, value in output.items():
        quantities[f"{name} (output)"] = {"rows": ["output"], "values": [value]}
    return quantities


def capture_mixing(model, tokens_BxT) -> tuple[dict[str, dict], nnx.State]:
    """Run `model` on the tokens under `nnx.capture`: (`mixing_quantities`, the captured
    State, for figures of the unaveraged values such as `stochastic_error`)."""
    _, intermediates = nnx.capture(model, nnx.Intermediate)(tokens_BxT)
    batch, seq_len = tokens_BxT.shape
    return mixing_quantities(intermediates, batch=batch, seq_len=seq_len,
                             d_model=model.cfg.d_model), intermediates


def stochastic_error(values: list[np.ndarray]) -> dict[str, float]:
    """How far mixing matrices are from doubly stochastic, over every sublayer and token
    (`values`: per sublayer an array ...×n×n, M[i, j] the weight of old stream j in new stream
    i, e.g. mHC's B×T×n×n): the largest and the mean |Σ_i M[i, j] − 1| over columns, and the
    largest over rows. mHC's Sinkhorn projection ends on a row step, so its rows are exact up
    to rounding and its columns are not (arch/hyper.py)."""
    columns = np.concatenate([np.abs(v.sum(axis=-2) - 1).ravel() for v in values])
    rows = np.concatenate([np.abs(v.sum(axis=-1) - 1).ravel() for v in values])
    return {"column_max": float(columns.max()), "column_mean": float(columns.mean()),
            "row_max": float(rows.max())}


def depth_summary(rows: list[str], values: list[np.ndarray], sink_ratio: float = 2.0) -> dict:
    """Figures of a sources-over-depth read (rows: sublayers in order, values: one weight per
    source slot, 0 where the slot is not a source of that row, slot 0 the embedding).

    Each row's weights are normalized, p_j = |α_j| / Σ|α| over its sources (a softmax read is
    unchanged); the newest source is the last slot with a weight; rows with one source only
    (sublayer 0 reads the embedding alone) are left out. Returned, as means over rows:
      embedding_weight   p_0;
      recent_weight      p of the newest source;
      mean_distance      Σ_j p_j·(newest − j), in sources;
      breadth            {"attention", "ffn", "output"}: exp of the entropy of p (the effective
                         number of sources read), by kind of row;
      source_share       per source j, its mean p over the rows that can read it, divided by the
                         mean uniform share 1/|sources| of those rows;
      sinks              the sources whose share is ≥ `sink_ratio` (default 2: read twice as
                         much as uniform weights would).
    """
    weights = [np.abs(np.asarray(v, np.float64)) for v in values]
    shares: dict[int, list[tuple[float, float]]] = {}
    embedding, recent, distance = [], [], []
    breadth: dict[str, list[float]] = {"attention": [], "ffn": [], "output": []}
    for row, alpha in zip(rows, weights, strict=True):
        sources = np.flatnonzero(alpha > 0)
        if len(sources) < 2:
            continue
        p = alpha / alpha.sum()
        newest = int(sources[-1])
        embedding.append(p[0])
        recent.append(p[newest])
        distance.append(float(np.sum(p[sources] * (newest - sources))))
        kind = row.rsplit(" ", 1)[-1]
        breadth[kind].append(float(np.exp(-np.sum(p[sources] * np.log(p[sources])))))
        for j in sources:
            shares.setdefault(int(j), []).append((p[j], 1.0 / len(sources)))
    share = {j: float(np.mean([w for w, _ in pairs]) / np.mean([u for _, u in pairs]))
             for j, pairs in sorted(shares.items())}
    return {"embedding_weight": float(np.mean(embedding)), "recent_weight": float(np.mean(recent)),
            "mean_distance": float(np.mean(distance)),
            "breadth": {kind: float(np.mean(v)) for kind, v in breadth.items() if v},
            "source_share": share, "sinks": [j for j, r in share.items() if r >= sink_ratio]}


def _matrix(values: list[np.ndarray]) -> np.ndarray:
    """Rows flattened (row-major) and padded with NaN to a common width."""
    flat = [np.ravel(v) for v in values]
    width = max(len(f) for f in flat)
    return np.stack([np.pad(f, (0, width - len(f)), constant_values=np.nan) for f in flat])


def _columns(shape: tuple[int, ...]) -> str:
    if len(shape) == 0:
        return "scalar"
    if len(shape) == 1:
        return f"column = index 0..{shape[0] - 1}"
    return f"columns = {'×'.join(map(str, shape))} entries, row-major"


def plot_mixing(quantities: dict[str, dict], png_path: str | Path, title: str) -> None:
    """One heatmap per quantity (rows = sublayers), stacked vertically, written as a PNG."""
    import matplotlib  # imported on first plot: heavy, and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [max(2.0, 0.22 * len(q["rows"]) + 1.2) for q in quantities.values()]
    figure, axes = plt.subplots(len(quantities), 1, figsize=(9, sum(heights)),
                                gridspec_kw={"height_ratios": heights}, squeeze=False)
    for axis, (name, quantity) in zip(axes[:, 0], quantities.items(), strict=True):
        matrix = _matrix(quantity["values"])
        image = axis.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
        axis.set_yticks(range(len(quantity["rows"])), quantity["rows"], fontsize=6)
        if matrix.shape[1] <= 32:
            axis.set_xticks(range(matrix.shape[1]))
        axis.set_title(f"{name} ({_columns(np.shape(quantity['values'][0]))})", fontsize=9)
        figure.colorbar(image, ax=axis)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(png_path, dpi=120)
    plt.close(figure)


def to_json(quantities: dict[str, dict], **header) -> dict:
    return {**header, "quantities": {
        name: {"rows": q["rows"], "shape": list(np.shape(q["values"][0])),
               "values": [np.asarray(v).tolist() for v in q["values"]]}
        for name, q in quantities.items()}}


def run(workdir: str | Path, out: Path, batch: int, seq_len: int | None = None,
        step: int | None = None) -> int:
    """The heatmaps of the run in `workdir` (its checkpoint at `step`, default the newest) on a
    batch of `batch` × `seq_len` (default the run's) validation tokens, written to the PNG `out`
    and its JSON beside it, with the summaries printed (module docstring). Returns 0, or 1 when
    the mechanism records nothing; raises FileNotFoundError or ConfigError in one line."""
    program, step, model, tokens_BxT1 = restore_for_analysis(workdir, batch, seq_len, step=step)
    config, seq_len = program.config, tokens_BxT1.shape[1] - 1
    with jax.set_mesh(program.mesh):
        quantities, intermediates = capture_mixing(model, tokens_BxT1[:, :-1])
    mechanism = config.model.residual.name
    if not quantities:
        print(f"model.residual.name={mechanism!r} records no mixing weights (a plain sum has "
              "none); nothing to plot", file=sys.stderr)
        return 1
    png_path = Path(out)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    plot_mixing(quantities, png_path, f"{mechanism}, step {step}")
    header = dict(mechanism=mechanism, step=step, batch=batch, seq_len=seq_len)
    if "depth_weights" in quantities:
        header["summary"] = summary = depth_summary(**quantities["depth_weights"])
        breadth = ", ".join(f"{k} {v:.2f}" for k, v in summary["breadth"].items())
        print(f"depth weights: embedding {summary['embedding_weight']:.3f}, newest source "
              f"{summary['recent_weight']:.3f}, mean distance {summary['mean_distance']:.2f} "
              f"sources, effective sources read ({breadth}), sinks {summary['sinks']}")
    if "mixing_matrix" in quantities:
        header["stochastic_error"] = error = stochastic_error(
            recorded(intermediates)[0]["mixing_matrix"]["values"])
        print(f"mixing matrices, distance from doubly stochastic over {batch}×{seq_len} "
              f"tokens: columns max {error['column_max']:.2e}, mean {error['column_mean']:.2e}; "
              f"rows max {error['row_max']:.2e}")
    json_path = png_path.with_suffix(".json")
    json_path.write_text(json.dumps(to_json(quantities, **header)) + "\n")
    print(f"wrote {png_path} and {json_path}: {', '.join(quantities)}")
    return 0
