"""Attention. Registry: `ATTENTION[name](cfg, rngs=...)`; called as
`attention(x_BxTxD, positions_BxT, rotate, cache) -> (y_BxTxD, cache)`.

Shapes: B batch, T query positions, S key positions, D = d_model, H query heads, K key/value
heads (H = K·G, G queries per KV head), P head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from arch.layers import Dense
from arch.registry import Registry
from sharding.rules import constrain

ATTENTION = Registry("attention")


def causal_mask(query_positions_BxT: jax.Array, key_positions_BxS: jax.Array) -> jax.Array:
    """Additive mask M[b, t, s] = 0 where key s is at or before query t, −∞ otherwise."""
    allowed = key_positions_BxS[:, None, :] <= query_positions_BxT[:, :, None]
    return jnp.where(allowed, 0.0, -jnp.inf).astype(jnp.float32)


def dot_product_attention(q_BxTxHxP, k_BxSxKxP, v_BxSxKxP, mask_BxTxS):
    """softmax(QKᵀ/√P + M)V, with the H query heads grouped over the K key/value heads.

    Scores and softmax in float32; the weighted sum in the inputs' dtype.
    """
    b, t, h, p = q_BxTxHxP.shape
    k = k_BxSxKxP.shape[2]
    q_BxTxKxGxP = q_BxTxHxP.reshape(b, t, k, h // k, p)
    scores_BxKxGxTxS = jnp.einsum(
        "btkgp,bskp->bkgts", q_BxTxKxGxP, k_BxSxKxP, preferred_element_type=jnp.float32
    ) / jnp.sqrt(jnp.float32(p))
    scores_BxKxGxTxS = scores_BxKxGxTxS + mask_BxTxS[:, None, None]
    weights = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxP.dtype)
    out_BxTxKxGxP = jnp.einsum("bkgts,bskp->btkgp", weights, v_BxSxKxP)
    return out_BxTxKxGxP.reshape(b, t, h, p)


@ATTENTION.register("mha")
class MultiHeadAttention(nnx.Module):
    """Multi-head attention with H query and K key/value heads (Vaswani et al. 2017 §3.2;
    GQA: Ainslie et al. 2023; MQA: Shazeer 2019): MHA is K = H, MQA is K = 1, GQA between.

    q = x W_Q (d → H×P), k = x W_K, v = x W_V (d → K×P); head j reads KV head ⌊j/G⌋;
    y = concat_j softmax(q_j k_⌊j/G⌋ᵀ/√P + M) v_⌊j/G⌋ · W_O (H×P → d), M the causal mask.
    H·P may differ from d (`attention_width`). Initialization: variance 1/fan_in for all four.

    KV cache: {"key", "value"} of shape B×S_max×K×P; an input block at positions t₀..t₀+T−1
    writes its keys/values at those slots and attends to every slot at or before its position.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, h, k, p = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dtype = jnp.dtype(cfg.dtype)
        self.query = Dense((d,), (h, p), ("embed",), ("heads", "head_dim"), rngs=rngs, dtype=dtype)
        self.key = Dense((d,), (k, p), ("embed",), ("kv_heads", "head_dim"), rngs=rngs, dtype=dtype)
        self.value = Dense((d,), (k, p), ("embed",), ("kv_heads", "head_dim"), rngs=rngs,
                           dtype=dtype)
        self.output = Dense((h, p), (d,), ("heads", "head_dim"), ("embed",), rngs=rngs,
                            dtype=dtype)

    @staticmethod
    def cache_shapes(cfg, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
        return {"key": shape, "value": shape}

    def __call__(self, x_BxTxD, positions_BxT, rotate, cache=None):
        q = constrain(rotate(self.query(x_BxTxD), positions_BxT),
                      ("act_batch", "act_seq", "act_heads", None))
        k = constrain(rotate(self.key(x_BxTxD), positions_BxT),
                      ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(self.value(x_BxTxD), ("act_batch", "act_seq", "act_kv_heads", None))
        key_positions_BxS = positions_BxT
        if cache is not None:
            start = positions_BxT[0, 0]
            k = jax.lax.dynamic_update_slice(cache["key"], k.astype(cache["key"].dtype),
                                             (0, start, 0, 0))
            v = jax.lax.dynamic_update_slice(cache["value"], v.astype(cache["value"].dtype),
                                             (0, start, 0, 0))
            cache = {"key": k, "value": v}
            key_positions_BxS = jnp.broadcast_to(jnp.arange(k.shape[1]), k.shape[:2])
        out = dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype),
                                    causal_mask(positions_BxT, key_positions_BxS))
        return self.output(out), cache
