"""Parameter helper and the two primitive layers every component is built from.

All parameters are float32 and carry logical axis names (see `sharding/rules.py`); computation runs
in the configured compute dtype. `Dense` generalizes a linear map to multi-axis inputs and outputs
(e.g. d → (h, p) for attention), so no component reshapes weights by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from sharding.rules import constrain

Initializer = nnx.initializers.Initializer


def param(
    rngs: nnx.Rngs, init: Initializer, shape: Sequence[int], axes: Sequence[str | None]
) -> nnx.Param:
    """A float32 parameter with logical axis names; it is sharded later, by the rules table."""
    value = init(rngs.params(), tuple(shape), jnp.float32)
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def fan_in_init(fan_in: int, scale: float = 1.0) -> Initializer:
    """Truncated normal with variance scale²/fan_in (width-scaled, "LeCun" initialization)."""
    std = scale / fan_in**0.5
    return lambda key, shape, dtype: std * jax.random.truncated_normal(key, -2.0, 2.0, shape, dtype)


class Dense(nnx.Module):
    """y = x · W (+ b), contracting the trailing `in_shape` axes of x with the leading axes of W.

    W has shape in_shape + out_shape and logical names in_axes + out_axes. Initialization:
    truncated normal with variance 1/fan_in, where fan_in = prod(in_shape), unless `init` is given.
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
        init: Initializer | None = None,
    ):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        fan_in = math.prod(in_shape)
        self.kernel = param(rngs, init or fan_in_init(fan_in), in_shape + out_shape,
                            tuple(in_axes) + tuple(out_axes))
        self.bias = (param(rngs, nnx.initializers.zeros, out_shape, out_axes)
                     if use_bias else None)
        self.n_in = len(in_shape)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), self.n_in)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


class Embedding(nnx.Module):
    """Token embedding table E ∈ R^{V×d}, N(0, 1/d) so that a tied head starts with unit-scale
    logits for unit-RMS inputs. `attend` is the tied output head, logits = x Eᵀ."""

    def __init__(self, vocab_size: int, d_model: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        init = nnx.initializers.normal(stddev=d_model**-0.5)
        self.embedding = param(rngs, init, (vocab_size, d_model), ("vocab", "embed"))
        self.dtype = dtype

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        # Gather from a replicated copy: a lookup into a vocab-sharded table would make XLA
        # replicate the (much larger) gathered activations instead.
        table = constrain(self.embedding[...], (None, None))
        return jnp.take(table, tokens_BxT, axis=0).astype(self.dtype)

    def attend(self, x_BxTxD: jax.Array) -> jax.Array:
        return jnp.einsum("btd,vd->btv", x_BxTxD, self.embedding[...].astype(self.dtype))
