"""Multi-token prediction (MTP): k sequential modules that predict the tokens 2 … k + 1 ahead
from the trunk's final hidden state, trained with the main next-token loss and sharing its
embedding and output head (Gloeckle et al. 2024, "Better & Faster Large Language Models via
Multi-token Prediction"; the sequential form is DeepSeek-V3's, DeepSeek-AI 2024 §2.2).

Module j = 1 … k (`model.head.mtp_depth` = k), at position i, with h⁰ the trunk's output (what
the final norm reads) and t the input tokens:

    h'ʲ_i = M_j [RMSNorm(hʲ⁻¹_i); RMSNorm(Emb(t_{i+j}))]      M_j ∈ R^{d×2d}
    hʲ    = TRM_j(h'ʲ)                                          one Transformer block
    Pʲ_i  = OutHead(hʲ_i)                                       predicts t_{i+j+1}

    L = CE₀ + (λ/k) Σ_j CE_j                                    λ = `model.head.mtp_weight`

Emb is the model's token embedding (no position embedding: the trunk state carries positions,
and RoPE rotates inside TRM_j), OutHead the model's final norm and head (`TransformerLM._output`).
The modules run only in the training loss (`TransformerLM.multi_token_logits`); the forward pass
used for evaluation, decoding and generation is the plain next-token path.

Simplifications, stated: TRM_j is a Pre-Norm block (x + F(norm(x)) with `model.norm`, the
model's attention and FFN) whatever `model.residual` is, since the multi-stream and
depth-attention states are defined over the trunk's depth; the final norm is shared with the
trunk (DeepSeek-V3's released weights give each module a norm of its own before the shared head).

Initialization: the two RMSNorm gains 1; M_j truncated normal with variance 1/(2d) (fan-in);
TRM_j as a trunk block. Logical axes: M_j (mtp_concat, embed). Cost per module and token: 2·2d²
for M_j, one block and one head application; the modules are unrolled (k is small).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from arch.layers import Dense
from arch.norms import RMSNorm
from arch.residual import constrain_state


def prenorm_config(cfg) -> ml_collections.FrozenConfigDict:
    """`cfg` with `residual.name="prenorm"`: the block config of every MTP module."""
    plain = ml_collections.ConfigDict(cfg)
    plain.residual.name = "prenorm"
    return ml_collections.FrozenConfigDict(plain)


class MultiTokenModule(nnx.Module):
    """One MTP module j: (hʲ⁻¹, Emb(t_{i+j})) → hʲ, B×T×D (module docstring). `block` is TRM_j,
    an `arch.model.Block` built from `prenorm_config(cfg)`."""

    def __init__(self, cfg, block: nnx.Module, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.hidden_norm = RMSNorm(d, eps=cfg.norm.eps, rngs=rngs)
        self.embedding_norm = RMSNorm(d, eps=cfg.norm.eps, rngs=rngs)
        self.projection = Dense((2 * d,), (d,), ("mtp_concat",), ("embed",), rngs=rngs,
                                dtype=jnp.dtype(cfg.dtype))
        self.block = block

    def __call__(self, hidden_BxTxD: jax.Array, future_BxTxD: jax.Array, positions_BxT,
                 rotate) -> jax.Array:
        joined_BxTx2D = jnp.concatenate(
            [self.hidden_norm(hidden_BxTxD), self.embedding_norm(future_BxTxD)], axis=-1)
        stream_BxTxD = constrain_state(self.projection(joined_BxTx2D))
        stream_BxTxD, _ = self.block(stream_BxTxD, positions_BxT, rotate)
        return stream_BxTxD
