"""BatchNorm for token sequences, plain and causal. Registered in `NORMS` as "batchnorm" and
"causal_batchnorm".

Unlike the token-local norms, BatchNorm carries state: running statistics (`nnx.BatchStat`)
updated in training and used in evaluation (`model.eval()`). The train step threads that state
through the jit boundary; under data parallelism the batch mean is a mean over the *global* batch
(GSPMD inserts the all-reduce), so statistics are synchronized across devices by construction.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from arch.layers import param
from arch.norms import NORMS


def _batch_stat(value: jax.Array) -> nnx.BatchStat:
    return nnx.BatchStat(value, out_sharding=("norm",), eager_sharding=False)


class BatchNorm(nnx.Module):
    """BatchNorm over batch and positions (Ioffe & Szegedy 2015, Alg. 1; applied to Transformer
    features as in Shen et al. 2020, "PowerNorm", §3):

        y = γ ⊙ (x − μ) / sqrt(σ² + ε) + β,   μ, σ² per feature over all unmasked (b, t).

    A padding mask (B×T, 1 = real token) removes padded positions from the statistics. Running
    averages r ← m·r + (1 − m)·batch statistic (m = `momentum`) replace μ, σ² in evaluation.
    Initialization: γ = 1, β = 0, running mean 0, running variance 1.

    Note: in training, the statistics mix positions, so position t sees information from later
    positions of the batch; `CausalBatchNorm` removes that leak.
    """

    causal = False
    config_fields: ClassVar[dict[str, str]] = {"momentum": "batchnorm_momentum"}

    def __init__(self, dim: int, *, eps: float = 1e-5, momentum: float = 0.9, rngs: nnx.Rngs):
        self.scale = param(rngs, nnx.initializers.ones, (dim,), ("norm",))
        self.bias = param(rngs, nnx.initializers.zeros, (dim,), ("norm",))
        self.running_mean = _batch_stat(jnp.zeros((dim,), jnp.float32))
        self.running_var = _batch_stat(jnp.ones((dim,), jnp.float32))
        self.eps, self.momentum = eps, momentum
        self.use_running_average = False

    def _statistics(self, x32, weight_BxTx1):
        """Mean and variance per feature (shape D, or T×D when causal) of the weighted tokens."""
        count = jnp.maximum(weight_BxTx1.sum(), 1.0)
        mean = (weight_BxTx1 * x32).sum((0, 1)) / count
        var = (weight_BxTx1 * (x32 - mean) ** 2).sum((0, 1)) / count
        return mean, var

    def __call__(self, x_BxTxD: jax.Array, mask_BxT: jax.Array | None = None) -> jax.Array:
        x32 = x_BxTxD.astype(jnp.float32)
        if self.use_running_average:
            mean, var = self.running_mean[...], self.running_var[...]
        else:
            weight = (jnp.ones(x32.shape[:2]) if mask_BxT is None
                      else mask_BxT.astype(jnp.float32))[..., None]
            mean, var = self._statistics(x32, weight)
            full_mean, full_var = (mean[-1], var[-1]) if self.causal else (mean, var)
            m = self.momentum
            self.running_mean[...] = m * self.running_mean[...] + (1 - m) * full_mean
            self.running_var[...] = m * self.running_var[...] + (1 - m) * full_var
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.scale[...] + self.bias[...]).astype(x_BxTxD.dtype)


class CausalBatchNorm(BatchNorm):
    """Causal BatchNorm: the statistics at position t use only positions ≤ t of every sequence
    in the batch (cumulative sums over time), so no output depends on a later token:

        μ_t = Σ_b Σ_{s≤t} w_bs x_bs / Σ_b Σ_{s≤t} w_bs,   σ²_t likewise (clamped at 0).

    The running averages track the statistics over all positions (μ_T, σ²_T).
    Initialization and evaluation as `BatchNorm`.
    """

    causal = True

    def _statistics(self, x32, weight_BxTx1):
        count_T = jnp.maximum(jnp.cumsum(weight_BxTx1.sum((0, 2)), 0), 1.0)[:, None]
        sum_TxD = jnp.cumsum((weight_BxTx1 * x32).sum(0), 0)
        square_TxD = jnp.cumsum((weight_BxTx1 * x32**2).sum(0), 0)
        mean = sum_TxD / count_T
        return mean, jnp.maximum(square_TxD / count_T - mean**2, 0.0)


NORMS.register("batchnorm")(BatchNorm)
NORMS.register("causal_batchnorm")(CausalBatchNorm)
