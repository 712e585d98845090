"""Post-training quantization of a run: `quantize_run(RUN, RUN_Q, method)` and `measure` (the
command line: scripts/quantize.py).

Reads RUN's parameters (`restore_run`), quantizes the attention and FFN projections of the layer
stack (`arch/quantized.py` says which layers and how they compute), and writes RUN_Q: RUN's
config.json with a `quantization` section (method, bits, group size, …) and a step-N checkpoint
of the quantized parameters (integer values + scales: the weight bytes shrink on disk and in
memory) that `restore_run`, `python -m train.generate`, the probe report and evaluation read.

Methods:
- int8 (and int4, int3: GPTQ's round-to-nearest baseline): round-to-nearest, symmetric, one scale
  per output channel (or per group of G input rows), through qwix (`qwix.quantize`).
- gptq4, gptq3: GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for
  Generative Pre-trained Transformers", Alg. 1) at 4 or 3 bits: per layer, minimize
  ‖W X − Ŵ X‖² with H = X Xᵀ from calibration activations X (dampened by 1% of its mean
  diagonal), quantizing input rows one at a time in their natural order (the paper's §3 "arbitrary
  order" step: the order matters little at scale) and spreading each row's error over the rows
  not yet quantized through the upper Cholesky factor of H⁻¹, with lazy batch updates of 128
  rows. The loop follows qwix's `qwix.contrib.gptq_core.quantize_weight` (and uses its
  `find_params`, `quantize` and `cholesky_inverse`), jitted per block; qwix's own loop runs
  eagerly and cannot store qwix's synthetic 3-bit type. Hessians are collected in one pass of the
  float32 model (as qwix's calibration provider does), not layer by layer on the partly
  quantized model as in the paper. Cost: one I×I Cholesky and I rank-1 updates of I×O per layer.
- llm_int8: LLM.int8() (Dettmers et al. 2022): vector-wise int8 with outlier input features
  (calibration max |x_j| > threshold) multiplied in float32; reports the share of multiply-adds
  done in 8 bits.

Calibration (llm_int8, gptq): `calibration_batches` batches of the run's training split
(batch_size × seq_len tokens each), through the float32 model with every quantized layer's input
statistics (H = Σ xᵀx and max |x| per feature) accumulated as non-parameter layer state, which the
layer scan carries out as it does BatchNorm statistics.

`measure` evaluates both runs on the run's validation batches (the trainer's eval_batches),
counts weight bytes and times one decode step of each model interleaved (ABBA,
`train.instruments.timing`); the command line writes its figures, with `quantize_run`'s report,
to RUN_Q/quantization.json.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from qwix._src.core import qarray
from qwix.contrib import gptq_core

from arch.layers import Dense
from arch.quantized import (
    METHOD_BITS,
    LLMInt8Dense,
    QuantizedDense,
    check_group_size,
    dense_geometry,
    dense_key,
    int8_rows,
    qtype_of,
    quantizable_dense,
    quantize_matrix,
    stack_names_of,
    storage_dtype,
    swap_dense,
)
from train.checkpoint import Checkpointer
from train.data import shards
from train.data.in_memory import VALIDATION_SEED
from train.instruments.timing import paired_ratio, time_interleaved
from train.restore import restore_run

METHODS = ("int8", "int4", "int3", "llm_int8", "gptq4", "gptq3")
CALIBRATION_SEED = 1  # the training split's batch order for calibration (training used seed 0+)


class CalibrationStat(nnx.Variable):
    """A statistic of a layer's inputs accumulated during calibration (not a parameter)."""


class CalibrationDense(nnx.Module):
    """A float32 `Dense` (the same kernel and bias) that also accumulates, over every call, the
    Gram matrix H = Σ xᵀx (I×I) of its flattened inputs and their max |x| per feature (I)."""

    def __init__(self, dense: Dense):
        stack, in_shape, _ = dense_geometry(dense)
        features = math.prod(in_shape)
        self.kernel, self.bias, self.n_in, self.dtype = (dense.kernel, dense.bias, dense.n_in,
                                                         dense.dtype)
        self.hessian = CalibrationStat(jnp.zeros((*stack, features, features), jnp.float32))
        self.absmax = CalibrationStat(jnp.zeros((*stack, features), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        x_NxI = x.astype(jnp.float32).reshape(-1, self.hessian.shape[-1])
        self.hessian[...] = self.hessian[...] + x_NxI.T @ x_NxI
        self.absmax[...] = jnp.maximum(self.absmax[...], jnp.max(jnp.abs(x_NxI), axis=0))
        return Dense.__call__(self, x)


def calibration_data(config, count: int) -> list[np.ndarray]:
    """`count` batches (batch_size × (seq_len + 1) tokens) of the run's training split."""
    dataset = shards.load_split(config.data, "train")
    return [dataset.batch(i, config.batch_size, config.seq_len, CALIBRATION_SEED)
            for i in range(count)]


def calibrate(program, state, batches: list[np.ndarray]) -> dict[tuple, dict[str, np.ndarray]]:
    """{Dense path: {"hessian": …×I×I, "absmax": …×I}} over `batches`, from the float32 model."""
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    swap_dense(model, lambda path, dense: CalibrationDense(dense))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def accumulate(params, rest, tokens_BxT1):
        model = nnx.merge(graphdef, params, rest)
        inputs_BxT, _, positions_BxT = program.model_inputs(tokens_BxT1)
        model(inputs_BxT, positions_BxT)
        return nnx.state(model, nnx.Not(nnx.Param))

    with jax.set_mesh(program.mesh):
        for tokens in batches:
            rest = accumulate(params, rest, program.put_batch(tokens))
    nnx.update(model, rest)
    return {path: {"hessian": np.asarray(layer.hessian[...]),
                   "absmax": np.asarray(layer.absmax[...])}
            for path, layer in nnx.iter_graph(model) if isinstance(layer, CalibrationDense)}


# GPTQ --------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="qtype")
def _gptq_block(w_OxC, hinv_CxC, scale_OxC, *, qtype):
    """GPTQ's inner loop over the C columns of one block (qwix gptq_core.quantize_weight):
    quantize column i with its scale, then W[:, i:] −= (w − ŵ)/Hinv[i,i] · Hinv[i, i:].
    Returns (integer values, error block E with E[:, i] = (w − ŵ)/Hinv[i,i])."""
    columns = w_OxC.shape[1]

    def column(i, carry):
        w_OxC, err_OxC, q_OxC = carry
        w_O, d = w_OxC[:, i], hinv_CxC[i, i]
        q_O, dq_O = gptq_core.quantize(w_O, qtype, scale_OxC[:, i], None)
        err_O = (w_O - dq_O) / d
        w_OxC = w_OxC - jnp.outer(err_O, hinv_CxC[i])  # Hinv is upper triangular: columns ≥ i
        return w_OxC, err_OxC.at[:, i].set(err_O), q_OxC.at[:, i].set(q_O)

    q_OxC = jnp.zeros(w_OxC.shape, gptq_core.quantize(w_OxC[:, 0], qtype, scale_OxC[:, 0],
                                                      None)[0].dtype)
    _, err_OxC, q_OxC = jax.lax.fori_loop(0, columns, column,
                                          (w_OxC, jnp.zeros_like(w_OxC), q_OxC))
    return q_OxC, err_OxC


def gptq_quantize(w_OxI: jax.Array, hessian_IxI: jax.Array, bits: int, group_size: int = 0, *,
                  block_size: int = 128, damping: float = 0.01) -> qarray.QArray:
    """GPTQ of W (O×I: rows are outputs, columns the contraction, as qwix's convention) given
    H = X Xᵀ (I×I): the QArray (qvalue O×I, scale O×G) minimizing ‖W X − Ŵ X‖² greedily column
    by column (module docstring). Scales of a group come from the error-updated W at the start of
    the block holding its first column, as in qwix and the authors' code."""
    columns = w_OxI.shape[1]
    check_group_size(group_size, columns, "the matrix")
    group = group_size if group_size and group_size < columns else columns
    how = qarray.HowToQuantize(qtype=qtype_of(bits), channelwise_axes=(0,),
                               tiled_axes={1: group} if group < columns else {})
    w = jnp.asarray(w_OxI, jnp.float32)
    h = jnp.asarray(hessian_IxI, jnp.float32)
    diagonal = jnp.diag(h)
    dead = diagonal == 0
    h = jnp.where(dead & jnp.eye(columns, dtype=bool), 1.0, h)
    w = jnp.where(dead, 0.0, w)
    h = h + damping * jnp.mean(diagonal) * jnp.eye(columns)
    hinv = jnp.linalg.cholesky(gptq_core.cholesky_inverse(jnp.linalg.cholesky(h)), upper=True)
    scales: list[jax.Array] = []  # one O-vector per group
    values = []
    for start in range(0, columns, block_size):
        stop = min(start + block_size, columns)
        for first in range(start, stop):
            if first % group == 0:
                scale, _ = gptq_core.find_params(w[:, first:first + group], how)
                scales.append(scale[:, 0])
        scale_OxC = jnp.stack([scales[c // group] for c in range(start, stop)], axis=1)
        q_OxC, err_OxC = _gptq_block(w[:, start:stop], hinv[start:stop, start:stop], scale_OxC,
                                     qtype=how.qtype)
        values.append(q_OxC)
        w = w.at[:, stop:].add(-err_OxC @ hinv[start:stop, stop:])
    return qarray.QArray(jnp.concatenate(values, axis=1), jnp.stack(scales, axis=1), None,
                         how.qtype)


# Quantizing a model ------------------------------------------------------------------------------
def _matrix(dense: Dense) -> tuple[np.ndarray, tuple, tuple, tuple]:
    """A Dense kernel as a stack of I×O matrices: (…×I×O array, stack, in_shape, out_shape)."""
    stack, in_shape, out_shape = dense_geometry(dense)
    kernel = np.asarray(dense.kernel[...], np.float32)
    return (kernel.reshape(*stack, math.prod(in_shape), math.prod(out_shape)), stack, in_shape,
            out_shape)


def _bias(dense: Dense):
    return None if dense.bias is None else jnp.asarray(dense.bias[...])


def weight_only_layer(dense: Dense, bits: int, group_size: int,
                      hessian: np.ndarray | None) -> QuantizedDense:
    """A QuantizedDense of `dense`: round-to-nearest (`hessian` None) or GPTQ per stacked layer."""
    w, stack, in_shape, out_shape = _matrix(dense)
    if hessian is None:
        quantized = quantize_matrix(jnp.asarray(w), bits, group_size)
        qvalue, scale = quantized.qvalue, quantized.scale
    else:
        layers = [gptq_quantize(w_IxO.T, h_IxI, bits, group_size)
                  for w_IxO, h_IxI in zip(w.reshape(-1, *w.shape[-2:]),
                                          hessian.reshape(-1, *hessian.shape[-2:]), strict=True)]
        qvalue = jnp.stack([layer.qvalue.T for layer in layers]).reshape(w.shape)
        scale = jnp.stack([layer.scale.T for layer in layers])
        scale = scale.reshape(*stack, *scale.shape[1:])
    return QuantizedDense(qvalue.astype(storage_dtype(bits)), scale, _bias(dense), bits=bits,
                          in_shape=in_shape, out_shape=out_shape,
                          stack_names=stack_names_of(dense.kernel, len(stack)), dtype=dense.dtype)


def outlier_features(absmax: np.ndarray, threshold: float) -> np.ndarray:
    """LLM.int8()'s outlier features: max |x_j| over the calibration data above `threshold`."""
    return absmax > threshold


def llm_int8_layer(dense: Dense, outliers: np.ndarray, capacity: int) -> LLMInt8Dense:
    """An LLMInt8Dense of `dense` whose input features `outliers` (…×I bool) stay float32,
    padded to `capacity` outlier rows per stacked layer (≥ the most of any layer)."""
    w, stack, in_shape, out_shape = _matrix(dense)
    w_LxIxO = w.reshape(-1, *w.shape[-2:])
    mask_LxI = outliers.reshape(-1, w.shape[-2])
    qvalues, scales, indices, rows = [], [], [], []
    for w_IxO, mask_I in zip(w_LxIxO, mask_LxI, strict=True):
        regular_IxO = np.where(mask_I[:, None], 0.0, w_IxO)
        q_OxI, scale_Ox1 = int8_rows(jnp.asarray(regular_IxO.T))  # column-wise: rows of Wᵀ
        qvalues.append(np.asarray(q_OxI).T)
        scales.append(np.asarray(scale_Ox1).T)
        index = np.flatnonzero(mask_I)
        padded = np.zeros(capacity, np.int32)
        padded[:len(index)] = index
        weight = np.zeros((capacity, w.shape[-1]), np.float32)
        weight[:len(index)] = w_IxO[index]
        indices.append(padded)
        rows.append(weight)
    shaped = lambda arrays: jnp.asarray(np.stack(arrays).reshape(*stack, *arrays[0].shape))
    return LLMInt8Dense(shaped(qvalues), shaped(scales),
                        jnp.asarray(outliers.reshape(*stack, -1).astype(np.int8)),
                        shaped(indices), shaped(rows), _bias(dense), in_shape=in_shape,
                        out_shape=out_shape, stack_names=stack_names_of(dense.kernel, len(stack)),
                        dtype=dense.dtype)


def eight_bit_share(outliers: dict[tuple, np.ndarray], out_features: dict[tuple, int]) -> float:
    """Share of the quantized layers' multiply-adds done in int8: Σ (I − |O|)·O_out / Σ I·O_out
    over layers (every token multiplies each weight once)."""
    total = regular = 0
    for path, mask in outliers.items():
        layers = mask.reshape(-1, mask.shape[-1])
        total += layers.size * out_features[path]
        regular += int((~layers).sum()) * out_features[path]
    return regular / total


def quantize_model(program, state, method: str, *, group_size: int = 0,
                   calibration: dict | None = None, threshold: float = 6.0):
    """(params, model_state, quantization fields, report) of `state`'s model quantized with
    `method`; `calibration` from `calibrate` (llm_int8, gptq)."""
    bits = METHOD_BITS[method]
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    fields = dict(method=method, bits=bits, group_size=group_size if method != "llm_int8" else 0,
                  threshold=threshold, outliers="")
    report: dict = {}
    if method == "llm_int8":
        masks = {path: outlier_features(stats["absmax"], threshold)
                 for path, stats in calibration.items()}
        capacity = {path: max(1, int(m.reshape(-1, m.shape[-1]).sum(-1).max()))
                    for path, m in masks.items()}
        fields["outliers"] = ",".join(f"{dense_key(p)}={k}" for p, k in capacity.items())
        geometry = {path: math.prod(dense_geometry(dense)[2])
                    for path, dense in quantizable_dense(model)}
        report["eight_bit_share"] = eight_bit_share(masks, geometry)
        report["outlier_features"] = {"/".join(map(str, p)): m.reshape(-1, m.shape[-1]).sum(-1)
                                      .tolist() for p, m in masks.items()}
        swap_dense(model, lambda path, dense: llm_int8_layer(dense, masks[path], capacity[path]))
    else:
        for path, dense in quantizable_dense(model):
            check_group_size(group_size, math.prod(dense_geometry(dense)[1]),
                             "/".join(map(str, path)))
        gptq = method.startswith("gptq")
        swap_dense(model, lambda path, dense: weight_only_layer(
            dense, bits, group_size, calibration[path]["hessian"] if gptq else None))
    _, params, model_state = nnx.split(model, nnx.Param, ...)
    return params, model_state, fields, report


def weight_bytes(params) -> dict[str, int]:
    """Bytes of the parameters at their logical width (int4 values: half a byte): all, and the
    quantizable layers' weights alone (a float32 run's Dense kernels of the stack)."""
    total = layers = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        width = 0.5 if leaf.dtype == jnp.int4 else leaf.dtype.itemsize
        size = leaf.size * width
        total += size
        names = [str(getattr(key, "key", getattr(key, "name", key))) for key in path]
        if names[:1] == ["blocks"] and any(n in ("attention", "ffn") for n in names) \
                and names[-1] != "bias" and any(n in ("kernel", "qvalue", "scale", "outlier_mask",
                                                      "outlier_index", "outlier_weight")
                                                for n in names):
            layers += size
    return {"all_parameters": int(total), "quantized_layers": int(layers)}


def write_run(workdir: str | Path, out: str | Path, step: int, params, model_state,
              fields: dict, calibration_batches: int) -> None:
    """RUN_Q: RUN's config.json with the `quantization` section, and a checkpoint at `step` of
    the quantized parameters and the model state (no optimizer state)."""
    workdir, out = Path(workdir), Path(out)
    saved = json.loads((workdir / "config.json").read_text())
    saved["quantization"] = dict(fields, calibration_batches=calibration_batches)
    tokenizer = saved.get("data", {}).get("tokenizer", "byte")
    kind, _, path = tokenizer.partition(":")
    if path and Path(path).parent.resolve() == workdir.resolve():  # an imported run's own
        shutil.copyfile(path, out / Path(path).name)
        saved["data"]["tokenizer"] = f"{kind}:{(out / Path(path).name).absolute()}"
    state = {"step": jnp.asarray(step, jnp.int32), "params": params, "model_state": model_state}
    with Checkpointer(out) as checkpointer:
        checkpointer.save(step, state, {"next_step": step, "quantized_from": str(workdir)},
                          force=True)
    (out / "config.json").write_text(json.dumps(saved, indent=2) + "\n")


def quantize_run(workdir: str | Path, out: str | Path, method: str, *, group_size: int = 0,
                 calibration_batches: int = 8, threshold: float = 6.0) -> dict:
    """Quantize the run in `workdir` into the new run directory `out` (module docstring); returns
    the report (method fields, seconds, llm_int8's 8-bit share). One-line ValueError /
    FileNotFoundError on bad input."""
    if method not in METHODS:
        raise ValueError(f"--method={method} is invalid: must be one of {', '.join(METHODS)}")
    if group_size < 0 or calibration_batches < 0:
        raise ValueError("--group_size and --calibration_batches must be ≥ 0")
    out = Path(out)
    if (out / "config.json").exists() or (out / "checkpoints").exists():
        raise ValueError(f"--out={out} already holds a run; quantize into a new directory")
    program, step, state = restore_run(workdir)
    if program.config.quantization.method != "none":
        raise ValueError(f"--workdir={workdir} is already quantized "
                         f"({program.config.quantization.method}); quantize a float32 run")
    started = time.perf_counter()
    calibration = None
    if method in ("llm_int8", "gptq4", "gptq3"):
        if calibration_batches < 1:
            raise ValueError(f"--calibration_batches={calibration_batches} is invalid: "
                             f"{method} needs ≥ 1 batch of calibration data")
        calibration = calibrate(program, state,
                                calibration_data(program.config, calibration_batches))
    params, model_state, fields, report = quantize_model(
        program, state, method, group_size=group_size, calibration=calibration,
        threshold=threshold)
    out.mkdir(parents=True, exist_ok=True)
    write_run(workdir, out, int(step), params, model_state, fields,
              calibration_batches if calibration is not None else 0)
    return dict(fields, step=int(step), seconds=time.perf_counter() - started,
                calibration_batches=calibration_batches if calibration is not None else 0,
                **report)


# Measuring ---------------------------------------------------------------------------------------
def validation_loss(program, state) -> float:
    """Mean evaluation loss over the run's `eval_batches` validation batches (the trainer's)."""
    config = program.config
    dataset = shards.load_split(config.data, "validation")
    losses = [program.eval_loss(state, program.put_batch(
        dataset.batch(i, config.batch_size, config.seq_len, VALIDATION_SEED)))
        for i in range(config.eval_batches)]
    return float(np.mean(jax.device_get(losses)))


def decode_step_runner(program, state, context: int):
    """A callable running one jitted single-token decode step (batch 1) against a KV cache of
    `context` positions, at position context − 1, and waiting for it."""
    @jax.jit
    def step(params, model_state, cache, token_1x1, position_1x1):
        model = nnx.merge(program.graphdef, params, model_state)
        model.eval()
        return model.decode(token_1x1, position_1x1, cache)

    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    cache = model.init_cache(1, context)
    token = jnp.zeros((1, 1), jnp.int32)
    position = jnp.full((1, 1), context - 1, jnp.int32)

    def run() -> None:
        with jax.set_mesh(program.mesh):
            jax.block_until_ready(step(state["params"], state["model_state"], cache, token,
                                       position))
    return run


def directory_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def measure(workdir: str | Path, out: str | Path, *, steps: int = 200, block: int = 10) -> dict:
    """Validation loss of both runs and its delta, weight bytes of both, and the decode step time
    ratio quantized / float32 (median of per-round ratios, interleaved ABBA in one process)."""
    program, _, state = restore_run(workdir)
    program_q, _, state_q = restore_run(out)
    loss, loss_q = validation_loss(program, state), validation_loss(program_q, state_q)
    context = program.config.seq_len
    times = time_interleaved({"float32": decode_step_runner(program, state, context),
                              "quantized": decode_step_runner(program_q, state_q, context)},
                             steps, block)
    with tempfile.TemporaryDirectory() as scratch:  # the float32 parameters alone, as RUN_Q holds
        with Checkpointer(scratch) as checkpointer:
            checkpointer.save(0, state, {}, force=True)
        disk = {"float32": directory_bytes(Path(scratch) / "checkpoints"),
                "quantized": directory_bytes(Path(out) / "checkpoints")}
    return {"validation_loss_float32": loss, "validation_loss_quantized": loss_q,
            "loss_delta": loss_q - loss,
            "weight_bytes_float32": weight_bytes(state["params"]),
            "weight_bytes_quantized": weight_bytes(state_q["params"]),
            "checkpoint_bytes_on_disk": disk,
            "decode_step_seconds": {name: float(np.median(t)) for name, t in times.items()},
            "decode_time_ratio": paired_ratio(times, "quantized", "float32", block)}
