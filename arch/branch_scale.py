"""Branch scaling: a multiplier on each sublayer's output before the residual mechanism writes it,
`model.branch_scale.name`:

    none        x ← write(x, F(h))
    layerscale  x ← write(x, γ ⊙ F(h)),  γ ∈ R^d learned, one per sublayer (LayerScale)
    fixed       x ← write(x, c · F(h)),  c a constant, the same for every sublayer

LayerScale: Touvron, Cord, Sablayrolles, Synnaeve & Jégou 2021, "Going deeper with Image
Transformers" (CaiT), §2 eq. 5. γ starts at ε·1 with ε = `model.branch_scale.layerscale_init`,
by default CaiT's rule by depth (L blocks): 0.1 for L ≤ 18, 1e-5 for L ≤ 24, 1e-6 beyond. γ is a
`MixingParam` (its initialization sets how much each branch contributes at the start, so it is
kept out of weight decay unless `optimizer.decay_mixing`), logical axis `embed`.

Fixed multiplier: c = `model.branch_scale.multiplier`, by default 1/√(2L) for L blocks of
two sublayers (1/√L for attention-only blocks): the residual-branch scaling that keeps the variance
of a Pre-Norm stream O(1) in depth at initialization (as in the depth-scaled initializations,
e.g. GPT-2's 1/√(2L) on the output projections, applied here to the branch instead of the
weights).

The scale acts on the branch, not on the mechanism's state, so it composes with every residual
mechanism (Pre-Norm, Post-Norm, DeepNorm's α-weighted skip, ...). Cost: one elementwise multiply
per sublayer; LayerScale adds d parameters per sublayer.
"""

from __future__ import annotations

import jax
from flax import nnx

from arch.layers import param
from arch.residual import MixingParam


class BranchScale(nnx.Module):
    """γ ⊙ u (`layerscale`) or c · u (`fixed`) on a sublayer output u, B×T×D; see the module
    docstring. Built only when `model.branch_scale.name` is not "none"."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.multiplier = None
        if cfg.branch_scale.name == "layerscale":
            start = nnx.initializers.constant(cfg.branch_scale.layerscale_init)
            self.gamma = param(rngs, start, (cfg.d_model,), ("embed",), MixingParam)
        else:
            self.multiplier = float(cfg.branch_scale.multiplier)

    def __call__(self, update_BxTxD: jax.Array) -> jax.Array:
        if self.multiplier is not None:
            return update_BxTxD * self.multiplier
        return update_BxTxD * self.gamma[...].astype(update_BxTxD.dtype)
