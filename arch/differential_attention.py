"""Differential attention (Ye et al. 2024, "Differential Transformer", arXiv 2410.05258, §2.1,
eqs. 1–4; the authors' `multihead_diffattn.py` in microsoft/unilm), registered as
`ATTENTION["differential"]`: the difference of two softmax maps cancels the attention both give
to irrelevant context.

Shapes: B batch, T query positions, S key positions, D = d_model, H query heads, K key/value
heads (H = K·G), P = `attention.head_dim` the width of a head, d = P/2 the width of each of its
two query/key halves. Head h reads key/value head ⌊h/G⌋:

    [Q₁ Q₂] = X W_Q    D → H×P, each head's P features split into halves of d
    [K₁ K₂] = X W_K    D → K×P, likewise;   V = X W_V   D → K×P (the full width 2d)
    A_i = softmax(Q_i K_iᵀ/√d + M)                    i = 1, 2; M the causal mask
    λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init      one scalar per layer, shared by the heads
    head_h = (1 − λ_init) · RMSNorm((A₁ − λ·A₂) V)    per head over its P features (eq. 3)
    y = [head_1; …; head_H] W_O                       H×P → D

With H heads of width P = 2d the parameters are those of MHA with the same H, K and P plus
3·P (the four λ vectors and the norm gain): the paper halves the head count of the Transformer
it compares with. RoPE rotates each half (width d, so d must be even), as the authors' code
rotates its 2H heads of width d. `attention.window` W > 0 bands M as in MHA.

λ_init: the paper sets λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) for layer l = 1 … L. The blocks
here are built once and vmapped over the layer stack, so a layer does not know its depth: every
layer uses λ_init = 0.8, the schedule's limit in depth (the paper's ablation, Table 6, trains a
constant λ_init = 0.8 to about the schedule's loss).

Initialization: W_Q, W_K, W_V, W_O by `model.init`'s query, key, value and attention_output
groups (default variance 1/fan_in); λ_q1, λ_k1, λ_q2, λ_k2 ∈ R^d each N(0, 0.1²) (the authors'
code), so λ ≈ λ_init at the start (they are ordinary parameters: weight decay pulls λ toward
λ_init); the norm gain 1 (width P, shared by the heads; ε = `model.norm.eps`). No biases
(`model.linear_bias` is MHA's).

KV cache: {"key", "value"}, B×S×K×P each (the rotated halves of a key side by side), a ring of
min(S_max, W) slots with a window, as MHA's (`arch.attention.write_cache`). Sequence
parallelism: keys and values are all-gathered, as MHA's (no ring attention). The probes read
the differential map A₁ − λ·A₂ as the head's attention weights.

Cost: the projections of MHA with the same H, K, P; score FLOPs 6·H·P per visible key (two QKᵀ
maps of width d, and each map's AV over P, computed by `arch.attention.attend` so that every
attention kernel serves), 1.5× MHA's 4·H·P.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from arch.attention import (
    ATTENTION,
    AttentionWeights,
    SoftmaxAttention,
    attend,
    cache_slots,
    causal_mask,
    mean_visible_keys,
    write_cache,
)
from arch.init import group_init
from arch.layers import Dense, param
from arch.norms import RMSNorm
from arch.residual import is_capturing, record
from config.defaults import execution_config
from sharding.rules import constrain
from sharding.sequence import sequence_shards

LAMBDA_INIT = 0.8  # λ_init of every layer (module docstring)
HEADS = ("act_batch", "act_seq", "act_heads", None)
KV_HEADS = ("act_batch", "act_seq", "act_kv_heads", None)


def rotate_halves(x_BxTxNxP: jax.Array, positions_BxT: jax.Array, rotate) -> jax.Array:
    """Each head's two halves of width P/2 rotated as heads of their own (`rotate`, the position
    module's hook), side by side again: B×T×N×P."""
    b, t, n, p = x_BxTxNxP.shape
    halves_BxTx2NxP2 = rotate(x_BxTxNxP.reshape(b, t, 2 * n, p // 2), positions_BxT)
    return halves_BxTx2NxP2.reshape(b, t, n, p)


def softmax_map(q_BxTxHxP, k_BxSxKxP, mask_BxTxS) -> jax.Array:
    """softmax(QKᵀ/√P + M) in float32, B×K×G×T×S (query head h = k·G + g)."""
    b, t, h, p = q_BxTxHxP.shape
    k = k_BxSxKxP.shape[2]
    q_BxTxKxGxP = q_BxTxHxP.reshape(b, t, k, h // k, p)
    scores = jnp.einsum("btkgp,bskp->bkgts", q_BxTxKxGxP, k_BxSxKxP,
                        preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(p))
    return jax.nn.softmax(scores + mask_BxTxS[:, None, None], axis=-1)


@ATTENTION.register("differential")
class DifferentialAttention(SoftmaxAttention):
    """Differential attention (module docstring): head_h = (1 − λ_init)·RMSNorm((A₁ − λA₂)V)."""

    def __init__(self, cfg, *, execution=None, rngs: nnx.Rngs):
        attention = cfg.attention
        d, h, k, p = cfg.d_model, attention.num_heads, attention.num_kv_heads, attention.head_dim
        dtype = jnp.dtype(cfg.dtype)
        self.query = Dense((d,), (h, p), ("embed",), ("heads", "head_dim"), rngs=rngs, dtype=dtype,
                           init=group_init(cfg, "query"))
        self.key = Dense((d,), (k, p), ("embed",), ("kv_heads", "head_dim"), rngs=rngs,
                         dtype=dtype, init=group_init(cfg, "key"))
        self.value = Dense((d,), (k, p), ("embed",), ("kv_heads", "head_dim"), rngs=rngs,
                           dtype=dtype, init=group_init(cfg, "value"))
        self.output = Dense((h, p), (d,), ("heads", "head_dim"), ("embed",), rngs=rngs,
                            dtype=dtype, init=group_init(cfg, "attention_output"))
        init = nnx.initializers.normal(stddev=0.1)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            param(rngs, init, (p // 2,), ("head_dim",)) for _ in range(4))
        self.norm = RMSNorm(p, eps=cfg.norm.eps, rngs=rngs)
        self.lambda_init = LAMBDA_INIT
        execution = execution or execution_config()
        self.implementation = execution.attention_implementation
        self.chunk = execution.attention_chunk
        self.window = attention.window

    @staticmethod
    def score_flops_per_token(cfg, seq_len: int) -> float:
        """Two causal QKᵀ maps of width P/2 (2·2·H·P/2) and each map's AV over P (2·2·H·P) per
        visible key: 6·H·P·`mean_visible_keys` (a window W bounds the keys by W)."""
        return (6 * cfg.attention.num_heads * cfg.attention.head_dim
                * mean_visible_keys(seq_len, cfg.attention.window))

    @staticmethod
    def cache_shapes(cfg, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        shape = (batch, cache_slots(cfg, length), cfg.attention.num_kv_heads,
                 cfg.attention.head_dim)
        return {"key": shape, "value": shape}

    def differential_weight(self) -> jax.Array:
        """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, a float32 scalar."""
        return (jnp.exp(jnp.dot(self.lambda_q1[...], self.lambda_k1[...]))
                - jnp.exp(jnp.dot(self.lambda_q2[...], self.lambda_k2[...])) + self.lambda_init)

    def __call__(self, x_BxTxD, positions_BxT, rotate, cache=None):
        q = constrain(rotate_halves(self.query(x_BxTxD), positions_BxT, rotate), HEADS)
        k = constrain(rotate_halves(self.key(x_BxTxD), positions_BxT, rotate), KV_HEADS)
        v = constrain(self.value(x_BxTxD), KV_HEADS)
        key_positions_BxS = positions_BxT
        if cache is not None:
            attended, key_positions_BxS, cache = write_cache(
                cache, {"key": k, "value": v}, positions_BxT, self.window)
            k, v = attended["key"].astype(q.dtype), attended["value"].astype(q.dtype)
        gathered = ("act_batch", None, "act_kv_heads", None)  # all of the sequence on every shard
        k, v = constrain(k, gathered), constrain(v, gathered)
        (q1, q2), (k1, k2) = jnp.split(q, 2, axis=-1), jnp.split(k, 2, axis=-1)
        lam = self.differential_weight()
        if is_capturing(self):  # the probes: the differential map, B×K×G×T×S
            mask = causal_mask(positions_BxT, key_positions_BxS, self.window)
            record(self, "attention_weights",
                   softmax_map(q1, k1, mask) - lam * softmax_map(q2, k2, mask), AttentionWeights)
        in_order = cache is None and sequence_shards() == 1
        o1, o2 = (attend(q_i, k_i, v, positions_BxT, key_positions_BxS,
                         implementation=self.implementation, chunk=self.chunk,
                         window=self.window, in_order=in_order)
                  for q_i, k_i in ((q1, k1), (q2, k2)))
        o_BxTxHxP = o1.astype(jnp.float32) - lam * o2.astype(jnp.float32)
        heads_BxTxHxP = (1 - self.lambda_init) * self.norm(o_BxTxHxP)
        return self.output(constrain(heads_BxTxHxP.astype(x_BxTxD.dtype), HEADS)), cache
