"""Path decomposition of Gated Residual reads: how much of each write reaches each later read.
The command line: scripts/gr_paths.py (`run`).

The Gated Residual report's matched 20-layer probe decomposes each write into the later reads
it reaches, through the gates the forward pass took, and reports the normalized contribution of
layer i's write to layer j's read and a typical skip length per branch. Here, for
`arch.gated_residual` (sublayers 0 … L−1 in network order, n branches; everything per token and
channel unless said otherwise):

Sources. The embedding x⁰ (source row 0, position −1) and the output F_i of sublayer i (source
row i + 1, position i). Branch m before sublayer j is

    x_m⁽ʲ⁾ = E_{j,m} x⁰ + Σ_{i<j} e_{i→j,m} ⊙ F_i,
    e_{i→j} = M_{j−1} ⋯ M_{i+1} s_i,   E_j = M_{j−1} ⋯ M_0 1,

with s_i the write strengths of sublayer i and M the mixing matrices (without
`gated_residual.mixing`, M = I: e_{i→j} = s_i and E_j = 1).

Terms. Read j is h_j = Σ_m G_{j,m} ⊙ g_{j,m} ⊙ r_{j,m} ⊙ x_m⁽ʲ⁾: read gates G, branch gains g,
and r_{j,m} = 1/sqrt(mean(x_m⁽ʲ⁾²) + ε), the inverse rms the forward pass used, taken as a
constant. So h_j splits into

    c^m_{i→j} = G_{j,m} ⊙ g_{j,m} ⊙ r_{j,m} ⊙ e_{i→j,m} ⊙ F_i    (embedding: E_{j,m} x⁰),
    c_{i→j}   = Σ_m c^m_{i→j},      Σ_i c_{i→j} = h_j (before its cast to model.dtype).

The split is exact for a float32 state. A bfloat16 or FP8 state rounds the branches; `read_error`
= max_j ‖h_j − Σ_i c_{i→j}‖ / ‖h_j‖ (norms over batch, positions and channels) says by how much
the split then misses.

Contributions [ours: we do not know the report's normalization]. ‖·‖ is the L2 norm over
channels and E the mean over batch and positions:

    C[i, j]   = E‖c_{i→j}‖ / Σ_{i'} E‖c_{i'→j}‖           each read's column sums to 1
    C^m[i, j] = E‖c^m_{i→j}‖ / Σ_{i',m'} E‖c^{m'}_{i'→j}‖   the n branch matrices sum to 1

C[i, j] is the share of read j's magnitude that source i supplies, C^m[i, j] the share it
supplies through branch m. Σ_m C^m ≠ C, because the branches' terms may cancel. Entries for
sources after the read are 0.

Skip length per branch m [ours]: Σ_{i,j} C^m[i, j]·(j − pos(i)) / Σ_{i,j} C^m[i, j], in
sublayers, with pos(embedding) = −1. Reading the previous write, or the embedding at sublayer 0,
is a skip of 1. "Writes only" leaves the embedding out. In layers: divided by the sublayers per
block (2 with attention and FFN).

Per layer [ours]: C_layer[a, b] is the mean over layer b's reads j of Σ_{i in layer a} C[i, j].
Source rows: embedding, layer 0, …; columns still sum to 1.

`run` restores the newest checkpoint of a run (or the one at a given step) and runs the first
batch of the run's validation data (`train.restore.restore_for_analysis`, as
scripts/depth_mixing.py does) under `nnx.capture`. It reads kind `nnx.Intermediate` (read
gates, write strengths, mixing) and kind `arch.residual.PathTerm` (the other terms above).
Outputs:
- JSON, default WORKDIR/gr_paths.json: C, C^m, C_layer, the skip lengths, row labels and
  read_error;
- a heatmap PNG of C and each C^m: rows the reads, column 0 the embedding, column i + 1
  sublayer i (the last sublayer, which no read sees, is left out);
- a printed summary line: layer 0's contribution to the last layer's read, and the skip length
  per branch.

A run whose mechanism records no read gates/write strengths (or the other terms) is refused in
one line (`run` raises ConfigError). Memory: the captured terms are about (4n + 3)·B·T·d float32
values per sublayer with channelwise gates, so keep the batch and the length small.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from arch.residual import PathTerm, sublayers_per_block
from config import ConfigError
from train.instruments.depth_mixing import plot_mixing, recorded
from train.restore import restore_for_analysis

GATES = ("read_gates", "write_strengths")  # nnx.Intermediate
TERMS = ("read_inverse_rms", "branch_gains", "sublayer_output", "read")  # PathTerm
EMBEDDING = "embedding"  # PathTerm, model-level


class MissingTerms(ValueError):
    """The model records not every term of the decomposition (another residual mechanism)."""


def path_contributions(read_gates, branch_gains, read_inverse_rms, write_strengths,
                       sublayer_outputs, embedding, mixing=None) -> dict:
    """The decomposition of the module docstring from per-sublayer arrays (lists over the L
    sublayers in network order): read_gates and write_strengths B×T×n×W (W = D or 1),
    branch_gains n×D, read_inverse_rms B×T×n×1, sublayer_outputs B×T×D, embedding B×T×D,
    mixing None or n×n per sublayer. Returns {"contribution": C (L+1)×L, "branch_contribution":
    C^m n×(L+1)×L, "skip", "skip_writes": n (in sublayers), "reads": Σ_i c_{i→j} per read
    (B×T×D)}; source row 0 is the embedding, row i + 1 sublayer i."""
    L, n = len(read_gates), np.shape(branch_gains[0])[0]
    norms = np.zeros((L + 1, L))
    branch_norms = np.zeros((n, L + 1, L))
    carry = [np.eye(n)]  # per source so far: M_{j-1} ⋯ M_{i+1} (embedding: ⋯ M_0)
    reads = []
    x0 = np.asarray(embedding, np.float64)
    for j in range(L):
        read_BxTxNxD = (np.asarray(read_gates[j], np.float64) * branch_gains[j]
                        * read_inverse_rms[j])
        total = 0.0
        for source, product in enumerate(carry):
            if source == 0:
                terms = read_BxTxNxD * (product.sum(axis=1)[:, None] * x0[:, :, None])
            else:
                carried = np.einsum("mk,btkw->btmw", product, write_strengths[source - 1])
                terms = read_BxTxNxD * carried * sublayer_outputs[source - 1][:, :, None]
            branch_norms[:, source, j] = np.linalg.norm(terms, axis=-1).mean(axis=(0, 1))
            term = terms.sum(axis=2)
            norms[source, j] = np.linalg.norm(term, axis=-1).mean()
            total = total + term
        reads.append(total)
        step = np.eye(n) if mixing is None else np.asarray(mixing[j], np.float64)
        carry = [step @ product for product in carry] + [np.eye(n)]
    branch = branch_norms / branch_norms.sum(axis=(0, 1))
    distance = np.arange(L)[None, :] - (np.arange(L + 1)[:, None] - 1)  # j − pos(i)
    skip = (branch * distance).sum(axis=(1, 2)) / branch.sum(axis=(1, 2))
    writes = branch[:, 1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        skip_writes = (writes * distance[1:]).sum(axis=(1, 2)) / writes.sum(axis=(1, 2))
    return {"contribution": norms / norms.sum(axis=0), "branch_contribution": branch,
            "skip": skip, "skip_writes": skip_writes, "reads": reads}


def per_layer(contribution: np.ndarray, per_block: int) -> np.ndarray:
    """C_layer (module docstring): sources embedding, layer 0, … (rows) × reads of layers."""
    reads = contribution.shape[1]
    layers = reads // per_block
    sources = np.concatenate([contribution[:1], contribution[1:].reshape(
        layers, per_block, reads).sum(axis=1)])
    return sources.reshape(layers + 1, layers, per_block).mean(axis=-1)


def capture_paths(model, tokens_BxT) -> dict:
    """Run `model` on the tokens under `nnx.capture` and return `path_contributions` with the
    read labels ("rows"), the source labels ("sources") and "read_error" (module docstring).
    `MissingTerms` (one line) when the model does not record what the decomposition needs."""
    _, terms, intermediates = nnx.capture(model, PathTerm, nnx.Intermediate)(tokens_BxT)
    gates, _ = recorded(intermediates)
    values, stream = recorded(terms)
    values.update(gates)
    missing = [name for name in (*GATES, *TERMS) if name not in values]
    missing += [] if EMBEDDING in stream else [EMBEDDING]
    if missing:
        raise MissingTerms("records no " + "/".join(name.replace("_", " ") for name in missing))
    rows = {name: quantity["values"] for name, quantity in values.items()}
    result = path_contributions(rows["read_gates"], rows["branch_gains"], rows["read_inverse_rms"],
                                rows["write_strengths"], rows["sublayer_output"],
                                stream[EMBEDDING], rows.get("mixing_matrix"))
    result["read_error"] = max(float(np.linalg.norm(h - total) / np.linalg.norm(h))
                               for h, total in zip(rows["read"], result["reads"], strict=True))
    result["rows"] = values["read_gates"]["rows"]
    result["sources"] = ["embedding", *result["rows"]]
    return result


def _heatmaps(result: dict) -> dict[str, dict]:
    """C and each C^m as `depth_mixing.plot_mixing` quantities: rows the reads, columns the
    sources that some read sees (all but the last sublayer), NaN after the read."""
    def rows(matrix):
        reads = matrix.shape[1]
        return [np.where(np.arange(reads) <= j, matrix[:reads, j], np.nan) for j in range(reads)]

    columns = "columns: 0 embedding, i + 1 sublayer i"
    quantities = {f"contribution C ({columns})": {"rows": result["rows"],
                                                 "values": rows(result["contribution"])}}
    for m, matrix in enumerate(result["branch_contribution"]):
        quantities[f"through branch {m}"] = {"rows": result["rows"], "values": rows(matrix)}
    return quantities


def _listed(values: np.ndarray) -> list:
    """JSON values: NaN (a branch that carries nothing) as null."""
    return [None if np.isnan(v) else float(v) for v in values]


def run(workdir: str | Path, out: Path, batch: int, seq_len: int | None = None,
        step: int | None = None) -> None:
    """The decomposition of the run in `workdir` (its checkpoint at `step`, default the newest)
    on a batch of `batch` × `seq_len` (default the run's) validation tokens: the heatmap PNG
    `out`, the JSON beside it and the printed summary (module docstring). Raises
    FileNotFoundError or ConfigError in one line (a mechanism without the terms included)."""
    program, step, model, tokens_BxT1 = restore_for_analysis(workdir, batch, seq_len, step=step)
    config, seq_len = program.config, tokens_BxT1.shape[1] - 1
    mechanism = config.model.residual.name
    try:
        with jax.set_mesh(program.mesh):
            result = capture_paths(model, tokens_BxT1[:, :-1])
    except MissingTerms as error:
        raise ConfigError(f"model.residual.name={mechanism!r} {error}: no path "
                          "decomposition") from None
    per_block = sublayers_per_block(config.model)
    layers = per_layer(result["contribution"], per_block)
    png_path = Path(out)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    plot_mixing(_heatmaps(result), png_path, f"{mechanism}, step {step}: path contributions")
    written = dict(
        mechanism=mechanism, step=step, batch=batch, seq_len=seq_len,
        reads=result["rows"], sources=result["sources"],
        contribution=result["contribution"].tolist(),
        branch_contribution=result["branch_contribution"].tolist(),
        layer_contribution=layers.tolist(),
        skip_sublayers=_listed(result["skip"]), skip_layers=_listed(result["skip"] / per_block),
        skip_writes_sublayers=_listed(result["skip_writes"]),
        skip_writes_layers=_listed(result["skip_writes"] / per_block),
        read_error=result["read_error"])
    json_path = png_path.with_suffix(".json")
    json_path.write_text(json.dumps(written) + "\n")

    def listed(values):
        return ", ".join("nan" if v is None else f"{v:.1f}" for v in values)

    print(f"layer 0 → layer {layers.shape[1] - 1}: C = {layers[1, -1]:.3f}; skip length per "
          f"branch (layers): {listed(written['skip_layers'])} (writes only: "
          f"{listed(written['skip_writes_layers'])}); read error {result['read_error']:.1e}")
    print(f"wrote {png_path} and {json_path}")
