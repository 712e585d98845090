"""Post-training quantized linear layers, stored as qwix quantized arrays (`qwix.QArray`: integer
values + scales), and the swap of a model's `Dense` layers for them.

Which layers: every `arch.layers.Dense` of the layer stack inside an attention or FFN sublayer
(query, key, value, output, gate, up, down projections); the embedding, the output head, norms,
routers and residual mechanisms stay float32. The layer stack is stacked on a leading `layers`
axis and run under `jax.lax.scan`, so each quantized layer stores its arrays with the same leading
stack axes and the scan slices them like any parameter. A kernel W ∈ R^{in_shape × out_shape}
is stored flattened to a matrix W ∈ R^{I×O}, I = prod(in_shape), O = prod(out_shape).

`QuantizedDense` (methods int8, int4, int3: round-to-nearest; gptq4, gptq3): weight-only
quantization.
    W ≈ Ŵ = q ⊙ s,   q ∈ Z^{I×O} in [−2^{b−1}, 2^{b−1} − 1],   s ∈ R^{(I/g)×O}
    (one scale per output channel and group of g input rows; g = I: per channel), and
    y = x · Ŵ (+ b), with Ŵ dequantized on the fly in the compute dtype (`qwix.dequantize`).
    qwix's PTQ provider (`qwix.quantize_model(model, PtqProvider(rules), tokens)`) intercepts the
    dot_general of `Dense`'s tensordot, but inside the layer scan it sees a per-layer slice of a
    stacked kernel whose sharding names still carry the `layers` axis, and it stops on
    `AssertionError: shape=(32, 4, 8) spec=('layers', 'embed', 'heads', 'head_dim')` (a tests'
    tiny model; qwix 0.1.8, flax_util.update_sharding) when it creates the quantized parameter.
    So the weights are quantized into qwix's QArray storage and dequantized in the forward
    instead: memory and disk hold b-bit values (int8, int4; the 3-bit values in int4
    containers), the matmul itself runs in floating point.
    Cost: one dequantization (I·O multiplies) per layer per call on top of the matmul.

`LLMInt8Dense` (method llm_int8; Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication
for Transformers at Scale", §3): vector-wise int8 with the mixed-precision decomposition.
    Input features j ∈ O (outliers: max |x_j| > threshold on calibration data, fixed at
    quantization time; the paper picks them per batch) are multiplied in float32 with the original
    weight rows; the rest in int8:
        y = x_O · W_O  +  (s_x s_w / 127²) ⊙ (round(127 x_Ō / s_x) · round(127 W_Ō / s_w))
    with s_x = max_j∉O |x_{t j}| per row (token) of x and s_w = max_i |W_{i o}| per output column
    o of W; the integer product accumulates in int32. Each quantized Dense keeps k outlier rows
    per stacked layer, k the most of its layers (`quantization.outliers`; past a layer's own
    count, index 0 with an all-zero weight row).
    Cost: two row/column absmax reductions and an int8 matmul; k·O float32 weights per layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from qwix._src.core import qarray

from arch.layers import Dense

QUANTIZATION_METHODS = ("none", "int8", "int4", "int3", "llm_int8", "gptq4", "gptq3")
METHOD_BITS = {"none": 32, "int8": 8, "int4": 4, "int3": 3, "llm_int8": 8, "gptq4": 4, "gptq3": 3}
SUBLAYERS = ("attention", "ffn")  # what is quantized: the Dense layers under these attributes


def qtype_of(bits: int):
    """qwix's logical type of b-bit integers (3 bits: qwix's synthetic 'int3', held in int4)."""
    return {8: jnp.int8, 4: jnp.int4, 3: "int3"}[bits]


def storage_dtype(bits: int):
    return jnp.int8 if bits == 8 else jnp.int4


def how_to_quantize(bits: int, group_size: int, in_features: int) -> qarray.HowToQuantize:
    """Symmetric absmax quantization of an I×O matrix: one scale per output column (axis 1) and
    group of `group_size` input rows (0: the whole column)."""
    tiled = {0: group_size} if group_size and group_size < in_features else {}
    return qarray.HowToQuantize(qtype=qtype_of(bits), channelwise_axes=(1,), tiled_axes=tiled)


def check_group_size(group_size: int, in_features: int, where: str) -> None:
    if group_size and in_features % group_size and group_size < in_features:
        raise ValueError(f"quantization.group_size={group_size} is invalid: it must divide the "
                         f"{in_features} input features of {where} (or be 0: per channel)")


def quantize_matrix(w_IxO: jax.Array, bits: int, group_size: int = 0) -> qarray.QArray:
    """Round-to-nearest quantization of an I×O matrix (or a stack …×I×O) into a qwix QArray:
    s = max |W| over each group / (2^{b−1} − ½) (qwix's symmetric bound), q = clip(round(W / s)).
    |W − q s| ≤ s/2 elementwise."""
    how = how_to_quantize(bits, group_size, w_IxO.shape[-2])
    lead = w_IxO.ndim - 2
    how = qarray.HowToQuantize(
        qtype=how.qtype, channelwise_axes=tuple(range(lead)) + tuple(a + lead for a in
                                                                      how.channelwise_axes),
        tiled_axes={a + lead: size for a, size in how.tiled_axes.items()})
    return qarray.quantize(w_IxO.astype(jnp.float32), how)


def dequantize(qvalue: jax.Array, scale: jax.Array, bits: int, dtype=jnp.float32) -> jax.Array:
    """Ŵ = q ⊙ s (scales broadcast over their groups), in `dtype`."""
    return qarray.dequantize(qarray.QArray(qvalue, scale.astype(dtype), None, qtype_of(bits)))


def stack_names_of(kernel: nnx.Param, stack_dims: int) -> tuple:
    names = kernel.get_metadata().get("out_sharding") or ()
    return tuple(names[:stack_dims]) if len(names) >= stack_dims else (None,) * stack_dims


def dense_geometry(dense: Dense) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(stack shape, in_shape, out_shape) of a possibly stacked Dense kernel."""
    shape = tuple(dense.kernel.shape)
    n_in, n_out = dense.kernel.get_metadata()["matrix"]
    stack = len(shape) - n_in - n_out
    return shape[:stack], shape[stack:stack + n_in], shape[stack + n_in:]


def _param(value: jax.Array, names: tuple) -> nnx.Param:
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


class QuantizedDense(nnx.Module):
    """Weight-only quantized `Dense`: y = x · (q ⊙ s) (+ b) (module docstring). Holds
    `qvalue` (…×I×O, int8 or int4), `scale` (…×G×O float32, G = I/g) and the float32 bias."""

    def __init__(self, qvalue: jax.Array, scale: jax.Array, bias: jax.Array | None, *,
                 bits: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                 stack_names: tuple, dtype=jnp.float32):
        self.qvalue = _param(qvalue, stack_names + (None, None))
        self.scale = _param(scale, stack_names + (None, None))
        self.bias = None if bias is None else _param(bias, stack_names + (None,) * len(out_shape))
        self.bits, self.in_shape, self.out_shape = bits, tuple(in_shape), tuple(out_shape)
        self.dtype = dtype

    def keep_input_blocks(self, keep_SxK: jax.Array) -> None:
        """Zero the weights of input block k (of K equal blocks of the flattened input, e.g. a
        head of the attention output projection) where keep[..., k] = 0 (keep: 0 or 1, stacked
        like the layer): the head ablation of `train.instruments.probes`."""
        _keep_rows(self.qvalue, _row_keep(keep_SxK, self.qvalue.shape[-2]))

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:x.ndim - len(self.in_shape)]
        kernel_IxO = dequantize(self.qvalue[...], self.scale[...], self.bits, self.dtype)
        x_NxI = x.astype(self.dtype).reshape(-1, math.prod(self.in_shape))
        y = (x_NxI @ kernel_IxO).reshape(*lead, *self.out_shape)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _row_keep(keep_SxK: jax.Array, rows: int) -> jax.Array:
    """Blocks of input rows → rows: each of K blocks of `rows`/K consecutive rows gets its keep."""
    return jnp.repeat(keep_SxK, rows // keep_SxK.shape[-1], axis=-1)


def _keep_rows(qvalue: nnx.Param, keep_SxI: jax.Array) -> None:
    qvalue[...] = jnp.where(keep_SxI[..., None] != 0, qvalue[...], jnp.zeros((), qvalue.dtype))


def int8_rows(x_NxI: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Vector-wise int8 of the rows of x: (round(127 x / s), s) with s = max |x| per row."""
    absmax_Nx1 = jnp.max(jnp.abs(x_NxI), axis=-1, keepdims=True)
    safe = jnp.where(absmax_Nx1 > 0, absmax_Nx1, 1.0)
    return jnp.round(127.0 * x_NxI / safe).astype(jnp.int8), absmax_Nx1


class LLMInt8Dense(nnx.Module):
    """LLM.int8() `Dense` (module docstring): `qvalue` (…×I×O int8, column-wise scales `scale`
    …×1×O = max |W| per column), the outlier features' `outlier_mask` (…×I int8, 1 = outlier),
    `outlier_index` (…×k int32) and their float32 weight rows `outlier_weight` (…×k×O, zero rows
    for padding)."""

    def __init__(self, qvalue, scale, outlier_mask, outlier_index, outlier_weight, bias, *,
                 in_shape, out_shape, stack_names: tuple, dtype=jnp.float32):
        self.qvalue = _param(qvalue, stack_names + (None, None))
        self.scale = _param(scale, stack_names + (None, None))
        self.outlier_mask = _param(outlier_mask, stack_names + (None,))
        self.outlier_index = _param(outlier_index, stack_names + (None,))
        self.outlier_weight = _param(outlier_weight, stack_names + (None, None))
        self.bias = None if bias is None else _param(bias, stack_names + (None,) * len(out_shape))
        self.in_shape, self.out_shape, self.dtype = tuple(in_shape), tuple(out_shape), dtype

    def keep_input_blocks(self, keep_SxK: jax.Array) -> None:
        """`QuantizedDense.keep_input_blocks`: the int8 rows and the float32 outlier rows."""
        keep_SxI = _row_keep(keep_SxK, self.qvalue.shape[-2])
        _keep_rows(self.qvalue, keep_SxI)
        keep_SxR = jnp.take_along_axis(keep_SxI, self.outlier_index[...], axis=-1)
        self.outlier_weight[...] = self.outlier_weight[...] * keep_SxR[..., None]

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:x.ndim - len(self.in_shape)]
        x_NxI = x.astype(jnp.float32).reshape(-1, math.prod(self.in_shape))
        regular_I = self.outlier_mask[...] == 0
        x_int_NxI, x_scale_Nx1 = int8_rows(jnp.where(regular_I, x_NxI, 0.0))
        product_NxO = jax.lax.dot(x_int_NxI, self.qvalue[...], preferred_element_type=jnp.int32)
        y = product_NxO.astype(jnp.float32) * (x_scale_Nx1 * self.scale[...] / 127.0**2)
        x_outlier_NxK = jnp.take(x_NxI, self.outlier_index[...], axis=1)
        y = y + x_outlier_NxK @ self.outlier_weight[...]
        y = y.astype(self.dtype).reshape(*lead, *self.out_shape)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def dense_key(path: tuple) -> str:
    """A stack Dense's name within its block, e.g. "attention/query" (the config's key)."""
    return "/".join(str(part) for part in path[1:])


def outlier_capacities(text: str) -> dict[str, int]:
    """`quantization.outliers` "attention/query=2,ffn/down=40" as {name: k} (k ≥ 1)."""
    pairs = [item.split("=") for item in text.split(",") if item]
    return {name: max(int(k), 1) for name, k in pairs}


def quantizable_dense(model: nnx.Module) -> list[tuple[tuple, Dense]]:
    """(path, module) of every Dense of the layer stack inside an attention or FFN sublayer."""
    return [(path, node) for path, node in nnx.iter_graph(model)
            if isinstance(node, Dense) and path[:1] == ("blocks",)
            and any(part in SUBLAYERS for part in path)]


def swap_dense(model: nnx.Module, make: Callable[[tuple, Dense], nnx.Module]) -> None:
    """Replace, in place, each of `quantizable_dense(model)` by `make(path, dense)`."""
    for path, dense in quantizable_dense(model):
        parent = model
        for key in path[:-1]:
            parent = parent[key] if isinstance(key, int) else getattr(parent, key)
        replacement = make(path, dense)
        if isinstance(path[-1], int):
            parent[path[-1]] = replacement
        else:
            setattr(parent, path[-1], replacement)


def quantized_structure(model: nnx.Module, quantization) -> nnx.Module:
    """`model` with its Dense layers replaced by zero-valued quantized layers of the shapes
    `quantization` (the config section: method, group_size, outliers) implies: the structure a
    quantized checkpoint restores into. Returns `model` (changed in place)."""
    method = quantization.method
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization.method={method!r} is invalid: must be one of "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if method == "none":
        return model
    bits = METHOD_BITS[method]

    def make(path, dense: Dense) -> nnx.Module:
        stack, in_shape, out_shape = dense_geometry(dense)
        features_in, features_out = math.prod(in_shape), math.prod(out_shape)
        names = stack_names_of(dense.kernel, len(stack))
        bias = None if dense.bias is None else jnp.zeros((*stack, *out_shape), jnp.float32)
        if method == "llm_int8":
            k = outlier_capacities(quantization.outliers).get(dense_key(path), 1)
            return LLMInt8Dense(
                jnp.zeros((*stack, features_in, features_out), jnp.int8),
                jnp.ones((*stack, 1, features_out), jnp.float32),
                jnp.zeros((*stack, features_in), jnp.int8),
                jnp.zeros((*stack, k), jnp.int32),
                jnp.zeros((*stack, k, features_out), jnp.float32), bias,
                in_shape=in_shape, out_shape=out_shape, stack_names=names, dtype=dense.dtype)
        group = quantization.group_size
        check_group_size(group, features_in, "/".join(map(str, path)))
        groups = features_in // group if group and group < features_in else 1
        return QuantizedDense(
            jnp.zeros((*stack, features_in, features_out), storage_dtype(bits)),
            jnp.ones((*stack, groups, features_out), jnp.float32), bias, bits=bits,
            in_shape=in_shape, out_shape=out_shape, stack_names=names, dtype=dense.dtype)

    swap_dense(model, make)
    return model
