"""Attention Residuals (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031): each sublayer
reads a learned attention mixture over depth instead of the unit-weight residual sum.

Full AttnRes (paper §3, "Full Attention Residuals"), registered as "attnres". The sources of
sublayer l (0-based, attention and FFN sublayers counted separately, n = 2L of them, L with
`model.use_ffn=False`) are the token embedding v₀ = x⁰ and every earlier sublayer output
v_j = F_j(h_j), j < l. With a pseudo-query w_l ∈ R^d per sublayer,

    α_{j→l} = softmax_j( w_l · k̂_j ),   k̂_j = v_j / sqrt(mean(v_j²) + ε),    (scores in float32)
    h_l = norm_l( Σ_j α_{j→l} v_j ),     the sublayer input (a Pre-Norm on the mixed read),

and a final read with its own pseudo-query w_n feeds the model's final norm. The keys are RMS-
normalized without a gain on purpose: w · (g ⊙ k̂) = (w ⊙ g) · k̂, so a key gain is redundant with
the query. Initialization: every w = 0, so the weights start uniform over the available sources
(1/(l+1)), not at the ordinary unit-weight sum (the norm that follows removes the scale anyway).

Block AttnRes (paper §3, "Block Attention Residuals"), registered as "block_attnres": the n
sublayers form N = ⌈n/S⌉ blocks of S = `model.attnres.block_size` consecutive sublayers. The
outputs of a block are summed, b_m = Σ_{j ∈ block m} v_j; sublayer l of block m = ⌊l/S⌋ attends
over the embedding, the completed summaries b_0 … b_{m−1} and, unless it is the block's first
sublayer, the partial sum of block m's earlier outputs. Boundary rules: a read happens before its
own output is added; a summary becomes a source once, when its block completes; an output is in
exactly one source; an empty partial sum is never a source. S = 1 is Full AttnRes exactly; S ≥ n
(N = 1) keeps the embedding beside one running sum.

Storage: one buffer of 1 + N source slots, kept token-major as B×T×((N+1)·D) (slot j is
features j·D … (j+1)·D − 1; a 3-D leaf, so `constrain_state` shards it like the stream, and each
token's sources are contiguous, which keeps the depth contractions free of transposes on CPU):
the embedding in slot 0 and block m's sum in slot m + 1. A block's slot holds its partial sum
while the block runs and its summary once complete, so a write touches one slot (in place) and
slot j ≥ 1 is a source of sublayer l iff it holds at least one output, (j − 1)·S < l, i.e.
j ≤ ⌈l/S⌉. Beside each slot its 1/rms (per head, B×T×((N+1)·H), float32), computed once when the
slot is written, so no read recomputes a norm. Training therefore costs O(N) per read (no O(L²)
work for Block AttnRes), O(n) for Full. The one-head softmax read has a hand-written gradient
(`softmax_read`); writes pass the buffer's cotangent through untouched.

Cost and memory: the buffer adds (N + 1)·D values and (N + 1)·H float32 inverse norms per token
(N = n for Full AttnRes, so O(n·D) per token); a naive read is O(N·D) per token, a two-phase read
(below) O(D) after its block's phase 1, O(S·N·D). Residual I/O per sublayer and history:
`arch.accounting.residual_accounting`. In training, a read in an opened block is rematerialized
(`_merged_read`): the backward pass recomputes the merge and the norm after it from c and p,
which are saved anyway, instead of saving the merged read and the norm's arrays. Phase 1 computes
its S reads as one reduction over the slot axis (`_phase_one_forward`). Each scan unit's outputs
(KV cache, layer states; parameter cotangents in the backward pass) are written in place into
the scan's unit-major buffers. Measured: docs/performance.md#block-attnres.

Variants (config fields):
- `attnres.query="input"`: w_l + c·W_l k̂_cur, with W_l ∈ R^{d×d} zero-initialized, the
  "current state" k̂_cur the most recent source (slot ⌈l/S⌉: the previous sublayer's output for
  Full AttnRes, the current partial sum or the last summary for Block), normalized like a key,
  and c = `attnres.query_scale` (default 1). Under Adam a step changes each entry of W_l and of
  w_l by about the learning rate, so with c = 1 the scores' input-dependent part can move up to d
  times as far per step as the static part (a rank-one step of W_l meets k̂_cur and k̂_j, whose
  entries are of order 1, in d² products; a step of w_l meets k̂_j in d); c = 1/d equalizes them.
- `attnres.heads=H`: d split into H chunks of d/H features; each chunk has its own query chunk,
  per-chunk key normalization and its own softmax over the sources.
- `attnres.weights="sigmoid"`: α_j = σ(w_l · k̂_j), unnormalized over the sources.
- `attnres.weights="static"`: input-independent learned weights α_{j→l} (per head), DenseFormer
  style (Pagliardini et al. 2024, "DenseFormer", §3, depth-weighted averages). Initialized to 1 on
  every available source, DenseFormer's principle of starting exactly at the standard residual
  model: with all-one weights h_l = norm(x⁰ + Σ_{j<l} v_j) is the Pre-Norm sum.
- `attnres.key_norm=False`: raw sources as keys.
- `attnres.window=W > 0`: only the W most recent sources (slots ⌈l/S⌉ − W + 1 … ⌈l/S⌉).

Two-phase schedule (paper, "Two-phase computation"), in training and with a KV cache: the
pseudo-queries do not depend on the input, so when a block starts (`AttnResStream.open`), its S
queries are batched against the completed sources once (phase 1: per query and head the
log-sum-exp of the scores, lse, and the normalized read c over those sources), and each read of
the block then merges its one partial-sum source p, with score s, into that result (phase 2, the
online-softmax merge as a two-way softmax: σ(lse − s)·c + σ(s − lse)·p), O(d) per read instead
of O(N·d); both phases have hand-written gradients, and the partial sum is kept apart and written
to its slot when the block ends (`close`). Equal to the naive read to float rounding. The scan
over blocks (`AttnResStream.scan`) has a hand-written gradient as well: completed slots never
change, so its forward pass saves no copy of the buffer per step, and its backward pass reads
phase 1's sources from the final buffer (`_block_scan`). The schedule applies to softmax
weights with static queries and no window, when blocks are whole layers (S a multiple of the
sublayers per scan unit and n a multiple of S: `units_per_block`), so that the layer scan steps
one block at a time with static boundaries (its S/2 layers unrolled in the step: compile time
grows with S, not with depth at a fixed S); the other variants and layouts keep the naive read.

Pipeline parallelism (the report's cached stage transfer; `sharding/pipeline.py`): a stage that
receives the buffer last held it P − 1 chunks (lag sublayers) earlier and keeps that copy, so it
is sent only the slots written since, ⌈(lag − 1)/S⌉ + 1 of them with their 1/rms and the counter
(`stage_message`), and writes them over its copy (`stage_merge`); `execution.pipeline.transfer=
"full"` sends the whole buffer.

Recorded (`arch.residual.record`): "depth_weights", the weights over the N + 1 slots (zero on
unavailable slots) averaged over batch, tokens and heads, one row per read (stacked over layers
for the sublayer reads; the final read from the stream module). Under `nnx.capture` the model
scans unit by unit with naive reads (autodiff path), which record them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arch.layers import Dense, param
from arch.norms import make_norm
from arch.residual import (
    RESIDUALS,
    MixingParam,
    ResidualIO,
    ResidualMechanism,
    ResidualStream,
    ResidualTraffic,
    constrain_state,
    is_capturing,
    record,
    sublayers_per_block,
)
from config.derived import sublayer_count


@dataclasses.dataclass(frozen=True)
class DepthLayout:
    """The static shape of an AttnRes stack: how many sublayers, blocks, heads and which variant."""

    sublayers: int       # n: 2L, or L without FFNs
    block_size: int      # S sublayers per block (1: Full AttnRes)
    heads: int           # H depth-attention heads
    weights: str         # softmax | sigmoid | static
    query: str           # static | input
    query_scale: float   # c in w_l + c·W_l k̂_cur (query="input")
    key_norm: bool
    window: int          # 0: every source
    eps: float

    @property
    def slots(self) -> int:
        """1 + N: the embedding and one slot per block."""
        return 1 + math.ceil(self.sublayers / self.block_size)

    @property
    def normalizes_keys(self) -> bool:
        return self.key_norm and self.weights != "static"

    @property
    def two_phase(self) -> bool:
        """Whether decoding uses the two-phase schedule (input-independent softmax scores)."""
        return self.weights == "softmax" and self.query == "static" and self.window == 0


def _split_heads(x: jax.Array, heads: int) -> jax.Array:
    """…×D → …×H×(D/H)."""
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def _contraction_view(x: jax.Array, heads: int) -> jax.Array:
    """The operand `_contract` expects: heads split, or unchanged for one head (no head axis)."""
    return x if heads == 1 else _split_heads(x, heads)


def _head_sums(x: jax.Array, heads: int) -> jax.Array:
    """Sums over each head's d/H features: …×D → …×H. One head keeps the array's rank (XLA:CPU's
    library reductions are an order of magnitude slower with a size-1 axis before the last)."""
    if heads == 1:
        return x.sum(axis=-1, keepdims=True)
    return _split_heads(x, heads).sum(axis=-1)


def _per_feature(x_HEADS: jax.Array, width: int) -> jax.Array:
    """A per-head value on each of the head's features: …×H → …×D (one head: broadcastable)."""
    heads = x_HEADS.shape[-1]
    return x_HEADS if heads == 1 else jnp.repeat(x_HEADS, width // heads, axis=-1)


def inverse_rms(x: jax.Array, heads: int, eps: float) -> jax.Array:
    """1 / sqrt(mean(x²) + ε) per head chunk of d/H features: …×D → …×H, float32."""
    x = x.astype(jnp.float32)
    return jax.lax.rsqrt(_head_sums(x * x, heads) * (heads / x.shape[-1]) + eps)


def depth_scores(query, sources_BxTxNxD, inverse_rms_BxTxNxH, heads: int) -> jax.Array:
    """Scores w · k̂_j of one query (D, or B×T×D for an input-dependent query) against every
    source, B×T×N×H float32; keys are the sources scaled by their 1/rms (None: raw keys)."""
    if heads == 1:  # no head axis in the contraction: XLA:CPU would transpose the sources
        equation = "btnd,d->btn" if query.ndim == 1 else "btnd,btd->btn"
        scores = jnp.einsum(equation, sources_BxTxNxD.astype(jnp.float32),
                            query.astype(jnp.float32))[..., None]
    else:
        values = _split_heads(sources_BxTxNxD.astype(jnp.float32), heads)
        query = _split_heads(query.astype(jnp.float32), heads)
        equation = "btnhk,hk->btnh" if query.ndim == 2 else "btnhk,bthk->btnh"
        scores = jnp.einsum(equation, values, query)
    return scores if inverse_rms_BxTxNxH is None else scores * inverse_rms_BxTxNxH


def depth_weights(scores_BxTxNxH, valid_N, kind: str) -> jax.Array:
    """Mixing weights over sources from scores: softmax over the valid sources, or an elementwise
    sigmoid; invalid sources get weight 0."""
    mask = valid_N[:, None]
    if kind == "softmax":
        return jax.nn.softmax(jnp.where(mask, scores_BxTxNxH, -jnp.inf), axis=2)
    return jnp.where(mask, jax.nn.sigmoid(scores_BxTxNxH), 0.0)


def mix_sources(weights, sources_BxTxNxD, heads: int) -> jax.Array:
    """Σ_j α_j v_j per head, float32 B×T×D; weights B×T×N×H, or N×H (input-independent)."""
    if heads == 1:
        equation = "n,btnd->btd" if weights.ndim == 2 else "btn,btnd->btd"
        return jnp.einsum(equation, weights[..., 0], sources_BxTxNxD.astype(jnp.float32))
    values = _split_heads(sources_BxTxNxD.astype(jnp.float32), heads)
    equation = "nh,btnhk->bthk" if weights.ndim == 2 else "btnh,btnhk->bthk"
    mixed = jnp.einsum(equation, weights, values)
    return mixed.reshape(*mixed.shape[:-2], -1)


def depth_read(query, sources_BxTxNxD, inverse_rms_BxTxNxH, valid_N, heads: int,
               kind: str = "softmax") -> tuple[jax.Array, jax.Array]:
    """The naive read: (Σ_j α_j v_j as float32 B×T×D, weights B×T×N×H)."""
    weights = depth_weights(depth_scores(query, sources_BxTxNxD, inverse_rms_BxTxNxH, heads),
                            valid_N, kind)
    return mix_sources(weights, sources_BxTxNxD, heads), weights


@jax.custom_vjp
def softmax_read(query, sources_BxTxNxD, inverse_rms_BxTxN, valid_N) -> jax.Array:
    """`depth_read` for one head with softmax weights (query D, or B×T×D), float32 B×T×D, with a
    hand-written gradient: one saved copy of the sources per read and no head axis in the
    contractions (autodiff saves them once per contraction, XLA:CPU transposes them)."""
    return _softmax_read_forward(query, sources_BxTxNxD, inverse_rms_BxTxN, valid_N)[0]


def _softmax_read_forward(query, sources_BxTxNxD, inverse_rms_BxTxN, valid_N):
    values = sources_BxTxNxD.astype(jnp.float32)
    query = query.astype(jnp.float32)
    raw = jnp.einsum("btnd,d->btn" if query.ndim == 1 else "btnd,btd->btn", values, query)
    weights = jax.nn.softmax(jnp.where(valid_N, raw * inverse_rms_BxTxN, -jnp.inf), axis=-1)
    mixed = jnp.einsum("btn,btnd->btd", weights, values)
    return mixed, (query, sources_BxTxNxD, inverse_rms_BxTxN, weights, raw)


def _softmax_read_backward(residuals, mixed_cotangent_BxTxD):
    query, sources, inverse, weights, raw = residuals
    values = sources.astype(jnp.float32)
    weight_cotangent = jnp.einsum("btd,btnd->btn", mixed_cotangent_BxTxD, values)
    score_cotangent = weights * (weight_cotangent
                                 - jnp.sum(weights * weight_cotangent, -1, keepdims=True))
    raw_cotangent = score_cotangent * inverse
    query_cotangent = jnp.einsum("btn,btnd->d" if query.ndim == 1 else "btn,btnd->btd",
                                 raw_cotangent, values)
    query_term = query if query.ndim == 1 else query[:, :, None]
    source_cotangent = (weights[..., None] * mixed_cotangent_BxTxD[:, :, None]
                        + raw_cotangent[..., None] * query_term)
    return (query_cotangent, source_cotangent.astype(sources.dtype), score_cotangent * raw,
            None)


softmax_read.defvjp(_softmax_read_forward, _softmax_read_backward)


def _contract(spec: str, heads: int, *operands) -> jax.Array:
    """`jnp.einsum(spec)`, with the head axis `h` dropped from the spec for one head (operands then
    have no head axis: XLA:CPU would transpose around a size-1 axis)."""
    return jnp.einsum(spec.replace("h", "") if heads == 1 else spec, *operands)


def phase_one(queries_SxD, sources_BxTxNxD, inverse_rms_BxTxNxH, valid_N, heads: int):
    """Phase 1 of two-phase AttnRes: the S queries of a block against the completed sources at
    once. Returns, per query and head, the log-sum-exp of the scores, lse = log Σ_j e^{s_j}
    (B×T×S×H), and a tuple of S normalized reads over these sources, Σ_j e^{s_j − lse} v_j
    (B×T×D each), float32."""
    return phase_one_on_views(queries_SxD, contraction_views(
        sources_BxTxNxD, inverse_rms_BxTxNxH, heads), valid_N, heads)


def contraction_views(sources_BxTxNxD, inverse_rms_BxTxNxH, heads: int) -> tuple:
    """What phase 1 contracts: the sources with their heads split and their 1/rms (ones for raw
    keys), without head axes for one head."""
    if inverse_rms_BxTxNxH is None:
        inverse_rms_BxTxNxH = jnp.ones(sources_BxTxNxD.shape[:3] + (heads,), jnp.float32)
    inverse = inverse_rms_BxTxNxH[..., 0] if heads == 1 else inverse_rms_BxTxNxH
    return _contraction_view(sources_BxTxNxD, heads), inverse


def phase_one_on_views(queries_SxD, views: tuple, valid_N, heads: int):
    """`phase_one` on `contraction_views`."""
    lse, reads = _phase_one(_contraction_view(queries_SxD.astype(jnp.float32), heads), *views,
                            valid_N, heads)
    if heads == 1:
        return lse[..., None], reads
    return lse, tuple(read.reshape(*read.shape[:-2], -1) for read in reads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _phase_one(queries_SxHxK, sources_BxTxNxHxK, inverse_BxTxNxH, valid_N, heads):
    """`phase_one` on split heads (no head axes for one head), with a hand-written gradient: the
    scores keep the sources' layout (one GEMM against the S queries), the backward pass reads
    the sources twice, with no transposed copy, and saves none of the reads (dc · c is
    Σ_j α_j (dc · v_j)): each merge keeps its own."""
    return _phase_one_forward(queries_SxHxK, sources_BxTxNxHxK, inverse_BxTxNxH, valid_N,
                              heads)[0]


def _phase_one_forward(queries, sources, inverse, valid_N, heads):
    values = sources.astype(jnp.float32)
    raw = _contract("btnhk,shk->btnsh", heads, values, queries)  # B×T×N×S(×H)
    mask = valid_N.reshape(-1, *(1,) * (raw.ndim - 3))
    scores = jnp.where(mask, raw * jnp.expand_dims(inverse, 3), -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=2)
    weights = jnp.exp(scores - lse[:, :, None])
    # The S reads as one reduction over the slot axis. As an einsum, XLA:CPU runs thousands of
    # tiny matrix products (3× slower); as an unrolled elementwise sum, it fused the sum into
    # each consumer (every read recomputed from the whole buffer, which it then copied twice per
    # block to keep for them: the train step ~1% slower).
    reads = (weights[..., None] * jnp.expand_dims(values, 3)).sum(axis=2)  # B×T×S(×H)×K
    return ((lse, tuple(reads[:, :, s] for s in range(queries.shape[0]))),
            (queries, sources, inverse, raw, weights))


def _phase_one_backward(heads, residuals, cotangents):
    """With α_j = e^{s_j − lse} and c = Σ_j α_j v_j: ∂lse/∂s_j = α_j, ∂c/∂s_j = α_j (v_j − c)."""
    queries, sources, inverse, raw, weights = residuals
    lse_cotangent, read_cotangents = cotangents
    values = sources.astype(jnp.float32)
    read_cotangent = jnp.stack(read_cotangents, axis=2)  # B×T×S(×H)×K
    along_values = _contract("btshk,btnhk->btnsh", heads, read_cotangent, values)  # dc · v_j
    along_read = (weights * along_values).sum(axis=2, keepdims=True)  # dc · c
    score_cotangent = weights * (along_values - along_read + lse_cotangent[:, :, None])
    raw_cotangent = score_cotangent * jnp.expand_dims(inverse, 3)
    source_cotangent = (_contract("btnsh,btshk->btnhk", heads, weights, read_cotangent)
                        + _contract("btnsh,shk->btnhk", heads, raw_cotangent, queries))
    if heads == 1:  # one GEMM over the tokens and sources (the einsum transposes the sources)
        queries_cotangent = (raw_cotangent.reshape(-1, queries.shape[0]).T
                             @ values.reshape(-1, values.shape[-1]))
    else:
        queries_cotangent = _contract("btnsh,btnhk->shk", heads, raw_cotangent, values)
    return (queries_cotangent, source_cotangent.astype(sources.dtype),
            (score_cotangent * raw).sum(axis=3), None)


_phase_one.defvjp(_phase_one_forward, _phase_one_backward)


def merge_partial(query_D, lse_BxTxH, read_BxTxD, partial_BxTxD, heads: int,
                  eps: float | None) -> jax.Array:
    """Phase 2: merge one more source, the block's partial sum p (None: no source yet), into a
    phase-1 result (lse, c). With its score s = w · p̂ (p̂ = p·rms(p)⁻¹ per head, computed here;
    eps None: raw key p̂ = p), the read over all sources is the two-way softmax
        σ(lse − s) · c + σ(s − lse) · p,    float32,
    with a hand-written gradient that keeps only c and p (autodiff saves four D-wide arrays)."""
    if partial_BxTxD is None:
        return read_BxTxD
    return _merge(query_D, lse_BxTxH, read_BxTxD, partial_BxTxD, heads, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _merge(query, lse, read, partial, heads, eps):
    return _merge_forward(query, lse, read, partial, heads, eps)[0]


def _merge_forward(query, lse, read, partial, heads, eps):
    values = partial.astype(jnp.float32)
    raw = _head_sums(values * query.astype(jnp.float32), heads)
    inverse = None if eps is None else inverse_rms(values, heads, eps)
    weight = jax.nn.sigmoid(lse - (raw if inverse is None else raw * inverse))  # on c
    merged = values + _per_feature(weight, read.shape[-1]) * (read - values)
    return merged, (query, read, partial, raw, inverse, weight)


def _merge_backward(heads, eps, residuals, merged_cotangent):
    query, read, partial, raw, inverse, weight = residuals
    width, values = read.shape[-1], partial.astype(jnp.float32)
    per_feature = lambda x: _per_feature(x, width)  # noqa: E731
    # d merged / d weight = c − p; the weight is σ(lse − s).
    gate_cotangent = (_head_sums(merged_cotangent * (read - values), heads)
                      * weight * (1 - weight))
    raw_cotangent = -gate_cotangent if inverse is None else -gate_cotangent * inverse
    value_cotangent = (merged_cotangent * per_feature(1 - weight)
                       + per_feature(raw_cotangent) * query.astype(jnp.float32))
    if inverse is not None:  # ∂rms(p)⁻¹/∂p = −rms(p)⁻³ · p / (d/H)
        inverse_cotangent = -gate_cotangent * raw
        value_cotangent += per_feature(inverse_cotangent * inverse**3 * (heads / width)) * -values
    if heads == 1:  # a GEMV over the tokens (the einsum copies the values transposed)
        query_cotangent = raw_cotangent.reshape(1, -1) @ values.reshape(-1, width)
    else:
        query_cotangent = _contract("bthk,bth->hk", heads, _split_heads(values, heads),
                                    raw_cotangent)
    query_cotangent = query_cotangent.reshape(-1)
    return (query_cotangent.astype(query.dtype), gate_cotangent,
            merged_cotangent * per_feature(weight), value_cotangent.astype(partial.dtype))


_merge.defvjp(_merge_forward, _merge_backward)


def two_phase_reads(queries_SxD, sources_BxTxNxD, inverse_rms_BxTxNxH, valid_N,
                    partials_SxBxTxD, heads: int, eps: float) -> jax.Array:
    """The S reads of one block by the two-phase schedule, S×B×T×D float32: read i attends over
    the valid completed sources and, for i > 0, `partials[i]` (the sum of the block's first i
    outputs; `partials[0]` is ignored), with keys normalized when `inverse_rms` is given. Equal
    to `depth_read` over the same sources."""
    lse, reads = phase_one(queries_SxD, sources_BxTxNxD, inverse_rms_BxTxNxH, valid_N, heads)
    eps = None if inverse_rms_BxTxNxH is None else eps
    return jnp.stack([merge_partial(queries_SxD[i], lse[:, :, i], reads[i],
                                    partials_SxBxTxD[i] if i else None, heads, eps)
                      for i in range(queries_SxD.shape[0])])


# The state keeps every per-token array 3-D, B×T×(k·width) with k slots side by side, so that
# `constrain_state` shards it like the stream; these views split and index the slots.
def _unflatten(x_BxTxKW: jax.Array, width: int) -> jax.Array:
    return x_BxTxKW.reshape(*x_BxTxKW.shape[:2], -1, width)


def _slot(x_BxTxKW: jax.Array, index, width: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x_BxTxKW, index * width, width, axis=2)


def _set_slot(x_BxTxKW: jax.Array, value, index, width: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x_BxTxKW, value.astype(x_BxTxKW.dtype),
                                               index * width, axis=2)


@jax.custom_vjp
def _add_to_slot(x_BxTxKW: jax.Array, update_BxTxW: jax.Array, index) -> jax.Array:
    """x with `update` added to slot `index` (in place). Its gradient is written by hand: the
    cotangent of x passes through untouched (autodiff of the slice-add-update would rebuild the
    whole buffer's cotangent at every write) and the update's is the slot's slice."""
    width = update_BxTxW.shape[-1]
    return _set_slot(x_BxTxKW, _slot(x_BxTxKW, index, width) + update_BxTxW.astype(x_BxTxKW.dtype),
                     index, width)


def _add_to_slot_forward(x_BxTxKW, update_BxTxW, index):
    dtype_witness = jnp.zeros((0,), update_BxTxW.dtype)  # residuals must be arrays
    return _add_to_slot(x_BxTxKW, update_BxTxW, index), (index, dtype_witness,
                                                          update_BxTxW.shape[-1])


def _add_to_slot_backward(residuals, cotangent_BxTxKW):
    index, dtype_witness, width = residuals
    update = _slot(cotangent_BxTxKW, index, width).astype(dtype_witness.dtype)
    return cotangent_BxTxKW, update, None


_add_to_slot.defvjp(_add_to_slot_forward, _add_to_slot_backward)


def _row(table, index):
    return jax.lax.dynamic_index_in_dim(table, index, axis=0, keepdims=False)


def _source_slots(layout: DepthLayout, state: dict):
    """The buffer as B×T×(N+1)×D sources and their 1/rms as B×T×(N+1)×H (None: raw keys)."""
    inverse = state.get("inverse_rms")
    return (_unflatten(state["sources"], state["sources"].shape[-1] // layout.slots),
            None if inverse is None else _unflatten(inverse, layout.heads))


def _read(layout: DepthLayout, state: dict, query_projection, module: nnx.Module) -> jax.Array:
    """The mixed read Σ_j α_{j→l} v_j (float32 B×T×D) of sublayer l = `state["sublayer"]` (l = n:
    the final read); inside a block opened by `AttnResStream.open`, the two-phase merge."""
    if "phase" in state:
        eps = layout.eps if layout.normalizes_keys else None
        return merge_partial(_row(state["pseudo_queries"], state["sublayer"]), *state["phase"][0],
                             None if "fresh" in state else state["partial"], layout.heads, eps)
    index = state["sublayer"]
    sources, inverse = _source_slots(layout, state)
    newest = (index + layout.block_size - 1) // layout.block_size  # ⌈l/S⌉, the newest source
    slot = jnp.arange(layout.slots)
    valid = slot <= newest
    if layout.window:
        valid &= slot > newest - layout.window
    if layout.weights == "static":
        weights = _row(state["static_weights"], index).reshape(layout.slots, layout.heads)
        weights = jnp.where(valid[:, None], weights, 0.0)
        record(module, "depth_weights", weights.mean(-1))
        return mix_sources(weights, sources, layout.heads)
    query = _row(state["pseudo_queries"], index)
    if query_projection is not None:  # + W_l k̂_cur, the newest source as a key
        current = _split_heads(sources[:, :, newest].astype(jnp.float32), layout.heads)
        if inverse is not None:
            current = current * inverse[:, :, newest, :, None]
        query = query + layout.query_scale * query_projection(
            current.reshape(*current.shape[:-2], -1))
    if layout.heads == 1 and layout.weights == "softmax" and not is_capturing(module):
        ones = jnp.ones(sources.shape[:3], jnp.float32)
        return softmax_read(query, sources, ones if inverse is None else inverse[..., 0], valid)
    mixed, weights = depth_read(query, sources, inverse, valid, layout.heads, layout.weights)
    record(module, "depth_weights", weights.mean((0, 1, 3)))
    return mixed


_HISTORY = ("sources", "inverse_rms")  # the state's per-slot leaves: the buffer and its 1/rms


def _split_inexact(tree):
    """(leaves that take gradients or None, the other leaves or None), each in `tree`'s shape."""
    inexact = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    return (jax.tree.map(lambda x: x if inexact(x) else None, tree),
            jax.tree.map(lambda x: None if inexact(x) else x, tree))


def _join(first, second):
    """The inverse of `_split_inexact`."""
    return jax.tree.map(lambda a, b: b if a is None else a, first, second,
                        is_leaf=lambda x: x is None)


def _units(xs) -> int:
    """The number of scan units: the leading axis of the unit-major inputs."""
    return jax.tree.leaves(xs)[0].shape[0]


def _empty_partial(history: dict, queries_table) -> jax.Array:
    """A block's partial sum before its first output: zeros, B×T×D."""
    sources = history["sources"]
    return jnp.zeros((*sources.shape[:2], queries_table.shape[-1]), sources.dtype)


def _block_scan(stream: AttnResStream, bodies: tuple, per_block: int):
    """`run(queries_table, history, first, consts, xs) -> (history, ys)`: the scan of
    `AttnResStream.scan`, one AttnRes block of `per_block` scan units per step, with
    `bodies[0](unit_state, x, *consts[0])` for a block's first unit and `bodies[1]` (with
    `consts[1]`) for the others (`jax.closure_convert`ed), and its hand-written gradient.

    Completed slots never change and phase 1 masks the others, so what phase 1 of a block needs
    from the buffer in the backward pass is in the final buffer. The forward pass saves, per
    block, the residuals of phase 1 and of each unit (`jax.vjp`) except those that are the
    step's own inputs: the buffer, the query table, the constants and the layer's parameters
    come back from the final buffer and the inputs (autodiff of the scan would save the
    B×T×(N+1)×D buffer at every step). The backward pass scans the blocks in reverse: the
    block's sum gets the cotangent of its slot and of its 1/rms, the units' VJPs, last first,
    give those of their phase-1 results, queries, constants, layer inputs and the partial sum
    each read, and phase 1's adds to the buffer's and the queries'. Each unit's inputs are
    indexed in the unit-major xs directly (a blocks × units view of them made decoding several
    times slower)."""
    layout = stream.layout
    size, reads = layout.block_size, layout.block_size // per_block
    plans = {}  # filled while tracing the forward pass: where each residual comes from

    def unit(j, first, other_x):
        """Unit j of the block at `first` as a function of its differentiable inputs."""
        def run_unit(queries, phase, consts, diff_x, partial):
            state = stream.unit_state(queries, phase, first + j * reads, partial, j == 0)
            state, y = bodies[min(j, 1)](state, _join(diff_x, other_x), *consts)
            diff_y, other_y = _split_inexact(y)
            return (state["partial"], diff_y), other_y
        return run_unit

    def at(tree, unit):  # one unit's slice of unit-major leaves
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, unit, keepdims=False), tree)

    def scan_blocks(step, carry, units: int, scanned=(), reverse=False):
        """`jax.lax.scan` of `step(carry, (block, *scanned)) -> (carry, (per-unit outputs,
        other outputs))` over the blocks, each unit's output written in place into unit-major
        buffers in the loop carry (stacked per block and interleaved after, every output was
        copied once more: the whole KV cache at each decode step). Returns (carry, unit-major
        outputs, other outputs stacked over blocks)."""
        blocks = jnp.arange(units // per_block)
        example = jax.eval_shape(step, carry, (blocks[0], *at(scanned, 0)))[1][0][0]
        buffers = jax.tree.map(lambda y: jnp.zeros((units, *y.shape), y.dtype), example)

        def body(carry_buffers, inputs):
            carry, buffers = carry_buffers
            carry, (ys, other) = step(carry, inputs)
            for j, y in enumerate(ys):
                buffers = jax.tree.map(lambda b, y, j=j: jax.lax.dynamic_update_index_in_dim(
                    b, y.astype(b.dtype), inputs[0] * per_block + j, 0), buffers, y)
            return (carry, buffers), other
        (carry, buffers), other = jax.lax.scan(body, (carry, buffers), (blocks, *scanned),
                                               reverse=reverse)
        return carry, buffers, other

    def step_units(queries, phase, consts, xs, block, history, first, differentiate):
        """The block's units in order: (partial sum, each unit's y, each unit's VJP and the
        inputs it may keep)."""
        partial, ys, vjps = _empty_partial(history, queries), [], []
        for j in range(per_block):
            diff_x, other_x = _split_inexact(at(xs, block * per_block + j))
            args = (queries, phase[j * reads:(j + 1) * reads], consts[min(j, 1)], diff_x,
                    partial)
            run_unit = unit(j, first, other_x)
            if differentiate:
                (partial, diff_y), vjp, other_y = jax.vjp(run_unit, *args, has_aux=True)
                vjps.append((vjp, (queries, consts[min(j, 1)], diff_x)))
            else:
                (partial, diff_y), other_y = run_unit(*args)
            ys.append(_join(diff_y, other_y))
        return partial, tuple(ys), vjps

    def run(queries, history, first, consts, xs):
        def step(carry, inputs):
            (history, first), (block,) = carry, inputs
            phase = stream.open(queries, stream.views(history), first)
            partial, ys, _ = step_units(queries, phase, consts, xs, block, history, first, False)
            return (stream.close(history, partial, first), first + size), (ys, ())
        (history, _), ys, _ = scan_blocks(step, (history, first), _units(xs))
        return history, ys

    def keep(key, vjp, inputs):
        """The VJP's residuals that are not among `inputs` (their places recorded)."""
        residuals, tree = jax.tree.flatten(vjp)
        inputs = jax.tree.leaves(inputs)
        where = [next((i for i, x in enumerate(inputs) if x is r), None) for r in residuals]
        plans[key] = (tree, where)
        return [r for r, i in zip(residuals, where, strict=True) if i is None]

    def rebuild(key, kept, inputs):
        tree, where = plans[key]
        kept, inputs = iter(kept), jax.tree.leaves(inputs)
        return jax.tree.unflatten(tree, [next(kept) if i is None else inputs[i] for i in where])

    def run_saving(queries, history, first, consts, xs):
        def step(carry, inputs):
            (history, first), (block,) = carry, inputs
            views = stream.views(history)
            phase, open_vjp = jax.vjp(lambda q, v: stream.open(q, v, first), queries, views)
            partial, ys, vjps = step_units(queries, phase, consts, xs, block, history, first,
                                           True)
            saved = [keep("open", open_vjp, (queries, views))]
            saved += [keep(j, vjp, inputs) for j, (vjp, inputs) in enumerate(vjps)]
            return (stream.close(history, partial, first), first + size), (ys, saved)
        (history, _), ys, saved = scan_blocks(step, (history, first), _units(xs))
        return (history, ys), (queries, history, first, consts, xs, saved)

    def backward(residuals, cotangents):
        queries, final, first, consts, xs, saved = residuals
        history_cotangent, ys_cotangent = cotangents
        width, dtype = queries.shape[-1], final["sources"].dtype
        views, views_vjp = jax.vjp(stream.views, final)

        def step(carry, inputs):
            history_cotangent, queries_cotangent, consts_cotangent = carry
            block, saved = inputs
            slot = (first + block * size) // size + 1
            partial_cotangent = _slot(history_cotangent["sources"], slot, width)
            if layout.normalizes_keys:  # the slot's 1/rms, written from the block's sum
                inverse = history_cotangent["inverse_rms"]
                _, rms_vjp = jax.vjp(lambda p: inverse_rms(p, layout.heads, layout.eps),
                                     _slot(final["sources"], slot, width))
                partial_cotangent += rms_vjp(_slot(inverse, slot, layout.heads))[0]
                history_cotangent = dict(history_cotangent, inverse_rms=_set_slot(
                    inverse, jnp.zeros(inverse.shape[:2] + (layout.heads,)), slot, layout.heads))
            consts_cotangent, phase_cotangent, xs_cotangent = list(consts_cotangent), [], []
            for j in reversed(range(per_block)):  # the units' VJPs, last unit first
                unit_vjp = rebuild(j, saved[j + 1], (queries, consts[min(j, 1)], _split_inexact(
                    at(xs, block * per_block + j))[0]))
                queries_from_unit, unit_phase, consts_from_unit, x_cotangent, partial_cotangent \
                    = unit_vjp((partial_cotangent.astype(dtype), _split_inexact(
                        at(ys_cotangent, block * per_block + j))[0]))
                queries_cotangent = queries_cotangent + queries_from_unit
                consts_cotangent[min(j, 1)] = jax.tree.map(jnp.add, consts_cotangent[min(j, 1)],
                                                           consts_from_unit)
                phase_cotangent[:0], xs_cotangent[:0] = unit_phase, [x_cotangent]
            queries_from_phase, views_cotangent = rebuild("open", saved[0], (queries, views))(
                tuple(phase_cotangent))
            carry = (jax.tree.map(jnp.add, history_cotangent, views_vjp(views_cotangent)[0]),
                     queries_cotangent + queries_from_phase, tuple(consts_cotangent))
            return carry, (tuple(xs_cotangent), ())

        zeros = jax.tree.map(jnp.zeros_like, (queries, consts))
        (history_cotangent, queries_cotangent, consts_cotangent), xs_cotangent, _ = scan_blocks(
            step, (history_cotangent, *zeros), _units(xs), (saved,), reverse=True)
        return queries_cotangent, history_cotangent, None, consts_cotangent, xs_cotangent

    scan = jax.custom_vjp(run)
    scan.defvjp(run_saving, backward)
    return scan


def _query_projection(cfg, rngs: nnx.Rngs) -> Dense:
    """W ∈ R^{d×d}, zero-initialized: the input-dependent query starts at the static one."""
    return Dense((cfg.d_model,), (cfg.d_model,), ("embed",), (None,), rngs=rngs,
                 init=lambda fan_in, fan_out: nnx.initializers.zeros)


class AttnResStream(ResidualStream):
    """Model-level part of AttnRes: the pseudo-query table w_0 … w_n (the last row is the final
    read's), zero-initialized, or the static weight table (1 on every source); `begin` fills the
    source buffer with the embedding, `end` is the final read (no norm: the model's final norm
    follows)."""

    def __init__(self, layout: DepthLayout, cfg, *, rngs: nnx.Rngs):
        self.layout = layout
        rows = layout.sublayers + 1
        if layout.weights == "static":
            self.static_weights = param(rngs, nnx.initializers.ones,
                                        (rows, layout.slots, layout.heads), (None, None, None),
                                        MixingParam)
        else:
            self.pseudo_queries = param(rngs, nnx.initializers.zeros, (rows, cfg.d_model),
                                        (None, None), MixingParam)
        self.final_query_projection = (_query_projection(cfg, rngs) if layout.query == "input"
                                       else None)

    def begin(self, x_BxTxD) -> dict:
        layout = self.layout
        batch, length, width = x_BxTxD.shape
        sources = _set_slot(jnp.zeros((batch, length, layout.slots * width), x_BxTxD.dtype),
                            x_BxTxD, 0, width)
        state = dict(sources=sources, sublayer=jnp.zeros((), jnp.int32))
        if layout.normalizes_keys:
            state["inverse_rms"] = _set_slot(
                jnp.zeros((batch, length, layout.slots * layout.heads), jnp.float32),
                inverse_rms(x_BxTxD, layout.heads, layout.eps), 0, layout.heads)
        if layout.weights == "static":  # kept 2-D: constrain_state shards 3-D leaves as streams
            state["static_weights"] = self.static_weights[...].reshape(layout.sublayers + 1, -1)
        else:
            state["pseudo_queries"] = self.pseudo_queries[...]
        return state

    def end(self, state: dict) -> jax.Array:
        mixed = _read(self.layout, state, self.final_query_projection, self)
        return mixed.astype(state["sources"].dtype)

    def hidden_state(self, state: dict) -> jax.Array:
        """The final depth-attention read over the sources available in `state`: `end`, with the
        final read's query row (or static weight row) in the row of the state's next sublayer,
        which `end` reads."""
        key = "static_weights" if "static_weights" in state else "pseudo_queries"
        table = state[key]
        return self.end(dict(state, **{key: table.at[state["sublayer"]].set(table[-1])}))

    def units_per_block(self, units: int) -> int | None:
        """How many of the model's `units` scan units (blocks, or MoE block groups) make one
        AttnRes block, when the blocks align with them (S a multiple of the sublayers per unit, n
        a multiple of S) and the reads are two-phase: the layer scan is then `scan`, one AttnRes
        block per step. None otherwise (the naive read, unit by unit), and under `nnx.capture`
        (the naive reads record their depth weights)."""
        layout = self.layout
        if is_capturing(self):
            return None
        per_unit = layout.sublayers // units
        if (layout.two_phase and layout.block_size % per_unit == 0
                and layout.sublayers % layout.block_size == 0):
            return layout.block_size // per_unit
        return None

    def views(self, history: dict) -> tuple:
        """The buffer and its 1/rms as phase 1 contracts them (`contraction_views`)."""
        return contraction_views(*_source_slots(self.layout, history), self.layout.heads)

    def open(self, queries_table, views: tuple, first) -> tuple:
        """Phase 1 for the block whose first sublayer is `first`: its S pseudo-queries against
        the completed sources (`views` of the buffer) at once. Each read's (log-sum-exp,
        normalized read), in order."""
        layout = self.layout
        queries = jax.lax.dynamic_slice_in_dim(queries_table, first, layout.block_size)
        valid = jnp.arange(layout.slots) <= first // layout.block_size
        lse, reads = phase_one_on_views(queries, views, valid, layout.heads)
        return tuple((lse[:, :, i], read) for i, read in enumerate(reads))

    def close(self, history: dict, partial_BxTxD, first) -> dict:
        """The buffer with the block's sum written to its slot (with its 1/rms): the summary
        becomes a source."""
        layout = self.layout
        slot = first // layout.block_size + 1
        history = dict(history, sources=_add_to_slot(history["sources"], partial_BxTxD, slot))
        if layout.normalizes_keys:
            history["inverse_rms"] = _set_slot(
                history["inverse_rms"], inverse_rms(partial_BxTxD, layout.heads, layout.eps),
                slot, layout.heads)
        return constrain_state(history)

    def scan(self, body, state: dict, xs):
        """The whole layer stack (layouts with `units_per_block`), one AttnRes block per step:
        `open`, then `body(unit_state, x) -> (unit_state, y)` for each of the block's scan
        units, whose layers read by merging into phase 1 and add their outputs to the block's
        partial sum, then `close`. `jax.lax.scan` with a hand-written gradient (`_block_scan`):
        the forward pass does not save the buffer at every step. Returns (final state, y
        stacked over units)."""
        queries, first = state["pseudo_queries"], state["sublayer"]
        history = {name: state[name] for name in _HISTORY if name in state}
        per_block = self.units_per_block(_units(xs))
        reads = self.layout.block_size // per_block

        def example(fresh: bool):
            return jax.eval_shape(lambda: (self.unit_state(
                queries, self.open(queries, self.views(history), first)[:reads], first,
                _empty_partial(history, queries), fresh), jax.tree.map(lambda x: x[0], xs)))
        # A unit that starts its block reads no partial sum: a body of its own.
        bodies, consts = zip(*(jax.closure_convert(body, *example(fresh))
                               for fresh in (True, False)[:per_block]), strict=True)
        history, ys = _block_scan(self, bodies, per_block)(queries, history, first, consts, xs)
        return dict(state, **history, sublayer=first + self.layout.sublayers), ys

    @staticmethod
    def unit_state(queries_table, phase: tuple, first, partial_BxTxD, fresh: bool) -> dict:
        """What the layers of a scan unit in an opened block read and write: the counter, the
        query table, the unit's reads' phase-1 results and the block's partial sum, and, when
        the unit starts the block, the key "fresh" (the partial sum is not a source yet)."""
        state = dict(sublayer=first, pseudo_queries=queries_table, phase=phase,
                     partial=partial_BxTxD)
        return dict(state, fresh=None) if fresh else state

    def stage_window(self, lag: int) -> int:
        """Source slots a pipeline stage is sent: those written in `lag` consecutive sublayers,
        at most ⌈(lag − 1)/S⌉ + 1 of the 1 + N (all of them when that is no fewer)."""
        layout = self.layout
        return min(layout.slots, -(-(lag - 1) // layout.block_size) + 1)

    def _recent_slots(self, sublayer, lag: int):
        """(first slot, count) of the window: the slots written by sublayers sublayer − lag …
        sublayer − 1, moved back to stay inside the buffer."""
        count = self.stage_window(lag)
        first = jnp.maximum(sublayer - lag, 0) // self.layout.block_size + 1
        return jnp.minimum(first, self.layout.slots - count), count

    def stage_message(self, state: dict, lag: int) -> dict:
        """What a pipeline stage that last held this state `lag` sublayers ago lacks (the cached
        transfer of the AttnRes report, `sharding/pipeline.py`): the counter and the window of
        slots written since, with their 1/rms. The embedding, the blocks completed before and the
        query table are in its copy already, so a transfer is O(lag/S) slots instead of 1 + N."""
        first, count = self._recent_slots(state["sublayer"], lag)
        message = {"sublayer": state["sublayer"]}
        for name, width in self._slot_widths(state).items():
            message[name] = jax.lax.dynamic_slice_in_dim(state[name], first * width,
                                                         count * width, axis=2)
        return message

    def stage_merge(self, cached: dict, message: dict, lag: int) -> dict:
        """The state from a stage's own older copy and a `stage_message`: the window written
        over the copy's slots (slots before the window are final in both, those after empty)."""
        first, _ = self._recent_slots(message["sublayer"], lag)
        state = dict(cached, sublayer=message["sublayer"])
        for name, width in self._slot_widths(cached).items():
            state[name] = jax.lax.dynamic_update_slice_in_dim(cached[name], message[name],
                                                              first * width, axis=2)
        return state

    def _slot_widths(self, state: dict) -> dict[str, int]:
        """Features per slot of the per-slot leaves: the sources (D) and their 1/rms (H)."""
        widths = {"sources": state["sources"].shape[-1] // self.layout.slots}
        if "inverse_rms" in state:
            widths["inverse_rms"] = self.layout.heads
        return widths


@RESIDUALS.register("attnres")
class AttentionResidual(ResidualMechanism):
    """Full Attention Residuals, per sublayer: h_l = norm(Σ_j α_{j→l} v_j) over the embedding and
    every earlier sublayer output (equations, initialization and sources: the module docstring of
    `arch/attnres.py`). Parameters here: the read's norm (`model.norm`, gain 1) and, with
    `attnres.query="input"`, the zero-initialized query projection W_l."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.layout = self.depth_layout(cfg)
        self.norm = make_norm(cfg, rngs=rngs)
        self.query_projection = (_query_projection(cfg, rngs) if self.layout.query == "input"
                                 else None)

    @staticmethod
    def block_size(cfg) -> int:
        return 1

    @classmethod
    def depth_layout(cls, cfg) -> DepthLayout:
        return DepthLayout(sublayers=cfg.num_layers * (2 if cfg.use_ffn else 1),
                           block_size=cls.block_size(cfg), heads=cfg.attnres.heads,
                           weights=cfg.attnres.weights, query=cfg.attnres.query,
                           query_scale=cfg.attnres.query_scale,
                           key_norm=cfg.attnres.key_norm, window=cfg.attnres.window,
                           eps=cfg.norm.eps)

    @classmethod
    def stream(cls, cfg, *, rngs: nnx.Rngs) -> nnx.Module:
        return AttnResStream(cls.depth_layout(cfg), cfg, rngs=rngs)

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """Full AttnRes, "scheduled" (the two-phase schedule of the AttnRes report over chunks of
        S = `model.attnres.block_size` sublayers, every output its own source; L sublayers,
        N = ⌈L/S⌉): phase 1 reads the (N − 1)·S outputs of earlier chunks once per chunk →
        N − 1; the phase-1 result written and read back → 2; phase 2 merges up to S − 1
        intra-chunk outputs → S − 1; the sublayer's output is stored once as a source (not
        counted). Total L/S + S (24 at L = 128, S = 16). `model.attnres.window` is not modelled
        (an upper bound for windowed depth attention)."""
        L, S, N = _chunking(cfg)
        T = ResidualTraffic
        return ResidualIO((T("phase 1: read the earlier chunks' outputs once per chunk", N - 1, 0),
                           T("phase 1 result: write, read back", 1, 1),
                           T("phase 2: merge the intra-chunk outputs", S - 1, 0)))

    @classmethod
    def residual_history(cls, cfg) -> int:
        """N + 1 sources: the embedding and one per block of S (Full: S = 1, L + 1)."""
        L = sublayer_count(cfg)
        return math.ceil(L / max(1, min(cls.block_size(cfg), L))) + 1

    @classmethod
    def check_prunable(cls, cfg, kept, drop) -> None:
        """Clean only when the kept sublayers group into AttnRes blocks of S as before (each old
        block's kept sublayers form one new block)."""
        old_blocks, new_blocks = cls._pruned_blocks(cfg, kept)
        if any((old_blocks[k] == old_blocks[k + 1]) != (new_blocks[k] == new_blocks[k + 1])
               for k in range(len(old_blocks) - 1)):
            per_block, size = sublayers_per_block(cfg), cls.block_size(cfg)
            raise ValueError(
                f"model.residual.name={cfg.residual.name!r}: dropping blocks {list(drop)} regroups "
                f"the remaining sublayers into other AttnRes blocks of model.attnres.block_size="
                f"{size}; drop blocks whose {per_block} sublayer(s) fill whole AttnRes blocks, "
                "or the last blocks")

    @classmethod
    def prune(cls, cfg, state, kept) -> None:
        """Keep the rows of the model-level pseudo-query (or static weight) table of the kept
        sublayers and the final read, and the static weights' columns of the source slots that
        still hold an output: the kept sublayers read over the remaining outputs."""
        per_block = sublayers_per_block(cfg)
        sublayers = [b * per_block + j for b in kept for j in range(per_block)]
        old_blocks, _ = cls._pruned_blocks(cfg, kept)
        rows = np.asarray([*sublayers, cfg.num_layers * per_block])
        slots = np.asarray([0, *(1 + block for block in dict.fromkeys(old_blocks))])
        stream_state = state["residual_stream"]
        if "static_weights" in stream_state:  # rows × slots × heads
            stream_state["static_weights"] = jax.tree.map(lambda x: x[rows][:, slots],
                                                          stream_state["static_weights"])
        else:  # rows × D
            stream_state["pseudo_queries"] = jax.tree.map(lambda x: x[rows],
                                                          stream_state["pseudo_queries"])

    @classmethod
    def _pruned_blocks(cls, cfg, kept) -> tuple[list[int], list[int]]:
        """The AttnRes block of every kept sublayer before and after pruning."""
        per_block, size = sublayers_per_block(cfg), cls.block_size(cfg)
        sublayers = [b * per_block + j for b in kept for j in range(per_block)]
        return ([sublayer // size for sublayer in sublayers],
                [sublayer // size for sublayer in range(len(sublayers))])

    def read(self, state: dict) -> jax.Array:
        if "phase" in state:  # only this read's inputs: the remat saves them
            inputs = {key: state[key] for key in ("sublayer", "pseudo_queries", "partial", "fresh")
                      if key in state}
            return nnx.remat(_merged_read, prevent_cse=False, graph=False)(self, dict(
                inputs, phase=state["phase"][:1]))
        mixed = _read(self.layout, state, self.query_projection, self)
        return self.norm(mixed.astype(state["sources"].dtype))

    def write(self, state: dict, update_BxTxD, read_context=None) -> dict:
        """Add the output to its block's slot (in place), or, inside an opened block, to the
        partial sum; it is a source from the next read on."""
        layout = self.layout
        index = state["sublayer"]
        state = dict(state, sublayer=index + 1)
        if "phase" in state:
            state.pop("fresh", None)  # the partial sum holds an output from now on
            partial = state["partial"]
            state.update(partial=partial + update_BxTxD.astype(partial.dtype),
                         phase=state["phase"][1:])
            return state
        slot, width = index // layout.block_size + 1, update_BxTxD.shape[-1]
        state["sources"] = _add_to_slot(state["sources"], update_BxTxD, slot)
        if layout.normalizes_keys:
            state["inverse_rms"] = _set_slot(
                state["inverse_rms"], inverse_rms(_slot(state["sources"], slot, width),
                                                  layout.heads, layout.eps), slot, layout.heads)
        return state


def _chunking(cfg) -> tuple[int, int, int]:
    """(L sublayers, S = `model.attnres.block_size` capped at L, N = ⌈L/S⌉)."""
    L = sublayer_count(cfg)
    S = max(1, min(cfg.attnres.block_size, L))
    return L, S, math.ceil(L / S)


def _merged_read(residual: AttentionResidual, state: dict) -> jax.Array:
    """norm(the two-phase merge) of a read in an opened block, rematerialized (`nnx.remat`): the
    backward pass recomputes both from the phase-1 result and the partial sum, which are saved
    anyway, instead of saving the merged read and three D-wide arrays of the norm per read
    (written to memory and read back)."""
    mixed = _read(residual.layout, state, None, residual)
    return residual.norm(mixed.astype(state["partial"].dtype))


@RESIDUALS.register("block_attnres")
class BlockAttentionResidual(AttentionResidual):
    """Block Attention Residuals, per sublayer: blocks of S = `model.attnres.block_size`
    sublayers summed into one source each; the read attends over the embedding, the completed
    block summaries and the current partial sum (boundary rules and sources: the module docstring
    of `arch/attnres.py`). S = 1 equals Full AttnRes."""

    @staticmethod
    def block_size(cfg) -> int:
        return cfg.attnres.block_size

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """Two-phase schedule (AttnRes report, "Block AttnRes" inference schedule; L sublayers,
        S = `model.attnres.block_size`, N = ⌈L/S⌉): phase 1 reads the N block summaries once per
        block for all S queries → N/S; the phase-1 result is written and read back → 2; the
        partial sum is read once (online-softmax merge and the add), the sublayer output read,
        the partial sum written → 3. Total N/S + 5 (5.5 at L = 128, S = 16)."""
        L, S, N = _chunking(cfg)
        T = ResidualTraffic
        return ResidualIO((T("phase 1: read the N block summaries once per block", N / S, 0),
                           T("phase 1 result: write, read back", 1, 1),
                           T("read the partial sum (merge and add)", 1, 0),
                           T("read the sublayer output", 1, 0), T("write the partial sum", 0, 1)))
