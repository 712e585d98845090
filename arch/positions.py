"""Position information. Registry: `POSITIONS[name](cfg, rngs=...)`.

Each position module offers two hooks, so every scheme plugs in at the same two places:
`embed(x_BxTxD, positions_BxT)` runs once after the token embedding, and
`rotate(x_BxTxHxP, positions_BxT)` runs on queries and keys inside every attention layer.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from arch.layers import param
from arch.registry import Registry

POSITIONS = Registry("position")


@POSITIONS.register("none")
class NoPositions(nnx.Module):
    """No position information (a causal mask alone still breaks permutation symmetry)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        del cfg, rngs

    def embed(self, x_BxTxD, positions_BxT):
        return x_BxTxD

    def rotate(self, x_BxTxHxP, positions_BxT):
        return x_BxTxHxP


@POSITIONS.register("learned")
class LearnedPositions(NoPositions):
    """Learned absolute positions (Vaswani et al. 2017 §3.5, GPT-2): x_t ← x_t + P[t].

    P ∈ R^{max_seq_len×d}, initialized N(0, 0.02²).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        self.table = param(rngs, init, (cfg.max_seq_len, cfg.d_model), ("positions", "embed"))

    def embed(self, x_BxTxD, positions_BxT):
        return x_BxTxD + jnp.take(self.table[...], positions_BxT, axis=0).astype(x_BxTxD.dtype)


@POSITIONS.register("sinusoidal")
class SinusoidalPositions(NoPositions):
    """Fixed sinusoidal positions (Vaswani et al. 2017 §3.5): x_t ← x_t + PE[t] with

        PE[t, 2i] = sin(t / 10000^{2i/d}),    PE[t, 2i+1] = cos(t / 10000^{2i/d}),

    computed from the positions themselves (no table, no length limit; an odd d drops the last
    cosine). No parameters; cost: 2 transcendental functions per token and channel."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        del rngs
        self.d_model = cfg.d_model

    def embed(self, x_BxTxD, positions_BxT):
        pair = jnp.arange(self.d_model) // 2  # i for channels 2i and 2i + 1
        inv_freq_D = 10_000.0 ** (-2.0 * pair.astype(jnp.float32) / self.d_model)
        angle_BxTxD = positions_BxT[..., None].astype(jnp.float32) * inv_freq_D
        table_BxTxD = jnp.where(jnp.arange(self.d_model) % 2 == 0, jnp.sin(angle_BxTxD),
                                jnp.cos(angle_BxTxD))
        return x_BxTxD + table_BxTxD.astype(x_BxTxD.dtype)


@POSITIONS.register("rope")
class RoPE(NoPositions):
    """Rotary position embedding (Su et al. 2021, eq. 34), "rotate-half" layout.

    Feature pairs (i, i + p/2) of each query/key head rotate by angle t·θ_i with
    θ_i = base^(−2i/p), so q_tᵀ k_s depends on positions only through t − s. No parameters.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        del rngs
        self.base = cfg.position.rope_base

    def rotate(self, x_BxTxHxP, positions_BxT):
        half = x_BxTxHxP.shape[-1] // 2
        inv_freq = self.base ** (-jnp.arange(half, dtype=jnp.float32) / half)
        angle_BxTx1xH = (positions_BxT[..., None].astype(jnp.float32) * inv_freq)[:, :, None, :]
        sin, cos = jnp.sin(angle_BxTx1xH), jnp.cos(angle_BxTx1xH)
        x1, x2 = jnp.split(x_BxTxHxP.astype(jnp.float32), 2, axis=-1)
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x_BxTxHxP.dtype)
