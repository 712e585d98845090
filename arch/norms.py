"""Normalizations, token-local over the d features. Registry: `NORMS[name](dim, eps=..., rngs=...)`.

Statistics are computed in float32 whatever the compute dtype; the result is cast back. RMSNorm and
LayerNorm are rematerialized (`rematerialized`): a call keeps only its input for the backward pass
(one B×T×D array instead of four), at the cost of recomputing its statistics there; measured:
docs/performance.md#norms-rematerialized-statistics.
A norm with options beyond `eps` declares them in `config_fields` (constructor argument → field of
the `model.norm` section) and keeps a default for each; `make_norm(cfg, rngs=...)` builds the
configured norm with them.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from arch.layers import Dense, param
from arch.registry import Registry

NORMS = Registry("norm")


def rematerialized(norm):
    """A norm function f(x, *params) whose backward pass recomputes the statistics from x:
    autodiff saves x, 2x, x·r and g·x·r (r = the inverse scale) for every call; this saves x."""
    return jax.checkpoint(norm, prevent_cse=False)


@rematerialized
def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + eps)
    return (y * scale).astype(x.dtype)


@rematerialized
def _layer_norm(x, scale, bias, eps):
    x32 = x.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = centered * jax.lax.rsqrt(jnp.mean(centered**2, axis=-1, keepdims=True) + eps)
    return (y * scale + bias).astype(x.dtype)


@NORMS.register("rmsnorm")
class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019, eq. 4): y = g ⊙ x / sqrt(mean(x²) + ε).

    Gain g initialized to 1; no bias, no mean subtraction (so a common shift is not removed).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return _rms_norm(x, self.scale[...], self.eps)


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
        return _layer_norm(x, self.scale[...], self.bias[...], self.eps)


@NORMS.register("none")
class Identity(nnx.Module):
    """No normalization: y = x, no parameters (the no-normalization ablation baseline)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        del dim, eps, rngs

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


@NORMS.register("scalenorm")
class ScaleNorm(nnx.Module):
    """ScaleNorm (Nguyen & Salazar 2019, "Transformers without Tears", the ScaleNorm equation):
    y = g · x / max(‖x‖₂, ε), with ONE learned scalar g for all d features.

    g initialized to √d, so that at initialization ‖y‖ = √d, i.e. y has unit RMS like RMSNorm's
    output. Invariant to positive rescaling of x (away from the ε floor). g is stored with shape
    (1,), not (): `nnx.vmap` drops the `layers` axis name of a parameter with no axis names.
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.constant(dim**0.5), (1,), ("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        length = jnp.sqrt(jnp.sum(x32**2, axis=-1, keepdims=True))
        return (self.scale[...] * x32 / jnp.maximum(length, self.eps)).astype(x.dtype)


@NORMS.register("dyt")
class DynamicTanh(nnx.Module):
    """Dynamic Tanh (Zhu et al. 2025, "Transformers without Normalization", eq. 1):
    y = γ ⊙ tanh(α · x) + β, an element-wise replacement for a norm layer: no statistics at all.

    α is ONE learned scalar, initialized to `alpha_init` (config `model.norm.dyt_alpha_init`; the
    paper's default α₀ = 0.5; its α₀ study finds wide LLMs want smaller values); γ ∈ R^d
    initialized to 1, β ∈ R^d to 0 (α stored with shape (1,), as ScaleNorm's g). `eps` is
    accepted for the common signature and unused.
    Unlike the norms above, it is not invariant to rescaling x: tanh saturates.
    """

    config_fields: ClassVar[dict[str, str]] = {"alpha_init": "dyt_alpha_init"}

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs, alpha_init: float = 0.5):
        del eps
        self.alpha = param(rngs, nnx.initializers.constant(alpha_init), (1,), ("norm",))
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",))
        self.bias = param(rngs, nnx.initializers.zeros, (dim,), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.tanh(self.alpha[...] * x.astype(jnp.float32))
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


@NORMS.register("gatednorm")
class GatedNorm(nnx.Module):
    """GatedNorm (Qwen Team 2026, Qwen architecture report, gated normalization): RMSNorm followed
    by a feature-wise sigmoid gate computed from a low-rank projection of the normalized input,

        n = g ⊙ x / sqrt(mean(x²) + ε),    y = n ⊙ σ(n W_down W_up),

    W_down ∈ R^{d×r}, W_up ∈ R^{r×d}, r = `rank` (config `model.norm.gated_rank`).

    Initialization: g = 1; W_down truncated normal with variance 1/d (so n W_down has unit-scale
    entries); W_up = 0, so the gate starts at exactly σ(0) = 0.5 for every feature and token,
    i.e. y = n / 2. Why zero W_up rather than a bias that opens the gate to ≈ 1: the gate then
    starts where the sigmoid is steepest (σ'(0) = 1/4, not a saturated σ' ≈ 0) and W_up receives
    a non-zero gradient from the first step (as with LoRA's zero-initialized up-projection),
    while the uniform factor 1/2 is a scale that the gain g and the following linear maps absorb.
    The gate is computed in float32 like the statistics (its cost, 2·d·r per token, is small).
    """

    config_fields: ClassVar[dict[str, str]] = {"rank": "gated_rank"}

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs, rank: int = 16):
        if rank <= 0:
            raise ValueError(f"GatedNorm rank must be positive, got {rank}")
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",))
        self.gate_down = Dense((dim,), (rank,), ("embed",), ("norm_rank",), rngs=rngs)
        self.gate_up = Dense((rank,), (dim,), ("norm_rank",), ("embed",), rngs=rngs,
                             init=lambda fan_in, fan_out: nnx.initializers.zeros)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        n = x32 * jax.lax.rsqrt(jnp.mean(x32**2, axis=-1, keepdims=True) + self.eps)
        n = n * self.scale[...]
        gate = jax.nn.sigmoid(self.gate_up(self.gate_down(n)))
        return (n * gate).astype(x.dtype)


def make_norm(cfg, dim: int | None = None, *, rngs: nnx.Rngs) -> nnx.Module:
    """Build `NORMS[cfg.norm.name]` over `dim` features (default `cfg.d_model`) with every option it
    reads from the config: `eps` from `cfg.norm.eps`, plus the norm's `config_fields`
    (constructor argument → config field, e.g. DyT's `alpha_init` ← `model.norm.dyt_alpha_init`)."""
    norm = NORMS[cfg.norm.name]
    options = {arg: cfg.norm[field] for arg, field in getattr(norm, "config_fields", {}).items()}
    return norm(cfg.d_model if dim is None else dim, eps=cfg.norm.eps, rngs=rngs, **options)
