"""Parameter helper and the two primitive layers every component is built from.

All parameters are float32 and carry logical axis names (see `sharding/rules.py`); computation runs
in the configured compute dtype. `Dense` generalizes a linear map to multi-axis inputs and outputs
(e.g. d → (h, p) for attention), so no component reshapes weights by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from arch.init import truncated_normal
from sharding.rules import constrain

Initializer = nnx.initializers.Initializer


def param(
    rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str | None],
    kind: type[nnx.Param] = nnx.Param, matrix: tuple[int, int] | None = None,
) -> nnx.Param:
    """A float32 parameter with logical axis names; it is sharded later, by the rules table.
    `kind`: a subclass of `nnx.Param` that filters select on (e.g. the weight-decay mask's
    `arch.residual.MixingParam`). `matrix=(n_in, n_out)` marks a linear map whose last n_in + n_out
    axes are its input and output axes (any axes before them, such as experts or the stacked
    layers, are a batch of matrices): the metadata Muon orthogonalizes by (`train.optim`)."""
    value = init(rngs.params(), tuple(shape), jnp.float32)
    metadata = {} if matrix is None else {"matrix": tuple(matrix)}
    return kind(value, out_sharding=tuple(axes), eager_sharding=False, **metadata)


class Dense(nnx.Module):
    """y = x · W (+ b), contracting the trailing `in_shape` axes of x with the leading axes of W.

    W has shape in_shape + out_shape and logical names in_axes + out_axes. Initialization:
    `init(fan_in, fan_out)` with fan_in = prod(in_shape), fan_out = prod(out_shape) (call sites
    pass their parameter group's `arch.init.group_init`), else variance 1/fan_in.

    Several leading axes of x (batch and time) are merged into one for the contraction, so the
    weight gradient contracts a single token axis. With two contracted axes XLA:CPU transposes the
    output's cotangent into a copy before the product, and fuses that strided copy into the
    elementwise backward pass before it (docs/performance.md, "The weight gradient's transposing
    copy"). The merge is a reshape of contiguous axes: free, and GSPMD carries a sharded batch or
    sequence axis through it.
    """

    def __init__(
        self,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        in_axes: Sequence[str | None],
        out_axes: Sequence[str | None],
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
        use_bias: bool = False,
        init: Callable[[int, int], Initializer] | None = None,
    ):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        fan_in = math.prod(in_shape)
        fan_out = math.prod(out_shape)
        initializer = init(fan_in, fan_out) if init else truncated_normal(fan_in**-0.5)
        self.kernel = param(rngs, initializer, in_shape + out_shape,
                            tuple(in_axes) + tuple(out_axes),
                            matrix=(len(in_shape), len(out_shape)))
        self.bias = (param(rngs, nnx.initializers.zeros, out_shape, out_axes)
                     if use_bias else None)
        self.n_in = len(in_shape)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:x.ndim - self.n_in]
        if len(lead) > 1:  # one token axis (see the class docstring)
            x = x.reshape((math.prod(lead),) + x.shape[len(lead):])
        y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), self.n_in)
        if len(lead) > 1:
            y = y.reshape(lead + y.shape[1:])
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embedding(nnx.Module):
    """Token embedding table E ∈ R^{V×d}, initialized by `init` (the model passes the `embedding`
    group's scheme, with fan_in = d), by default N(0, 1/d) so that a tied head starts with
    unit-scale logits for unit-RMS inputs. `attend` is the tied output head, logits = x Eᵀ.

    `fixnorm=True`: FixNorm (Nguyen & Chiang 2018, as used by Nguyen & Salazar 2019,
    "Transformers without Tears", FixNorm): every row is used ℓ2-normalized to a fixed length g,
    Ê[w] = g · E[w] / ‖E[w]‖₂, both for the input lookup and in the tied head (logits = x Êᵀ).
    g = `fixnorm_scale`, default 1: the authors' code (tnq177/transformers_without_tears,
    `F.normalize` of the word embedding) uses unit-length rows, and their extra √d factor on the
    input is Vaswani et al.'s embedding scale, which this framework does not use for any embedding;
    with g = 1 the rows keep the length ≈ 1 that the N(0, 1/d) initialization gives, so switching
    FixNorm on changes the constraint, not the initial scale. Norms are computed in float32.
    """

    def __init__(self, vocab_size: int, d_model: int, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 fixnorm: bool = False, fixnorm_scale: float | None = None,
                 init: Initializer | None = None):
        init = init or nnx.initializers.normal(stddev=d_model**-0.5)
        self.embedding = param(rngs, init, (vocab_size, d_model), ("vocab", "embed"))
        self.dtype = dtype
        self.fixnorm_scale: float | None = None  # None: FixNorm off
        if fixnorm:
            self.fixnorm_scale = 1.0 if fixnorm_scale is None else float(fixnorm_scale)

    def _fix_norm(self, rows: jax.Array) -> jax.Array:
        """g · rows / ‖rows‖₂ over the last axis (identity without FixNorm), in float32."""
        if self.fixnorm_scale is None:
            return rows
        rows = rows.astype(jnp.float32)
        length = jnp.sqrt(jnp.sum(rows**2, axis=-1, keepdims=True))
        return self.fixnorm_scale * rows / jnp.maximum(length, 1e-12)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        # Gather from a replicated copy: a lookup into a vocab-sharded table would make XLA
        # replicate the (much larger) gathered activations instead. FixNorm normalizes only the
        # gathered rows (the same numbers as normalizing the table first).
        table = constrain(self.embedding[...], (None, None))
        return self._fix_norm(jnp.take(table, tokens_BxT, axis=0)).astype(self.dtype)

    def attend(self, x_BxTxD: jax.Array) -> jax.Array:
        table = self._fix_norm(self.embedding[...])
        return jnp.einsum("btd,vd->btv", x_BxTxD, table.astype(self.dtype))
