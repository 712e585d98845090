"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", ICLR 2025): a linear-attention token mixer with a constant-size state per head,
registered as `ATTENTION["gated_deltanet"]` (the attention interface:
`layer(x_BxTxD, positions_BxT, rotate, cache) -> (y_BxTxD, cache)`).

Shapes: B batch, T positions, D = d_model, H heads (`deltanet.num_heads`), K key/query width
(`deltanet.head_dim`), V value width (`deltanet.value_dim`), W the short-convolution width
(`deltanet.conv_width`), C the chunk length (`deltanet.chunk`), N = ⌈T/C⌉ chunks.

The gated delta rule, per head, state S ∈ R^{V×K} (S₀ = 0):

    S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,    o_t = S_t q_t          (paper eq. 10)

with α_t = exp(g_t) ∈ (0, 1] and β_t ∈ (0, 1) per token and head. Training runs the chunkwise
parallel form (`gated_delta_chunked`, paper §3.3 with the WY/UT representation of §2.2); decoding
one token runs the recurrence itself (`gated_delta_recurrence`), on the state kept in the cache.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from arch.attention import ATTENTION, TokenMixer
from arch.init import group_init
from arch.layers import Dense, param
from arch.residual import MixingParam
from sharding.rules import constrain

HEAD_AXES = ("act_batch", None, "act_heads", None)  # B×T×H×P activations: heads over `tensor`


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(Σ x² + ε) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x**2, axis=-1, keepdims=True) + eps)


def gated_delta_recurrence(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH,
                           state_BxHxVxK=None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule token by token (a `lax.scan` over T), in float32:
    S ← exp(g_t)·S;  S ← S + β_t (v_t − S k_t) k_tᵀ;  o_t = S q_t. That is
    S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ. Returns (o B×T×H×V, final S B×H×V×K).
    Cost: 6·K·V FLOPs per token and head; what decoding runs."""
    b, _, h, p_k = q_BxTxHxK.shape
    p_v = v_BxTxHxV.shape[-1]
    if state_BxHxVxK is None:
        state_BxHxVxK = jnp.zeros((b, h, p_v, p_k), jnp.float32)

    def step(state, inputs):
        q, k, v, g, beta = inputs
        state = jnp.exp(g)[..., None, None] * state
        error_BxHxV = v - jnp.einsum("bhvk,bhk->bhv", state, k)
        state = state + (beta[..., None] * error_BxHxV)[..., None] * k[..., None, :]
        return state, jnp.einsum("bhvk,bhk->bhv", state, q)

    f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)  # time-major
    state, o_TxBxHxV = jax.lax.scan(
        step, state_BxHxVxK.astype(jnp.float32),
        tuple(map(f32, (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH))))
    return jnp.moveaxis(o_TxBxHxV, 0, 1), state


def gated_delta_chunked(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH,
                        state_BxHxVxK=None, chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule in its chunkwise-parallel form, equal to `gated_delta_recurrence`.

    Within a chunk of C tokens starting from state S₀, with cumulative log-decays γ_i = Σ_{j≤i} g_j
    and Γ_i = exp(γ_i), the recurrence unrolls to S_i = Γ_i S₀ + Σ_{j≤i} (Γ_i/Γ_j) u_j k_jᵀ, whose
    "pseudo-values" u_i = β_i (v_i − α_i S_{i−1} k_i) solve a unit lower-triangular system
    (the UT transform, the WY representation of the product of Householder-like factors):

        (I + A) U = diag(β) V − diag(β Γ) K S₀ᵀ,   A_ij = β_i (k_i·k_j) Γ_i/Γ_j  for j < i,
        so U = U' − W S₀ᵀ with U' = (I + A)⁻¹ diag(β) V and W = (I + A)⁻¹ diag(β Γ) K,
        O = diag(Γ) Q S₀ᵀ + (Q Kᵀ ⊙ Λ) U,   Λ_ij = Γ_i/Γ_j for j ≤ i, 0 above,
        S_C = Γ_C S₀ + Uᵀ diag(Γ_C/Γ) K.

    U', W and Q Kᵀ ⊙ Λ of every chunk are built at once (the triangular solve is forward
    substitution, `lax.linalg.triangular_solve`); only the state S₀ → S_C passes between chunks,
    by a `lax.scan` over the N chunks. T not a multiple of C is padded with tokens of β = 0 and
    g = 0, which leave the state unchanged. Float32 throughout. Returns (o B×T×H×V, final S).
    Cost per token and head: ≈ 2C(2K + V) + C(K + V) + 6KV FLOPs (`chunked_flops_per_token`)."""
    b, t, h, p_k = q_BxTxHxK.shape
    p_v = v_BxTxHxV.shape[-1]
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t

    def chunked(x):  # B×T×H×… → B×H×N×C×…, zero-padded to N·C positions
        x = x.astype(jnp.float32)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, h, *x.shape[3:])
        return jnp.moveaxis(x, 3, 1)

    q, k, v, g, beta = map(chunked, (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH))
    gamma = jnp.cumsum(g, axis=-1)                                        # B×H×N×C
    on_or_below = jnp.tril(jnp.ones((c, c), bool))
    below = jnp.tril(jnp.ones((c, c), bool), -1)
    log_ratio = gamma[..., :, None] - gamma[..., None, :]                 # γ_i − γ_j
    ratio = jnp.where(on_or_below, jnp.exp(jnp.where(on_or_below, log_ratio, 0.0)), 0.0)
    a = jnp.where(below, beta[..., :, None] * jnp.einsum("...ik,...jk->...ij", k, k) * ratio, 0.0)
    unit_lower = a + jnp.eye(c, dtype=jnp.float32)

    def solve(rhs):  # (I + A)⁻¹ rhs by forward substitution
        return jax.lax.linalg.triangular_solve(unit_lower, rhs, left_side=True, lower=True,
                                               unit_diagonal=True)

    u_prime = solve(beta[..., None] * v)                                  # B×H×N×C×V
    w = solve((beta * jnp.exp(gamma))[..., None] * k)                     # B×H×N×C×K
    scores = jnp.einsum("...ik,...jk->...ij", q, k) * ratio               # (Q Kᵀ) ⊙ Λ
    q_decayed = jnp.exp(gamma)[..., None] * q                             # diag(Γ) Q
    last = gamma[..., -1]                                                 # γ_C, B×H×N
    k_to_end = jnp.exp(last[..., None] - gamma)[..., None] * k            # diag(Γ_C/Γ) K

    def step(state_BxHxVxK, xs):
        u_prime, w, scores, q_decayed, k_to_end, last = xs
        u = u_prime - jnp.einsum("bhck,bhvk->bhcv", w, state_BxHxVxK)
        o = (jnp.einsum("bhck,bhvk->bhcv", q_decayed, state_BxHxVxK)
             + jnp.einsum("bhij,bhjv->bhiv", scores, u))
        state_BxHxVxK = (jnp.exp(last)[..., None, None] * state_BxHxVxK
                         + jnp.einsum("bhcv,bhck->bhvk", u, k_to_end))
        return state_BxHxVxK, o

    if state_BxHxVxK is None:
        state_BxHxVxK = jnp.zeros((b, h, p_v, p_k), jnp.float32)
    chunk_major = lambda x: jnp.moveaxis(x, 2, 0)  # B×H×N×… → N×B×H×…
    state, o_NxBxHxCxV = jax.lax.scan(
        step, state_BxHxVxK.astype(jnp.float32),
        tuple(map(chunk_major, (u_prime, w, scores, q_decayed, k_to_end, last))))
    o_BxTxHxV = jnp.moveaxis(o_NxBxHxCxV, 2, 3).transpose(1, 0, 2, 3, 4)   # B×N×C×H×V
    return o_BxTxHxV.reshape(b, n * c, h, p_v)[:, :t], state


def chunked_flops_per_token(key_width: int, value_width: int, chunk: int) -> float:
    """Forward matmul FLOPs per token and head of `gated_delta_chunked` with chunks of C:
    K Kᵀ and Q Kᵀ (2·C·K each, the full C×C counted), the two forward substitutions
    (≈ C·K and C·V), (Q Kᵀ ⊙ Λ) U (2·C·V), and W S₀ᵀ, Q S₀ᵀ, Uᵀ K (2·K·V each). Elementwise
    work (decays, masks) is not counted."""
    c, p_k, p_v = chunk, key_width, value_width
    return 4 * c * p_k + c * (p_k + p_v) + 2 * c * p_v + 6 * p_k * p_v


def _log_rate_init(key, shape, dtype=jnp.float32):
    """log A with A ~ U[1, 16] (Mamba2's initialization, kept by Gated DeltaNet)."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _time_step_bias_init(key, shape, dtype=jnp.float32):
    """softplus⁻¹(Δ) with Δ log-uniform in [0.001, 0.1], floored at 1e-4 (Mamba2)."""
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, math.log(1e-3), math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))


@ATTENTION.register("gated_deltanet")
class GatedDeltaNet(TokenMixer):
    """Gated DeltaNet token mixer (Yang, Kautz & Hatamizadeh 2024, §3 and Fig. 1; the block of the
    authors' NVlabs/GatedDeltaNet code and of flash-linear-attention's `GatedDeltaNet`):

        q, k, v = SiLU(conv_W(x W_Q)), SiLU(conv_W(x W_K)), SiLU(conv_W(x W_V))   d → H×K, H×V
        q, k = q/‖q‖₂ · K^{-1/2}, k/‖k‖₂                  (per head; the 1/√K is the kernels' scale)
        g = −exp(log A) · softplus(x W_α + b_Δ)           d → H   (Mamba2-style decay, α = e^g)
        β = sigmoid(x W_β)                                d → H
        o = gated delta rule(q, k, v, g, β)               (module docstring)
        y = [RMSNorm(o_h) ⊙ SiLU(x W_G)_h]_h · W_O        d → H×V, H×V → d

    conv_W is a causal depthwise convolution of width W (`deltanet.conv_width`, default 4) over the
    time axis, per channel, without bias. The output RMSNorm normalizes each head's V features
    with one gain of width V shared by the heads (flash-linear-attention's FusedRMSNormGated).

    Simplifications, stated: one head count for queries, keys and values (no grouped value heads
    as in Qwen3-Next); no RoPE (GDN layers ignore `rotate` and the positions: the recurrence is
    ordered by the array, so the input must be in position order, which is why sequence
    parallelism, which stripes the sequence, is refused for it).

    Initialization: W_Q, W_K, W_V, W_G, W_α, W_β by `model.init`'s query, key, value, value, key
    and key groups; W_O by attention_output; conv kernels U(−1/√W, 1/√W) (PyTorch's Conv1d);
    log A with A ~ U[1, 16] and b_Δ = softplus⁻¹(Δ), Δ log-uniform in [1e-3, 1e-1] (Mamba2);
    the norm gain 1. log A is a `MixingParam` (no weight decay, as in the reference code's
    `_no_weight_decay`), b_Δ is a `bias` (no decay by name).

    Cache ("KV cache" of this layer, constant in the sequence length): {"state": B×H×V×K
    float32, "query_conv"/"key_conv": B×(W−1)×H×K, "value_conv": B×(W−1)×H×V} (the last W − 1
    projected inputs of each convolution). A block of T > 1 tokens (prefill) runs the chunked
    form from the cached state; a single token runs the recurrence. The cache assumes each call
    continues the positions of the previous one.

    Cost per token, constant in T: the projections 2·D·H·(2K + 2V + 2) + 2·H·V·D FLOPs, plus per
    head `chunked_flops_per_token` (training, prefill) or 6·K·V (decoding).
    """

    float32_cache = ("state",)  # cache entries kept in float32 whatever the compute dtype

    def __init__(self, cfg, *, execution=None, rngs: nnx.Rngs):
        del execution  # no attention kernel to choose
        dn = cfg.deltanet
        d, h, p_k, p_v, width = cfg.d_model, dn.num_heads, dn.head_dim, dn.value_dim, dn.conv_width
        dtype = jnp.dtype(cfg.dtype)
        heads = ("heads", "head_dim")

        def dense(out_shape, out_axes, group, use_bias=False):
            return Dense((d,), out_shape, ("embed",), out_axes, rngs=rngs, dtype=dtype,
                         use_bias=use_bias, init=group_init(cfg, group))

        self.query = dense((h, p_k), heads, "query")
        self.key = dense((h, p_k), heads, "key")
        self.value = dense((h, p_v), heads, "value")
        self.gate = dense((h, p_v), heads, "value")
        self.beta = dense((h,), ("heads",), "key")
        self.decay = dense((h,), ("heads",), "key", use_bias=True)
        self.decay.bias[...] = _time_step_bias_init(rngs.params(), (h,))  # b_Δ
        self.log_rate = param(rngs, _log_rate_init, (h,), ("heads",), MixingParam)  # log A
        conv_init = nnx.initializers.uniform(2 / math.sqrt(width))
        shift = lambda init: (lambda key, shape, dtype: init(key, shape, dtype)
                              - 1 / math.sqrt(width))
        self.query_conv = param(rngs, shift(conv_init), (width, h, p_k), (None, *heads))
        self.key_conv = param(rngs, shift(conv_init), (width, h, p_k), (None, *heads))
        self.value_conv = param(rngs, shift(conv_init), (width, h, p_v), (None, *heads))
        self.norm_scale = param(rngs, nnx.initializers.ones, (p_v,), ("norm",))
        self.output = Dense((h, p_v), (d,), heads, ("embed",), rngs=rngs, dtype=dtype,
                            init=group_init(cfg, "attention_output"))
        self.eps, self.chunk, self.key_width = cfg.norm.eps, dn.chunk, p_k

    @staticmethod
    def score_flops_per_token(cfg, seq_len: int) -> float:
        """Forward FLOPs per token beyond the projections: the chunked gated delta rule
        (`chunked_flops_per_token` with C = min(chunk, T)) and the three depthwise convolutions
        (2·W per channel), over H heads. Decoding's recurrence costs 6·K·V per head instead."""
        dn = cfg.deltanet
        chunk = min(dn.chunk, seq_len)
        per_head = (chunked_flops_per_token(dn.head_dim, dn.value_dim, chunk)
                    + 2 * dn.conv_width * (2 * dn.head_dim + dn.value_dim))
        return dn.num_heads * per_head

    @staticmethod
    def cache_shapes(cfg, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        """Constant in `length`: the recurrent state and the convolutions' last W − 1 inputs."""
        dn = cfg.deltanet
        h, p_k, p_v, tail = dn.num_heads, dn.head_dim, dn.value_dim, dn.conv_width - 1
        return {"state": (batch, h, p_v, p_k), "query_conv": (batch, tail, h, p_k),
                "key_conv": (batch, tail, h, p_k), "value_conv": (batch, tail, h, p_v)}

    def _convolve(self, x_BxTxHxP, kernel_WxHxP, tail_BxSxHxP):
        """Causal depthwise convolution y_t = Σ_i w_i x_{t−W+1+i} over the zero (or cached)
        history; returns (SiLU(y), the last W − 1 inputs)."""
        width, t = kernel_WxHxP.shape[0], x_BxTxHxP.shape[1]
        if tail_BxSxHxP is None:
            history = jnp.pad(x_BxTxHxP, [(0, 0), (width - 1, 0), (0, 0), (0, 0)])
        else:
            history = jnp.concatenate([tail_BxSxHxP.astype(x_BxTxHxP.dtype), x_BxTxHxP], 1)
        kernel = kernel_WxHxP.astype(x_BxTxHxP.dtype)
        y = sum(history[:, i:i + t] * kernel[i] for i in range(width))
        return jax.nn.silu(y), history[:, history.shape[1] - (width - 1):]

    def __call__(self, x_BxTxD, positions_BxT, rotate, cache=None):
        del positions_BxT, rotate  # no RoPE; the recurrence reads the array order
        tails = {} if cache is None else cache
        q, q_tail = self._convolve(constrain(self.query(x_BxTxD), HEAD_AXES), self.query_conv[...],
                                   tails.get("query_conv"))
        k, k_tail = self._convolve(constrain(self.key(x_BxTxD), HEAD_AXES), self.key_conv[...],
                                   tails.get("key_conv"))
        v, v_tail = self._convolve(constrain(self.value(x_BxTxD), HEAD_AXES), self.value_conv[...],
                                   tails.get("value_conv"))
        q = l2_normalize(q) * self.key_width**-0.5
        k = l2_normalize(k)
        g_BxTxH = (-jnp.exp(self.log_rate[...])
                   * jax.nn.softplus(self.decay(x_BxTxD).astype(jnp.float32)))
        beta_BxTxH = jax.nn.sigmoid(self.beta(x_BxTxD).astype(jnp.float32))
        state = None if cache is None else cache["state"]
        if cache is not None and x_BxTxD.shape[1] == 1:  # decoding: the recurrence itself
            o, state = gated_delta_recurrence(q, k, v, g_BxTxH, beta_BxTxH, state)
        else:
            o, state = gated_delta_chunked(q, k, v, g_BxTxH, beta_BxTxH, state, self.chunk)
        if cache is not None:
            cache = {"state": state.astype(cache["state"].dtype),
                     "query_conv": q_tail.astype(cache["query_conv"].dtype),
                     "key_conv": k_tail.astype(cache["key_conv"].dtype),
                     "value_conv": v_tail.astype(cache["value_conv"].dtype)}
        o = o * jax.lax.rsqrt(jnp.mean(o**2, axis=-1, keepdims=True) + self.eps)
        o = constrain((o * self.norm_scale[...]).astype(x_BxTxD.dtype), HEAD_AXES)
        return self.output(o * jax.nn.silu(self.gate(x_BxTxD))), cache
