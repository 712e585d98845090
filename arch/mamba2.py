"""Mamba-2 (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality", ICML 2024, arXiv 2405.21060): the state-space token
mixer of its SSD layer, registered as `ATTENTION["mamba2"]` (the attention interface:
`layer(x_BxTxD, positions_BxT, rotate, cache) -> (y_BxTxD, cache)`), "M" in
`model.layer_pattern`.

Shapes: B batch, T positions, D = d_model, H heads (`mamba2.num_heads`), P head width
(`mamba2.head_dim`), N state size (`mamba2.state_dim`), W the convolution width
(`mamba2.conv_width`), C the chunk length (`mamba2.chunk`).

The SSD recurrence (§3, a scalar-times-identity A per head; one group: B and C shared by the
heads), per head, state h ∈ R^{P×N} (h₀ = 0):

    h_t = exp(a_t) h_{t−1} + x_t b_tᵀ,    y_t = h_t c_t                                 (eq. 1)

with a_t = Δ_t·A ≤ 0 the log-decay and x_t the input already scaled by Δ_t. Unrolled, it is the
quadratic ("attention") form y = (L ∘ C Bᵀ) X with the 1-semiseparable mask
L_ij = exp(a_{j+1} + … + a_i) for j ≤ i, 0 above (§3–4). Training runs the chunked SSD
algorithm (`ssd_chunked`, §6): the quadratic form within chunks of C tokens, the recurrence
between chunks; decoding one token runs the recurrence itself (`ssd_recurrence`).
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
HEADS = ("ssm_heads", "head_dim")  # parameter axes of an H×P tensor (`config.catalogue` record)


def _compute_dtype(x: jax.Array):
    """float32, or float64 for float64 inputs (the tests' exact-arithmetic references)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def ssd_recurrence(x_BxTxHxP, a_BxTxH, b_BxTxN, c_BxTxN,
                   state_BxHxPxN=None) -> tuple[jax.Array, jax.Array]:
    """The SSD recurrence token by token (a `lax.scan` over T):
    h_t = exp(a_t) h_{t−1} + x_t b_tᵀ, y_t = h_t c_t. Returns (y B×T×H×P, final h B×H×P×N).
    Cost: 4·P·N FLOPs per token and head; what decoding runs."""
    dtype = _compute_dtype(x_BxTxHxP)
    b, _, h, p = x_BxTxHxP.shape
    n = b_BxTxN.shape[-1]
    if state_BxHxPxN is None:
        state_BxHxPxN = jnp.zeros((b, h, p, n), dtype)

    def step(state, inputs):
        x, a, b_t, c_t = inputs
        state = (jnp.exp(a)[..., None, None] * state
                 + x[..., None] * b_t[:, None, None, :])
        return state, jnp.einsum("bhpn,bn->bhp", state, c_t)

    time_major = lambda x: jnp.moveaxis(x.astype(dtype), 1, 0)
    state, y_TxBxHxP = jax.lax.scan(
        step, state_BxHxPxN.astype(dtype),
        tuple(map(time_major, (x_BxTxHxP, a_BxTxH, b_BxTxN, c_BxTxN))))
    return jnp.moveaxis(y_TxBxHxP, 0, 1), state


def ssd_chunked(x_BxTxHxP, a_BxTxH, b_BxTxN, c_BxTxN, state_BxHxPxN=None,
                chunk: int = 64) -> tuple[jax.Array, jax.Array]:
    """The SSD recurrence by chunks (Dao & Gu 2024, §6), equal to `ssd_recurrence`.

    In a chunk of C tokens entered with state S, with cumulative log-decays γ_i = Σ_{j≤i} a_j:

        Y = (L ∘ C Bᵀ) X + diag(exp γ) C Sᵀ,      L_ij = exp(γ_i − γ_j) for j ≤ i, 0 above,
        S' = exp(γ_C) S + Xᵀ diag(exp(γ_C − γ)) B                 (the chunk's state, P×N)

    The diagonal blocks (L ∘ C Bᵀ) X and each chunk's own state are computed for every chunk
    at once; only the states pass between chunks, by a `lax.scan` over the chunks with no
    matrix product in it. T not a multiple of C is padded with x = b = c = 0 and a = 0, which
    leave the state unchanged. Float32 (float64 for float64 inputs). Returns (y B×T×H×P,
    final state B×H×P×N). Cost per token: 2·C·N + H·(2·C·P + 4·P·N) FLOPs
    (`chunked_flops_per_token`)."""
    dtype = _compute_dtype(x_BxTxHxP)
    b, t, h, p = x_BxTxHxP.shape
    n = b_BxTxN.shape[-1]
    c = min(chunk, t)
    chunks = -(-t // c)
    pad = chunks * c - t

    def chunked(x):  # B×T×… → B×Z×C×…, zero-padded to Z·C positions
        x = jnp.pad(x.astype(dtype), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(b, chunks, c, *x.shape[2:])

    x, a, b_in, c_in = map(chunked, (x_BxTxHxP, a_BxTxH, b_BxTxN, c_BxTxN))
    gamma = jnp.cumsum(a, axis=2)                                          # B×Z×C×H
    on_or_below = jnp.tril(jnp.ones((c, c), bool))[..., None]              # C(i)×C(j)×1
    segment = gamma[:, :, :, None, :] - gamma[:, :, None, :, :]            # γ_i − γ_j
    mask = jnp.where(on_or_below, jnp.exp(jnp.where(on_or_below, segment, 0.0)), 0.0)
    scores = jnp.einsum("bzin,bzjn->bzij", c_in, b_in)                     # C Bᵀ, B×Z×C×C
    y_diagonal = jnp.einsum("bzijh,bzjhp->bzihp", scores[..., None] * mask, x)
    to_end = jnp.exp(gamma[:, :, -1:] - gamma)                             # exp(γ_C − γ_j)
    chunk_states = jnp.einsum("bzjhp,bzjn->bzhpn", x * to_end[..., None], b_in)
    chunk_decay = jnp.exp(gamma[:, :, -1])                                 # B×Z×H

    def step(state_BxHxPxN, inputs):  # the state entering each chunk
        decay, own = inputs
        return decay[..., None, None] * state_BxHxPxN + own, state_BxHxPxN

    if state_BxHxPxN is None:
        state_BxHxPxN = jnp.zeros((b, h, p, n), dtype)
    state, entering_ZxBxHxPxN = jax.lax.scan(
        step, state_BxHxPxN.astype(dtype),
        (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(chunk_states, 1, 0)))
    y_off = jnp.einsum("zbhpn,bzin->bzihp", entering_ZxBxHxPxN, c_in)
    y = y_diagonal + jnp.exp(gamma)[..., None] * y_off                     # B×Z×C×H×P
    return y.reshape(b, chunks * c, h, p)[:, :t], state


def chunked_flops_per_token(heads: int, head_dim: int, state_dim: int, chunk: int) -> float:
    """Matmul FLOPs per token of `ssd_chunked` with chunks of C: C Bᵀ (2·C·N, shared by the
    heads, the full C×C counted), and per head (L ∘ C Bᵀ) X (2·C·P), the chunk states and the
    states' read-out (2·P·N each). Elementwise work (decays, masks, the chunk scan) is not
    counted."""
    return 2 * chunk * state_dim + heads * (2 * chunk * head_dim + 4 * head_dim * state_dim)


def _log_rate_init(key, shape, dtype=jnp.float32):
    """log A with A ~ U[1, 16] (Mamba-2's `A_init_range`)."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _time_step_bias_init(key, shape, dtype=jnp.float32):
    """softplus⁻¹(Δ) with Δ log-uniform in [0.001, 0.1], floored at 1e-4 (Mamba-2)."""
    dt = jnp.exp(jax.random.uniform(key, shape, dtype, math.log(1e-3), math.log(1e-1)))
    dt = jnp.maximum(dt, 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))


class CausalConvolution(nnx.Module):
    """Causal depthwise convolution over time with a bias, then SiLU:
    y_t = SiLU(Σ_i w_i ⊙ x_{t−W+1+i} + b), per channel, over the zero (or cached) history.
    Kernel and bias U(−1/√W, 1/√W) (PyTorch's Conv1d with groups = channels)."""

    def __init__(self, width: int, channels: tuple[int, ...], axes: tuple, *, rngs: nnx.Rngs):
        bound = 1 / math.sqrt(width)
        uniform = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
        self.kernel = param(rngs, uniform, (width, *channels), (None, *axes))
        self.bias = param(rngs, uniform, channels, axes)

    def __call__(self, x_BxTx_, tail_BxSx_=None):
        """(SiLU(conv(x) + b), the last W − 1 inputs, the next call's history)."""
        width, t = self.kernel.shape[0], x_BxTx_.shape[1]
        if tail_BxSx_ is None:
            history = jnp.pad(x_BxTx_, [(0, 0), (width - 1, 0)] + [(0, 0)] * (x_BxTx_.ndim - 2))
        else:
            history = jnp.concatenate([tail_BxSx_.astype(x_BxTx_.dtype), x_BxTx_], 1)
        kernel = self.kernel[...].astype(x_BxTx_.dtype)
        y = sum(history[:, i:i + t] * kernel[i] for i in range(width))
        y = y + self.bias[...].astype(x_BxTx_.dtype)
        return jax.nn.silu(y), history[:, history.shape[1] - (width - 1):]


@ATTENTION.register("mamba2")
class Mamba2(TokenMixer):
    """Mamba-2 token mixer (Dao & Gu 2024, §7.1 and Fig. 6, the parallel Mamba-2 block; one
    group of B, C shared by the heads; the state-spaces/mamba `Mamba2` layer's structure):

        x, z = x_in W_X, x_in W_Z                         d → H×P each
        b, c = x_in W_B, x_in W_C                         d → N each
        x, b, c = SiLU(conv_W(x)), SiLU(conv_W(b)), SiLU(conv_W(c))   (depthwise, with bias)
        Δ = softplus(x_in W_Δ + b_Δ),  A = −exp(log A)    d → H; one scalar A per head
        y = SSD(Δ ⊙ x, Δ·A, b, c) + D ⊙ x                 (module docstring; D a per-head skip)
        out = RMSNorm(y ⊙ SiLU(z)) · W_O                  gated norm over the H×P features, H×P → d

    Initialization: W_X, W_Z by `model.init`'s value group, W_B, W_Δ by key, W_C by query, W_O
    by attention_output; the convolutions' kernels and biases U(−1/√W, 1/√W); log A with
    A ~ U[1, 16]; b_Δ = softplus⁻¹(Δ), Δ log-uniform in [1e-3, 1e-1]; D = 1; the norm gain 1
    (Mamba-2's defaults). log A and D are `MixingParam`s (no weight decay, the reference code's
    `_no_weight_decay`), b_Δ and the convolution biases are `bias`es.

    Cache (constant in the sequence length): {"state": B×H×P×N float32, "x_conv": B×(W−1)×H×P,
    "b_conv"/"c_conv": B×(W−1)×N}. A block of T > 1 tokens (prefill) runs the chunked form from
    the cached state, a single token the recurrence. No RoPE: positions and `rotate` are unused;
    the recurrence reads the array order (so no sequence parallelism).

    Cost per token, constant in T: the projections 2·D·(2HP + 2N + H) + 2·H·P·D FLOPs, the
    convolutions 2·W·(HP + 2N), and `chunked_flops_per_token` (training, prefill) or
    H·4·P·N (decoding).
    """

    float32_cache = ("state",)  # cache entries kept in float32 whatever the compute dtype

    def __init__(self, cfg, *, execution=None, rngs: nnx.Rngs):
        del execution  # no attention kernel to choose
        m = cfg.mamba2
        d, h, p, n, width = cfg.d_model, m.num_heads, m.head_dim, m.state_dim, m.conv_width
        dtype = jnp.dtype(cfg.dtype)

        def dense(out_shape, out_axes, group, use_bias=False):
            return Dense((d,), out_shape, ("embed",), out_axes, rngs=rngs, dtype=dtype,
                         use_bias=use_bias, init=group_init(cfg, group))

        self.x_proj = dense((h, p), HEADS, "value")
        self.z_proj = dense((h, p), HEADS, "value")
        self.b_proj = dense((n,), ("ssm_state",), "key")
        self.c_proj = dense((n,), ("ssm_state",), "query")
        self.dt_proj = dense((h,), ("ssm_heads",), "key", use_bias=True)
        self.dt_proj.bias[...] = _time_step_bias_init(rngs.params(), (h,))  # b_Δ
        self.log_rate = param(rngs, _log_rate_init, (h,), ("ssm_heads",), MixingParam)  # log A
        self.skip = param(rngs, nnx.initializers.ones, (h,), ("ssm_heads",), MixingParam)  # D
        self.x_conv = CausalConvolution(width, (h, p), HEADS, rngs=rngs)
        self.b_conv = CausalConvolution(width, (n,), ("ssm_state",), rngs=rngs)
        self.c_conv = CausalConvolution(width, (n,), ("ssm_state",), rngs=rngs)
        self.norm_scale = param(rngs, nnx.initializers.ones, (h, p), HEADS)
        self.output = Dense((h, p), (d,), HEADS, ("embed",), rngs=rngs, dtype=dtype,
                            init=group_init(cfg, "attention_output"))
        self.eps, self.chunk = cfg.norm.eps, m.chunk

    @staticmethod
    def score_flops_per_token(cfg, seq_len: int) -> float:
        """Forward FLOPs per token beyond the projections: the chunked SSD
        (`chunked_flops_per_token` with C = min(chunk, T)) and the depthwise convolutions
        (2·W per channel, H·P + 2N channels). Decoding's recurrence costs H·4·P·N instead."""
        m = cfg.mamba2
        chunk = min(m.chunk, seq_len)
        return (chunked_flops_per_token(m.num_heads, m.head_dim, m.state_dim, chunk)
                + 2 * m.conv_width * (m.num_heads * m.head_dim + 2 * m.state_dim))

    @staticmethod
    def cache_shapes(cfg, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        """Constant in `length`: the state and the convolutions' last W − 1 inputs."""
        m = cfg.mamba2
        h, p, n, tail = m.num_heads, m.head_dim, m.state_dim, m.conv_width - 1
        return {"state": (batch, h, p, n), "x_conv": (batch, tail, h, p),
                "b_conv": (batch, tail, n), "c_conv": (batch, tail, n)}

    def __call__(self, x_BxTxD, positions_BxT, rotate, cache=None):
        del positions_BxT, rotate  # no RoPE; the recurrence reads the array order
        tails = {} if cache is None else cache
        x, x_tail = self.x_conv(constrain(self.x_proj(x_BxTxD), HEAD_AXES), tails.get("x_conv"))
        b, b_tail = self.b_conv(self.b_proj(x_BxTxD), tails.get("b_conv"))
        c, c_tail = self.c_conv(self.c_proj(x_BxTxD), tails.get("c_conv"))
        x = x.astype(jnp.float32)
        dt_BxTxH = jax.nn.softplus(self.dt_proj(x_BxTxD).astype(jnp.float32))
        a_BxTxH = -jnp.exp(self.log_rate[...]) * dt_BxTxH
        inputs = (x * dt_BxTxH[..., None], a_BxTxH, b.astype(jnp.float32), c.astype(jnp.float32))
        state = None if cache is None else cache["state"]
        if cache is not None and x_BxTxD.shape[1] == 1:  # decoding: the recurrence itself
            y, state = ssd_recurrence(*inputs, state)
        else:
            y, state = ssd_chunked(*inputs, state, self.chunk)
        if cache is not None:
            cache = {"state": state.astype(cache["state"].dtype),
                     "x_conv": x_tail.astype(cache["x_conv"].dtype),
                     "b_conv": b_tail.astype(cache["b_conv"].dtype),
                     "c_conv": c_tail.astype(cache["c_conv"].dtype)}
        y = y + self.skip[...][:, None] * x
        gated = y * jax.nn.silu(self.z_proj(x_BxTxD).astype(jnp.float32))
        gated = gated * jax.lax.rsqrt(jnp.mean(gated**2, axis=(-2, -1), keepdims=True) + self.eps)
        gated = constrain((gated * self.norm_scale[...]).astype(x_BxTxD.dtype), HEAD_AXES)
        return self.output(gated), cache
