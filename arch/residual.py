"""Residual-stream mechanisms. Registry: `RESIDUALS[name](cfg, rngs=...)`, one per sublayer.

A mechanism owns how a sublayer reads the residual state and how it writes back:
    h = mechanism.read(state);  state = mechanism.write(state, sublayer(h))
one instance per sublayer (stacked over layers with the blocks), and, at the model level, a
`stream` module (`Mechanism.stream(cfg, rngs=...)`, built once, parameters not stacked) that
starts the state from the embedding (`begin`) and gives what the final norm sees (`end`):
    state = stream.begin(x_BxTxD);  ...;  x_BxTxD = stream.end(state)
The plain sum's state is x_BxTxD itself. Richer mechanisms (several streams, a history of depth
sources) carry a pytree through the same calls; by convention its leaves are x_BxTxD-shaped,
stacked n×B×T×D, or small (counters, per-depth parameters), and `constrain_state` shards them.
A stream module may also group sublayers (`units_per_block`; two-phase AttnRes), and then scans
the layers itself, one group per step (its `scan`, called by `TransformerLM._scan`).
"""

from __future__ import annotations

import jax
from flax import nnx

from arch.norms import make_norm
from arch.registry import Registry
from sharding.rules import STREAM, constrain

RESIDUALS = Registry("residual")


def constrain_state(state):
    """Shard every activation leaf of a residual state: x_BxTxD like the stream, n×B×T×D with the
    leading (stream or depth-source) axis replicated; other leaves are left alone."""
    def leaf(x):
        if x.ndim == 3:
            return constrain(x, STREAM)
        if x.ndim == 4:
            return constrain(x, (None, *STREAM))
        return x
    return jax.tree.map(leaf, state)


def record(module: nnx.Module, name: str, value, kind: type[nnx.Variable] = nnx.Intermediate,
           ) -> None:
    """Expose a quantity (depth weights, read gates, write strengths) to a caller that runs the
    model under `nnx.capture(model, kind)`; nothing is stored otherwise, so training state never
    changes. Capture matches the exact type: a subclass `kind` (e.g. the attention probabilities'
    `arch.attention.AttentionWeights`) is collected only by callers that ask for it. Values sown
    inside the layer scan come out stacked over layers."""
    if hasattr(module, "__captures__"):
        module.sow(kind, name, value)


class SumStream(nnx.Module):
    """Model-level part of the single-stream mechanisms: the state is the embedding itself, and
    the final norm reads the state."""

    def begin(self, x_BxTxD):
        return x_BxTxD

    def end(self, stream_BxTxD):
        return stream_BxTxD


@RESIDUALS.register("prenorm")
class PreNormSum(nnx.Module):
    """Pre-Norm residual sum (Xiong et al. 2020, "On Layer Normalization in the Transformer
    Architecture", Fig. 1b): x ← x + F(norm(x)).

    The norm is `model.norm`, gain 1 at initialization; the stream itself is never normalized.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.norm = make_norm(cfg, rngs=rngs)

    @classmethod
    def stream(cls, cfg, *, rngs: nnx.Rngs) -> nnx.Module:
        return SumStream()

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
