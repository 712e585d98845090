"""Attention kernels: the functions that turn queries, keys and values into attention outputs.

`arch/attention.py` builds q, k, v and calls `attend` there, which picks one of:

- `xla`: explicit scores, softmax(QKᵀ·scale + M)V with the B×H×T×S matrix in memory
  (`arch.attention.dot_product_attention`).
- `blocked` (`blocked_attention`, here): exact attention as an online softmax over key/value
  chunks, with a hand-written backward pass that recomputes each chunk's probabilities from the
  saved log-sum-exp. Never holds more than one chunk × chunk tile of scores per (batch, head).
- `cudnn` (`cudnn_attention`): `jax.nn.dot_product_attention(..., implementation="cudnn")`,
  NVIDIA GPUs only.
- `splash` (`splash_attention`): the Pallas TPU splash-attention kernel that ships with JAX
  (`jax.experimental.pallas.ops.tpu.splash_attention`), TPUs only.
- `auto`: `choose_implementation`'s rule for the backend and shape.

Shapes as in `arch/attention.py`: B batch, T queries, S keys, H = K·G query heads over K
key/value heads, P query/key width, V value width. Masks are defined by positions, never by the
array index: query t sees key s iff pos_s ≤ pos_t (and pos_t − pos_s < W with a window W > 0).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# `auto` off GPU/TPU kernels: `blocked` once queries and keys both reach this length, `xla`
# below (decoding, T = 1, stays explicit). Chosen by measurement on CPU with 128-position tiles:
# docs/performance.md, "Attention implementations".
BLOCKED_FROM_LENGTH = 512


def allowed_mask(query_positions_BxT: jax.Array, key_positions_BxS: jax.Array,
                 window: int = 0) -> jax.Array:
    """Boolean B×T×S: key s is visible to query t iff pos_s ≤ pos_t and, with window W > 0,
    pos_t − pos_s < W (the W most recent positions, the query's own included)."""
    query_BxTx1 = query_positions_BxT[:, :, None]
    key_Bx1xS = key_positions_BxS[:, None, :]
    allowed = key_Bx1xS <= query_BxTx1
    if window:
        allowed &= query_BxTx1 - key_Bx1xS < window
    return allowed


# ---------------------------------------------------------------------------------------------
# blocked: online softmax over key/value chunks, FlashAttention-style backward pass


def _tiles(x_BxTx_, count: int, size: int, fill) -> jax.Array:
    """Pad axis 1 to count·size with `fill` and split it into tiles: count×B×size×…"""
    pad = count * size - x_BxTx_.shape[1]
    if pad:
        widths = [(0, 0)] * x_BxTx_.ndim
        widths[1] = (0, pad)
        x_BxTx_ = jnp.pad(x_BxTx_, widths, constant_values=fill)
    x = x_BxTx_.reshape(x_BxTx_.shape[0], count, size, *x_BxTx_.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _untile(x_NxBxCx_, length: int) -> jax.Array:
    """Inverse of `_tiles`: N×B×C×… → B×length×… (padding dropped)."""
    x = jnp.moveaxis(x_NxBxCx_, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _tile_scores(q_BxCxKxGxP, k_BxCxKxP, allowed_BxCxC, scale):
    """Scaled float32 scores B×K×G×Cq×Ck of one tile, −∞ where masked."""
    scores = jnp.einsum("bqkgp,bskp->bkgqs", q_BxCxKxGxP, k_BxCxKxP,
                        preferred_element_type=jnp.float32) * jnp.float32(scale)
    return jnp.where(allowed_BxCxC[:, None, None], scores, -jnp.inf)


def _forward_tiles(q_tiles, k_tiles, v_tiles, query_pos_tiles, key_pos_tiles, scale, window):
    """Outputs N×B×Cq×K×G×V (float32) and log-sum-exp N×B×K×G×Cq of every query tile.

    For query tile i, scanning key tiles j: m' = max(m, rowmax S_ij), p = e^{S_ij − m'},
    l' = e^{m−m'} l + rowsum p, o' = e^{m−m'} o + p V_j; out = o / l, lse = m + log l.
    A tile whose every (query, key) pair is masked is skipped (`lax.cond`)."""
    value_dtype = v_tiles.dtype

    def query_tile(xs):
        q, query_pos = xs
        b, c, k, g, _ = q.shape

        def key_tile(carry, kv):
            key, value, key_pos = kv
            allowed = allowed_mask(query_pos, key_pos, window)

            def fold(carry):
                running_max, normalizer, output = carry
                scores = _tile_scores(q, key, allowed, scale)
                new_max = jnp.maximum(running_max, scores.max(-1))
                finite_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
                weights = jnp.exp(scores - finite_max[..., None])
                keep = jnp.exp(running_max - finite_max)
                output = output * keep[..., None] + jnp.einsum(
                    "bkgqs,bskv->bkgqv", weights.astype(value_dtype), value,
                    preferred_element_type=jnp.float32)
                return new_max, normalizer * keep + weights.sum(-1), output

            return jax.lax.cond(allowed.any(), fold, lambda carry: carry, carry), None

        start = (jnp.full((b, k, g, c), -jnp.inf, jnp.float32),
                 jnp.zeros((b, k, g, c), jnp.float32),
                 jnp.zeros((b, k, g, c, v_tiles.shape[-1]), jnp.float32))
        (running_max, normalizer, output), _ = jax.lax.scan(
            key_tile, start, (k_tiles, v_tiles, key_pos_tiles))
        seen = normalizer > 0  # a query with no visible key (padding) gets output 0, lse 0
        safe = jnp.where(seen, normalizer, 1.0)
        lse = jnp.where(seen, running_max + jnp.log(safe), 0.0)
        output = jnp.einsum("bkgqv->bqkgv", output / safe[..., None])
        return output, lse

    return jax.lax.map(query_tile, (q_tiles, query_pos_tiles))


def _backward_tiles(q_tiles, k_tiles, v_tiles, query_pos_tiles, key_pos_tiles, lse_tiles,
                    dout_tiles, delta_tiles, scale, window):
    """Gradients (dq N×B×Cq×K×G×P, dk, dv M×B×Ck×K×·) in float32, FlashAttention-2's backward
    pass (Dao 2023, Alg. 2): per tile P = e^{S − lse}, dV_j += Pᵀ dO_i, dP = dO_i V_jᵀ,
    dS = P ∘ (dP − δ_i) with δ = rowsum(dO ∘ O), dQ_i += dS K_j·scale, dK_j += dSᵀ Q_i·scale.
    The outer scan runs over key tiles; dQ's per-tile contributions are summed into its carry."""

    def key_tile(dq_sum, kv):
        key, value, key_pos = kv

        def query_tile(carry, xs):
            q, query_pos, lse, dout, delta = xs
            allowed = allowed_mask(query_pos, key_pos, window)

            def gradients(carry):
                dk, dv = carry
                scores = _tile_scores(q, key, allowed, scale)
                probs = jnp.exp(scores - lse[..., None])
                dv = dv + jnp.einsum("bkgqs,bqkgv->bskv", probs.astype(dout.dtype), dout,
                                     preferred_element_type=jnp.float32)
                dprobs = jnp.einsum("bqkgv,bskv->bkgqs", dout, value,
                                    preferred_element_type=jnp.float32)
                dscores = (probs * (dprobs - delta[..., None]) * jnp.float32(scale))
                dq = jnp.einsum("bkgqs,bskp->bqkgp", dscores.astype(key.dtype), key,
                                preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum("bkgqs,bqkgp->bskp", dscores.astype(q.dtype), q,
                                     preferred_element_type=jnp.float32)
                return (dk, dv), dq

            def skip(carry):
                return carry, jnp.zeros(q.shape, jnp.float32)

            return jax.lax.cond(allowed.any(), gradients, skip, carry)

        start = (jnp.zeros(key.shape, jnp.float32), jnp.zeros(value.shape, jnp.float32))
        (dk, dv), dq_tiles = jax.lax.scan(
            query_tile, start, (q_tiles, query_pos_tiles, lse_tiles, dout_tiles, delta_tiles))
        return dq_sum + dq_tiles, (dk, dv)

    dq_sum, (dk_tiles, dv_tiles) = jax.lax.scan(
        key_tile, jnp.zeros(q_tiles.shape, jnp.float32), (k_tiles, v_tiles, key_pos_tiles))
    return dq_sum, dk_tiles, dv_tiles


def _layout(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS, chunk):
    """Query and key tiles; padded queries see no key (position −1), padded keys are seen by no
    query (the position dtype's maximum)."""
    b, t, h, p = q_BxTxHxP.shape
    s, k = k_BxSxKxP.shape[1], k_BxSxKxP.shape[2]
    query_chunk, key_chunk = min(chunk, t), min(chunk, s)
    n, m = -(-t // query_chunk), -(-s // key_chunk)
    q = _tiles(q_BxTxHxP.reshape(b, t, k, h // k, p), n, query_chunk, 0)
    key_max = jnp.iinfo(key_positions_BxS.dtype).max
    return (q, _tiles(k_BxSxKxP, m, key_chunk, 0), _tiles(v_BxSxKxV, m, key_chunk, 0),
            _tiles(query_positions_BxT, n, query_chunk, -1),
            _tiles(key_positions_BxS, m, key_chunk, key_max))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _blocked(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS,
             scale, chunk, window):
    return _blocked_forward(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT,
                            key_positions_BxS, scale, chunk, window)[0]


def _blocked_forward(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS,
                     scale, chunk, window):
    b, t, h, _ = q_BxTxHxP.shape
    # Differentiated inside a scan (the layer stack), this forward pass is traced inline and the
    # scan's partial evaluation would hoist its position-only parts (every tile's mask) out of
    # the loop as residuals stacked over all tile pairs: O(T²) memory. The barrier makes the
    # positions depend on the queries, so nothing of the tile loops is loop-invariant.
    barrier = jax.lax.optimization_barrier((q_BxTxHxP, query_positions_BxT, key_positions_BxS))
    _, query_positions_BxT, key_positions_BxS = barrier
    tiles = _layout(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS,
                    chunk)
    out_tiles, lse_tiles = _forward_tiles(*tiles, scale, window)
    out_BxTxHxV = _untile(out_tiles, t).reshape(b, t, h, -1).astype(v_BxSxKxV.dtype)
    residuals = (q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS,
                 out_BxTxHxV, lse_tiles)
    return out_BxTxHxV, residuals


def _blocked_fwd(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS,
                 scale, chunk, window):
    return _blocked_forward(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT,
                            key_positions_BxS, scale, chunk, window)


def _blocked_bwd(scale, chunk, window, residuals, dout_BxTxHxV):
    q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS, out, lse = residuals
    b, t, h, p = q_BxTxHxP.shape
    s, k = k_BxSxKxP.shape[1], k_BxSxKxP.shape[2]
    tiles = _layout(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS,
                    chunk)
    query_chunk = tiles[0].shape[2]
    n = tiles[0].shape[0]
    delta_BxTxKxG = jnp.sum(dout_BxTxHxV.astype(jnp.float32) * out.astype(jnp.float32), -1
                            ).reshape(b, t, k, h // k)
    delta_tiles = jnp.einsum("nbqkg->nbkgq", _tiles(delta_BxTxKxG, n, query_chunk, 0))
    dout_tiles = _tiles(dout_BxTxHxV.reshape(b, t, k, h // k, -1).astype(v_BxSxKxV.dtype), n,
                        query_chunk, 0)
    dq, dk, dv = _backward_tiles(*tiles, lse, dout_tiles, delta_tiles, scale, window)
    return (_untile(dq, t).reshape(b, t, h, p).astype(q_BxTxHxP.dtype),
            _untile(dk, s).astype(k_BxSxKxP.dtype), _untile(dv, s).astype(v_BxSxKxV.dtype),
            None, None)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def blocked_attention(q_BxTxHxP: jax.Array, k_BxSxKxP: jax.Array, v_BxSxKxV: jax.Array,
                      query_positions_BxT: jax.Array, key_positions_BxS: jax.Array, *,
                      scale: float | None = None, chunk: int = 128, window: int = 0) -> jax.Array:
    """Exact attention softmax(QKᵀ·scale + M)V (B×T×H×V) without the T×S score matrix.

    Queries and keys are cut into tiles of `chunk` positions. For each query tile the key tiles
    are folded into an online softmax (Milakov & Gimelshein 2018; Rabe & Staats 2021,
    "Self-attention does not need O(n²) memory"): running max m, normalizer l and unnormalized
    output o, out = o / l. The forward pass saves only the log-sum-exp lse = m + log l per query
    (B×H×T); the backward pass (custom VJP) recomputes each tile's probabilities e^{S − lse}, as
    FlashAttention does (Dao et al. 2022; the loop order of FlashAttention-2, Dao 2023).
    A tile in which every (query, key) pair is masked (keys after every query under the causal
    mask, or beyond the window) is skipped by `lax.cond`, whatever the positions' order.

    The H query heads are grouped over the K key/value heads (head h = k·G + g) as in
    `arch.attention.dot_product_attention`. `scale` defaults to 1/√P. Scores, softmax statistics
    and accumulators are float32; the products run in the inputs' dtype. A query that sees no
    key gets output 0 (the explicit path gives NaN).

    Cost: the explicit path's FLOPs for unskipped tiles plus one more QKᵀ in the backward pass;
    memory O(B·H·T·(P + V)) plus one B×H×chunk×chunk tile, against O(B·H·T·S) explicit.
    """
    scale = q_BxTxHxP.shape[-1] ** -0.5 if scale is None else float(scale)
    return _blocked(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS,
                    scale, int(chunk), int(window))


# ---------------------------------------------------------------------------------------------
# accelerator kernels, used as they ship


def cudnn_attention(q_BxTxHxP: jax.Array, k_BxSxKxP: jax.Array, v_BxSxKxV: jax.Array,
                    query_positions_BxT: jax.Array, key_positions_BxS: jax.Array, *,
                    scale: float | None = None, window: int = 0,
                    in_order: bool = False) -> jax.Array:
    """cuDNN's fused attention through `jax.nn.dot_product_attention(implementation="cudnn")`
    (FlashAttention-style, Dao et al. 2022; NVIDIA GPUs, bfloat16/float16 inputs).

    `in_order` (query i and key i both at position i: training without a KV cache or sequence
    shards) uses cuDNN's own causal mask (and sliding window); otherwise the position mask is
    passed as a B×1×T×S boolean (decoding: T is 1). GQA is native (K key/value heads).
    Cost: the explicit path's FLOPs, O(T) memory per head when `in_order`."""
    if in_order:
        return jax.nn.dot_product_attention(
            q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, scale=scale, is_causal=True,
            local_window_size=(window - 1, 0) if window else None, implementation="cudnn")
    mask_Bx1xTxS = allowed_mask(query_positions_BxT, key_positions_BxS, window)[:, None]
    return jax.nn.dot_product_attention(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, mask=mask_Bx1xTxS,
                                        scale=scale, implementation="cudnn")


def splash_attention(q_BxTxHxP: jax.Array, k_BxSxKxP: jax.Array, v_BxSxKxV: jax.Array, *,
                     scale: float | None = None, window: int = 0, block: int = 128,
                     interpret: bool = False) -> jax.Array:
    """TPU splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`, the Pallas
    kernels that ship with JAX; block-sparse FlashAttention that skips masked blocks).

    Causal (or local, with a window) in array order: query i and key i at position i, T = S,
    T a multiple of 128. The G query heads of each key/value head run as one MQA call (vmapped
    over batch and the K key/value heads), so MHA, GQA and MQA share one path. `interpret`
    runs the kernel in the Pallas interpreter (slow; for checks off TPU).
    Cost: the explicit path's FLOPs for unmasked blocks, O(T) memory per head."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash  # TPU-only module

    b, t, h, p = q_BxTxHxP.shape
    k = k_BxSxKxP.shape[2]
    scale = p ** -0.5 if scale is None else scale
    head_mask = (splash.LocalMask((t, t), (window - 1, 0), 0) if window
                 else splash.CausalMask((t, t)))
    size = min(block, t)
    blocks = splash.BlockSizes(block_q=size, block_kv=size, block_kv_compute=size,
                               block_q_dkv=size, block_kv_dkv=size, block_kv_dkv_compute=size,
                               block_q_dq=size, block_kv_dq=size)
    kernel = splash.make_splash_mqa_single_device(
        splash.MultiHeadMask([head_mask] * (h // k)), block_sizes=blocks, interpret=interpret)
    q_BxKxGxTxP = jnp.einsum("btkgp->bkgtp", (q_BxTxHxP * scale).reshape(b, t, k, h // k, p))
    k_BxKxSxP, v_BxKxSxV = jnp.swapaxes(k_BxSxKxP, 1, 2), jnp.swapaxes(v_BxSxKxV, 1, 2)
    out_BxKxGxTxV = jax.vmap(jax.vmap(kernel))(q_BxKxGxTxP, k_BxKxSxP, v_BxKxSxV)
    return jnp.einsum("bkgtv->btkgv", out_BxKxGxTxV).reshape(b, t, h, -1)


def choose_implementation(implementation: str, *, backend: str, query_len: int, key_len: int,
                          dtype, key_width: int, value_width: int, in_order: bool) -> str:
    """The kernel `attend` runs for `execution.attention_implementation` on `backend`.

    `auto`: on GPU, cuDNN for bfloat16/float16 with equal key and value widths P ≤ 128, P a
    multiple of 8 (its fused kernel's limits); on TPU, splash for in-order attention with T a
    multiple of 128 and equal widths; otherwise (CPU, or shapes those kernels do not take)
    `blocked` when queries and keys both number at least `BLOCKED_FROM_LENGTH`, else `xla`
    (measured on CPU; see docs/performance.md). `cudnn` and `splash` named explicitly raise a
    ValueError off their backend; `splash` on attention not in order (a KV cache, sequence
    shards) runs `blocked`.
    """
    long = min(query_len, key_len) >= BLOCKED_FROM_LENGTH
    portable = "blocked" if long else "xla"
    equal_widths = key_width == value_width
    if implementation == "auto":
        if (backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and equal_widths
                and key_width % 8 == 0 and key_width <= 128):
            return "cudnn"
        if backend == "tpu" and in_order and query_len % 128 == 0 and equal_widths:
            return "splash"
        return portable
    if implementation == "cudnn" and backend != "gpu":
        raise ValueError(f"execution.attention_implementation='cudnn' needs an NVIDIA GPU; the "
                         f"backend is {backend!r} (use 'auto', 'blocked' or 'xla')")
    if implementation == "splash":
        if backend != "tpu":
            raise ValueError("execution.attention_implementation='splash' needs a TPU; the "
                             f"backend is {backend!r} (use 'auto', 'blocked' or 'xla')")
        if not (in_order and query_len % 128 == 0 and equal_widths):
            return "blocked"
    return implementation
