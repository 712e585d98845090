"""ReZero ("rezero", registered in `RESIDUALS`): a residual sum with a learned scalar gate per
sublayer and no normalization.

Source: Bachlechner, Majumder, Mao, Cottrell & McAuley 2020, "ReZero is All You Need: Fast
Convergence at Large Depth" (arXiv 2003.04887), the ReZero update and the ReZero Transformer:

    x ← x + α · F(x),    α ∈ R one scalar per sublayer (attention and FFN each have their own)

Initialization: α = 0, so at initialization every block is the identity and the network is the
embedding followed by the output path (final norm, head); the first gradient step moves only
the α's (∂loss/∂α = ⟨∂loss/∂x, F(x)⟩), the sublayer weights start moving once α ≠ 0. The
sublayer reads the raw stream: ReZero removes LayerNorm (`model.norm` is not used by the
sublayers; set `model.norm.final=False` to remove the final norm too). α is a `MixingParam`,
kept out of weight decay unless `optimizer.decay_mixing=True`.

Cost: one scalar multiply per sublayer; memory: the plain sum's (the state is the stream x); 2L
scalars α in place of the Pre-Norm's 2L norm gains.
"""

from __future__ import annotations

import jax
from flax import nnx

from arch.layers import param
from arch.residual import PLAIN_SUM_IO, RESIDUALS, MixingParam, ResidualIO, ResidualMechanism


@RESIDUALS.register("rezero")
class ReZero(ResidualMechanism):
    """x ← x + α·F(x), α zero-initialized (module docstring). `read(x) = x`,
    `write(x, F) = x + α·F`."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.residual_weight = param(rngs, nnx.initializers.zeros, (1,), (None,), MixingParam)

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """The plain sum's: read the stream and the sublayer output, write the stream → 3."""
        return PLAIN_SUM_IO

    @classmethod
    def residual_history(cls, cfg) -> int:
        return 1

    def read(self, stream_BxTxD: jax.Array) -> jax.Array:
        return stream_BxTxD

    def write(self, stream_BxTxD: jax.Array, update_BxTxD: jax.Array,
              read_context=None) -> jax.Array:
        alpha = self.residual_weight[...].astype(update_BxTxD.dtype)
        return stream_BxTxD + alpha * update_BxTxD
