"""Position-wise feed-forward networks. Registry: `FFNS[name](cfg, rngs=...)`, called on x_BxTxD.

Two families (Shazeer 2020, "GLU Variants Improve Transformer", §2):

- two-projection `mlp`: y = φ(x W₁) W₂, φ = `model.ffn.activation` (eqs. 2–3);
- gated `glu`, `reglu`, `geglu`, `swiglu`: y = (φ(x W) ⊙ x V) W₂ with φ fixed by the name
  (eqs. 4–6): one class, `GatedFFN`, parametrized by its gate activation.

How many d × d_ff projections each FFN has is its record's `projections` (`config.catalogue`),
which `config.model_rules.hidden_width` reads to size d_ff for `model.ffn.width="match_mlp"`.

Activations are a registry of their own (`ACTIVATIONS`, elementwise functions x ↦ φ(x)); build
one for a config with `activation(cfg, name)`, which binds its config options (the leaky slope).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from arch.dropout import apply as dropout
from arch.init import group_init
from arch.layers import Dense
from arch.registry import Registry
from sharding.rules import constrain

FFNS = Registry("ffn")
ACTIVATIONS = Registry("activation")
# GELU, tanh approximation (Hendrycks & Gimpel 2016): ½x(1 + tanh(√(2/π)(x + 0.044715x³)))
ACTIVATIONS.register("gelu")(jax.nn.gelu)
# ReLU (Glorot et al. 2011): max(x, 0)
ACTIVATIONS.register("relu")(jax.nn.relu)
# SiLU / Swish₁ (Ramachandran et al. 2017; Hendrycks & Gimpel 2016): x·σ(x)
ACTIVATIONS.register("silu")(jax.nn.silu)
# Leaky ReLU (Maas et al. 2013): x if x ≥ 0 else α·x, α = `model.ffn.leaky_relu_slope` (see
# activation)
ACTIVATIONS.register("leaky_relu")(jax.nn.leaky_relu)
# logistic sigmoid: σ(x) = 1 / (1 + e^(−x))
ACTIVATIONS.register("sigmoid")(jax.nn.sigmoid)
# hyperbolic tangent: (eˣ − e^(−x)) / (eˣ + e^(−x))
ACTIVATIONS.register("tanh")(jnp.tanh)
# hard tanh (Collobert 2004): clip(x, −1, 1)
ACTIVATIONS.register("hardtanh")(jax.nn.hard_tanh)

_HIDDEN = ("act_batch", "act_seq", "act_mlp")


def activation(cfg, name: str | None = None) -> Callable[[jax.Array], jax.Array]:
    """The elementwise activation `name` (default `cfg.ffn.activation`) with its config options
    bound: leaky_relu gets its negative slope α from `cfg.ffn.leaky_relu_slope`."""
    name = name or cfg.ffn.activation
    if name == "leaky_relu":
        return _leaky_relu(float(cfg.ffn.leaky_relu_slope))
    return ACTIVATIONS[name]


@functools.cache
def _leaky_relu(slope: float) -> Callable[[jax.Array], jax.Array]:
    # One object per slope: the function is a static attribute of the module (part of its graph
    # definition), so two models with the same config must hold the same, equal function.
    return functools.partial(ACTIVATIONS["leaky_relu"], negative_slope=slope)


@FFNS.register("mlp")
class MLP(nnx.Module):
    """Two-projection FFN (Vaswani et al. 2017 eq. 2; Shazeer 2020 eqs. 2–3, no biases):
    y = φ(x W₁) W₂, W₁ (`up`): d → d_ff, W₂ (`down`): d_ff → d, φ = `model.ffn.activation`.
    `model.linear_bias`: y = φ(x W₁ + b₁) W₂ + b₂ (Vaswani et al. eq. 2 as written; GPT-2),
    biases zero-initialized. Initialization: `model.init` groups ffn_input (W₁) and ffn_output
    (W₂); default variance 1/fan_in."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        dtype, bias, d, f = jnp.dtype(cfg.dtype), cfg.linear_bias, cfg.d_model, cfg.ffn.d_ff
        self.up = Dense((d,), (f,), ("embed",), ("mlp",), rngs=rngs, dtype=dtype,
                        use_bias=bias, init=group_init(cfg, "ffn_input"))
        self.down = Dense((f,), (d,), ("mlp",), ("embed",), rngs=rngs, dtype=dtype,
                          use_bias=bias, init=group_init(cfg, "ffn_output"))
        self.activation = activation(cfg)

    def __call__(self, x_BxTxD):
        hidden_BxTxF = dropout(self.activation(self.up(x_BxTxD)), "ffn_hidden")  # training only
        return self.down(constrain(hidden_BxTxF, _HIDDEN))


class GatedFFN(nnx.Module):
    """Gated FFN (Dauphin et al. 2017; Shazeer 2020 eqs. 4–6, no biases):
    y = (φ(x W) ⊙ x V) W₂, W (`gate`), V (`up`): d → d_ff, W₂ (`down`): d_ff → d.

    φ is the class's `gate_activation`, a name in `ACTIVATIONS`; the registered subclasses fix it
    as in Shazeer 2020 eq. 5/6: `glu` σ (sigmoid), `reglu` ReLU, `geglu` GELU, `swiglu` Swish₁ =
    SiLU. `model.ffn.activation` is not used. Three d × d_ff matrices instead of two: use
    `model.ffn.width="match_mlp"` for the parameter count of the two-projection FFN.
    `model.linear_bias`: every projection adds a zero-initialized bias,
    y = (φ(x W + b) ⊙ (x V + c)) W₂ + b₂.
    Initialization: `model.init` groups ffn_input (W, V) and ffn_output (W₂); default variance
    1/fan_in.
    """

    gate_activation: str

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        dtype, bias = jnp.dtype(cfg.dtype), cfg.linear_bias
        d, f = cfg.d_model, cfg.ffn.d_ff
        self.gate = Dense((d,), (f,), ("embed",), ("mlp",), rngs=rngs, dtype=dtype,
                          use_bias=bias, init=group_init(cfg, "ffn_input"))
        self.up = Dense((d,), (f,), ("embed",), ("mlp",), rngs=rngs, dtype=dtype,
                        use_bias=bias, init=group_init(cfg, "ffn_input"))
        self.down = Dense((f,), (d,), ("mlp",), ("embed",), rngs=rngs, dtype=dtype,
                          use_bias=bias, init=group_init(cfg, "ffn_output"))
        self.activation = activation(cfg, self.gate_activation)

    def __call__(self, x_BxTxD):
        hidden_BxTxF = self.activation(self.gate(x_BxTxD)) * self.up(x_BxTxD)
        hidden_BxTxF = dropout(hidden_BxTxF, "ffn_hidden")  # training only (arch/dropout.py)
        return self.down(constrain(hidden_BxTxF, _HIDDEN))


@FFNS.register("glu")
class GLU(GatedFFN):
    """FFN_GLU (Shazeer 2020 eq. 6; Dauphin et al. 2017): y = (σ(x W) ⊙ x V) W₂."""

    gate_activation = "sigmoid"


@FFNS.register("reglu")
class ReGLU(GatedFFN):
    """FFN_ReGLU (Shazeer 2020 eqs. 5–6): y = (max(x W, 0) ⊙ x V) W₂."""

    gate_activation = "relu"


@FFNS.register("geglu")
class GEGLU(GatedFFN):
    """FFN_GEGLU (Shazeer 2020 eqs. 5–6): y = (GELU(x W) ⊙ x V) W₂."""

    gate_activation = "gelu"


@FFNS.register("swiglu")
class SwiGLU(GatedFFN):
    """FFN_SwiGLU (Shazeer 2020 eqs. 5–6): y = (SiLU(x W) ⊙ x V) W₂, SiLU = Swish₁ = x·σ(x)."""

    gate_activation = "silu"
