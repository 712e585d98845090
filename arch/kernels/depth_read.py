"""How AttnRes's depth reads run (the mechanism and its equations: `arch.attnres`).

The sources live in one token-major buffer, B×T×((N+1)·D), slot j at features j·D … (j+1)·D − 1
(a 3-D leaf, so `constrain_state` shards it like the stream, and each token's sources are
contiguous, which keeps the depth contractions free of transposes on CPU), with their 1/rms per
head beside it, B×T×((N+1)·H) float32. `read_slot`, `write_slot` and `add_to_slot` index it;
a write touches one slot in place, and `add_to_slot`'s gradient passes the buffer's cotangent
through untouched.

Reads: `depth_read` is the naive read over all N + 1 slots, O(N·D) per token, for any weights
and heads; `softmax_read` is its one-head softmax case with a hand-written gradient.

Two-phase reads (paper, "Two-phase computation"): phase 1 (`phase_one_on_views`) batches a
block's S input-independent queries against the completed sources once, per query and head the
log-sum-exp of the scores, lse, and the normalized read c over those sources, as one reduction
over the slot axis (O(S·N·D) per block); phase 2 (`merge_partial`) merges the block's one
partial-sum source p, with score s, into that result as a two-way softmax,
σ(lse − s)·c + σ(s − lse)·p, O(D) per read. Both phases have hand-written gradients; in
training the merge and the norm after it are rematerialized in the backward pass from c and p,
which are saved anyway. Equal to the naive read to float rounding (`two_phase_reads` is the
reference composition the tests compare). Measured: docs/performance.md#block-attnres.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def split_heads(x: jax.Array, heads: int) -> jax.Array:
    """…×D → …×H×(D/H)."""
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def _contraction_view(x: jax.Array, heads: int) -> jax.Array:
    """The operand `_contract` expects: heads split, or unchanged for one head (no head axis)."""
    return x if heads == 1 else split_heads(x, heads)


def _head_sums(x: jax.Array, heads: int) -> jax.Array:
    """Sums over each head's d/H features: …×D → …×H. One head keeps the array's rank (XLA:CPU's
    library reductions are an order of magnitude slower with a size-1 axis before the last)."""
    if heads == 1:
        return x.sum(axis=-1, keepdims=True)
    return split_heads(x, heads).sum(axis=-1)


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
        values = split_heads(sources_BxTxNxD.astype(jnp.float32), heads)
        query = split_heads(query.astype(jnp.float32), heads)
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
    values = split_heads(sources_BxTxNxD.astype(jnp.float32), heads)
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
    # tiny matrix products; as an unrolled elementwise sum, it fuses the sum into each consumer
    # (every read recomputed from the whole buffer). Both are slower: docs/performance.md,
    # "Tried and not kept".
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
    per_feature = lambda x: _per_feature(x, width)
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
        query_cotangent = _contract("bthk,bth->hk", heads, split_heads(values, heads),
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
def source_slots(layout, state: dict):
    """The buffer of a state as B×T×(N+1)×D sources and their 1/rms as B×T×(N+1)×H (None: raw
    keys), for a `layout` (`arch.attnres.DepthLayout`)."""
    inverse = state.get("inverse_rms")
    return (unflatten_slots(state["sources"], state["sources"].shape[-1] // layout.slots),
            None if inverse is None else unflatten_slots(inverse, layout.heads))


def unflatten_slots(x_BxTxKW: jax.Array, width: int) -> jax.Array:
    return x_BxTxKW.reshape(*x_BxTxKW.shape[:2], -1, width)


def read_slot(x_BxTxKW: jax.Array, index, width: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x_BxTxKW, index * width, width, axis=2)


def write_slot(x_BxTxKW: jax.Array, value, index, width: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x_BxTxKW, value.astype(x_BxTxKW.dtype),
                                               index * width, axis=2)


@jax.custom_vjp
def add_to_slot(x_BxTxKW: jax.Array, update_BxTxW: jax.Array, index) -> jax.Array:
    """x with `update` added to slot `index` (in place). Its gradient is written by hand: the
    cotangent of x passes through untouched (autodiff of the slice-add-update would rebuild the
    whole buffer's cotangent at every write) and the update's is the slot's slice."""
    width = update_BxTxW.shape[-1]
    added = read_slot(x_BxTxKW, index, width) + update_BxTxW.astype(x_BxTxKW.dtype)
    return write_slot(x_BxTxKW, added, index, width)


def _add_to_slot_forward(x_BxTxKW, update_BxTxW, index):
    dtype_witness = jnp.zeros((0,), update_BxTxW.dtype)  # residuals must be arrays
    return add_to_slot(x_BxTxKW, update_BxTxW, index), (index, dtype_witness,
                                                         update_BxTxW.shape[-1])


def _add_to_slot_backward(residuals, cotangent_BxTxKW):
    index, dtype_witness, width = residuals
    update = read_slot(cotangent_BxTxKW, index, width).astype(dtype_witness.dtype)
    return cotangent_BxTxKW, update, None


add_to_slot.defvjp(_add_to_slot_forward, _add_to_slot_backward)
