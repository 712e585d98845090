"""Residual-stream mechanisms. Registry: `RESIDUALS[name](cfg, rngs=...)`, one per sublayer.

A mechanism owns how a sublayer reads the stream and how it writes back:
    h = mechanism.read(stream);  stream = mechanism.write(stream, sublayer(h))
and, at the model level, how the stream starts from the embedding (`begin`) and what the final
norm sees (`end`). The plain sum's stream is x_BxTxD; richer mechanisms (multi-stream, depth
attention) carry richer state through the same four calls.
"""

from __future__ import annotations

from flax import nnx

from arch.norms import make_norm
from arch.registry import Registry

RESIDUALS = Registry("residual")


@RESIDUALS.register("prenorm")
class PreNormSum(nnx.Module):
    """Pre-Norm residual sum (Xiong et al. 2020, "On Layer Normalization in the Transformer
    Architecture", Fig. 1b): x ← x + F(norm(x)).

    The norm is `model.norm`, gain 1 at initialization; the stream itself is never normalized.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.norm = make_norm(cfg, rngs=rngs)

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


@RESIDUALS.register("postnorm")
class PostNormSum(PreNormSum):
    """Post-Norm (Vaswani et al. 2017 §3.1; Xiong et al. 2020 Fig. 1a): x ← norm(x + F(x)).

    The sublayer reads the raw stream; every write is normalized (gain 1 at initialization).
    The original model has no final norm: set `model.final_norm=False` to match it.
    """

    def read(self, stream_BxTxD):
        return stream_BxTxD

    def write(self, stream_BxTxD, update_BxTxD):
        return self.norm(stream_BxTxD + update_BxTxD)


@RESIDUALS.register("deepnorm")
class DeepNormSum(PostNormSum):
    """DeepNorm (Wang et al. 2022, "DeepNet", eq. 5 and Table 1, decoder-only):
    x ← norm(α·x + F(x)) with α = (2M)^{1/4} for an M-block decoder.

    The other half of DeepNet is its initialization: Xavier with gain β = (8M)^{-1/4} on the FFN,
    value and output projections (Q and K keep gain 1), set by `model.init` (see arch/init.py and
    `experiments.common.use_deepnorm`).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.alpha = (2 * cfg.num_layers) ** 0.25

    def write(self, stream_BxTxD, update_BxTxD):
        return self.norm(self.alpha * stream_BxTxD + update_BxTxD)


@RESIDUALS.register("noskip")
class NoSkip(PreNormSum):
    """No skip connection, the rank-collapse ablation of Dong et al. 2021 ("Attention is not all
    you need: pure attention loses rank doubly exponentially with depth", §2 and §4):
    x ← F(norm(x)). With `model.use_ffn=False` the stack is pure attention.
    """

    def write(self, stream_BxTxD, update_BxTxD):
        return update_BxTxD
