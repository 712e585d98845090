"""Normalizations, token-local over the d features. Registry: `NORMS[name](dim, eps=..., rngs=...)`.

Statistics are computed in float32 whatever the compute dtype; the result is cast back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from arch.layers import param
from arch.registry import Registry

NORMS = Registry("norm")


@NORMS.register("rmsnorm")
class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019, eq. 4): y = g ⊙ x / sqrt(mean(x²) + ε).

    Gain g initialized to 1; no bias, no mean subtraction (so a common shift is not removed).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


@NORMS.register("layernorm")
class LayerNorm(nnx.Module):
    """LayerNorm (Ba et al. 2016): y = g ⊙ (x − mean(x)) / sqrt(var(x) + ε) + b.

    Gain g initialized to 1 and bias b to 0.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",))
        self.bias = param(rngs, nnx.initializers.zeros, (dim,), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = centered * jax.lax.rsqrt(jnp.mean(centered**2, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)
