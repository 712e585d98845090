"""Output heads: final hidden state → vocabulary logits. Registry: `HEADS[name](cfg, rngs=...)`,
called as `head(x_BxTxD, embedding) -> logits_BxTxV`."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from arch.layers import Dense
from arch.registry import Registry

HEADS = Registry("head")


@HEADS.register("tied")
class TiedHead(nnx.Module):
    """Tied head (Press & Wolf 2017): logits = x Eᵀ with E the input embedding; no parameters."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        del cfg, rngs

    def __call__(self, x_BxTxD, embedding):
        return embedding.attend(x_BxTxD)


@HEADS.register("untied")
class UntiedHead(nnx.Module):
    """Untied head: logits = x W_out, W_out ∈ R^{d×V}, initialized with variance 1/d."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.output = Dense((cfg.d_model,), (cfg.vocab_size,), ("embed",), ("vocab",), rngs=rngs,
                            dtype=jnp.dtype(cfg.dtype))

    def __call__(self, x_BxTxD, embedding):
        del embedding
        return self.output(x_BxTxD)
