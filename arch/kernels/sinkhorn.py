"""mHC's projection onto the doubly-stochastic matrices (the mechanism: `arch.hyper`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sinkhorn(logits_XxNxN: jax.Array, iterations: int) -> jax.Array:
    """Sinkhorn–Knopp projection of exp(logits) onto the doubly-stochastic matrices (Sinkhorn &
    Knopp 1967; mHC, Xie et al. 2025 §4): M⁽⁰⁾ = exp(logits), M⁽ᵗ⁾ = T_r(T_c(M⁽ᵗ⁻¹⁾)), with T_c
    and T_r dividing every column, then every row, by its sum. Computed in log space in float32
    (subtracting log-sum-exps), so large logits do not overflow. Rows sum to 1 exactly after the
    last step; columns to 1 up to the convergence of `iterations` steps. Leading axes are batch.
    """
    def step(_, log_m):
        log_m = log_m - jax.nn.logsumexp(log_m, axis=-2, keepdims=True)  # columns
        return log_m - jax.nn.logsumexp(log_m, axis=-1, keepdims=True)  # rows

    return jnp.exp(jax.lax.fori_loop(0, iterations, step, logits_XxNxN.astype(jnp.float32)))
