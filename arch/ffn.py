"""Position-wise feed-forward networks. Registry: `FFNS[name](cfg, rngs=...)`, called on x_BxTxD.

Activations are a registry of their own (`ACTIVATIONS`), used by the two-projection FFN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from arch.layers import Dense
from arch.registry import Registry
from sharding.rules import constrain

FFNS = Registry("ffn")
ACTIVATIONS = Registry("activation")
ACTIVATIONS.register("gelu")(jax.nn.gelu)
ACTIVATIONS.register("relu")(jax.nn.relu)
ACTIVATIONS.register("silu")(jax.nn.silu)

_HIDDEN = ("act_batch", "act_seq", "act_mlp")


@FFNS.register("mlp")
class MLP(nnx.Module):
    """Two-projection FFN (Vaswani et al. 2017 eq. 2): y = φ(x W₁) W₂, W₁: d → d_ff, W₂: d_ff → d,
    φ = `model.activation`. Initialization: variance 1/fan_in for both."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.up = Dense((cfg.d_model,), (cfg.d_ff,), ("embed",), ("mlp",), rngs=rngs, dtype=dtype)
        self.down = Dense((cfg.d_ff,), (cfg.d_model,), ("mlp",), ("embed",), rngs=rngs,
                          dtype=dtype)
        self.activation = ACTIVATIONS[cfg.activation]

    def __call__(self, x_BxTxD):
        return self.down(constrain(self.activation(self.up(x_BxTxD)), _HIDDEN))


@FFNS.register("swiglu")
class SwiGLU(nnx.Module):
    """SwiGLU (Shazeer 2020, eq. 6): y = (SiLU(x W) ⊙ x V) W₂, W, V: d → d_ff, W₂: d_ff → d.
    Initialization: variance 1/fan_in for all three."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        d, f = cfg.d_model, cfg.d_ff
        self.gate = Dense((d,), (f,), ("embed",), ("mlp",), rngs=rngs, dtype=dtype)
        self.up = Dense((d,), (f,), ("embed",), ("mlp",), rngs=rngs, dtype=dtype)
        self.down = Dense((f,), (d,), ("mlp",), ("embed",), rngs=rngs, dtype=dtype)

    def __call__(self, x_BxTxD):
        hidden = jax.nn.silu(self.gate(x_BxTxD)) * self.up(x_BxTxD)
        return self.down(constrain(hidden, _HIDDEN))
