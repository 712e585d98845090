"""Residual-stream mechanisms. Registry: `RESIDUALS[name](cfg, rngs=...)`, one per sublayer.

A mechanism owns how a sublayer reads the stream and how it writes back:
    h = mechanism.read(stream);  stream = mechanism.write(stream, sublayer(h))
and, at the model level, how the stream starts from the embedding (`begin`) and what the final
norm sees (`end`). The plain sum's stream is x_BxTxD; richer mechanisms (multi-stream, depth
attention) carry richer state through the same four calls.
"""

from __future__ import annotations

from flax import nnx

from arch.norms import NORMS
from arch.registry import Registry

RESIDUALS = Registry("residual")


@RESIDUALS.register("prenorm")
class PreNormSum(nnx.Module):
    """Pre-Norm residual sum (Xiong et al. 2020, eq. for Pre-LN): x ← x + F(norm(x)).

    The norm is `model.norm`, gain 1 at initialization; the stream itself is never normalized.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.norm = NORMS[cfg.norm](cfg.d_model, eps=cfg.norm_eps, rngs=rngs)

    @staticmethod
    def begin(x_BxTxD):
        return x_BxTxD

    @staticmethod
    def end(stream_BxTxD):
        return stream_BxTxD

    def read(self, stream_BxTxD):
        return self.norm(stream_BxTxD)

    def write(self, stream_BxTxD, update_BxTxD):
        return stream_BxTxD + update_BxTxD
