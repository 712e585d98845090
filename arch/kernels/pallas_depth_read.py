"""AttnRes's one-head softmax depth read as one fused Pallas kernel, forward and backward
(`execution.depth_read="pallas"`; the XLA read it replaces: `arch.kernels.depth_read.softmax_read`;
the mechanism: `arch.attnres`; source: Kimi Team 2026, "Attention Residuals", arXiv 2603.15031).

For each token, with a query w (D, static, or one per token), sources v_j (N×D), their inverse
RMS r_j and a valid mask over the N sources,

    z_j = w · v_j,   s_j = z_j · r_j,   α = softmax_j over the valid j (invalid: −∞),
    out = Σ_j α_j v_j                                                  (float32 B×T×D).

Tiling: B·T is flattened to M tokens, and the grid runs over tiles of `block_tokens` tokens; one
program holds its tile's whole N×D slab of sources (every source and feature in one block), so
the scores, the masked softmax and the weighted sum never leave the chip. Block shapes are
powers of two, as Triton needs: N and D are zero-padded up to the next power of two (padded
sources are invalid, padded features are zero) and M up to a multiple of the tile (padded tokens
read zeros and are dropped). The tile is the largest power of two with at most 2¹⁴ elements in
the slab (at least 1), unless given. Accumulation is float32; the sources may be bf16 or f32.

Backward, one fused kernel over the same tiles. It keeps no residual besides the inputs (the
forward saves nothing: the backward recomputes z, s, α from the sources it reads anyway). With
the output's cotangent g,

    a_j = g · v_j,   ∂s_j = α_j (a_j − Σ_k α_k a_k),   ∂z_j = ∂s_j · r_j,
    ∂v_j = α_j g + ∂z_j w,   ∂r_j = ∂s_j · z_j,   ∂w = Σ_j ∂z_j v_j (static w: summed over the
    tokens, one partial sum per tile, added up outside the kernel).

The mask gets no gradient. These are `softmax_read`'s custom-vjp cotangents, each in its
operand's dtype (computed in float32).

On GPU the kernel lowers through Triton (`pl.pallas_call` with Triton compiler parameters, not
Mosaic GPU); on any other backend (CPU) it runs in Pallas's interpret mode (chosen from
`jax.default_backend()`, or by `interpret`). On GPU it is not partitioned: under a sharded mesh
XLA gathers its operands.

Cost: O(N·D) per token each way; the sources are read once forward and once backward (plus one
write of their cotangent), no B×T×N intermediate is saved, the backward recomputes the scores,
and shapes that need padding pay one padded copy of the sources per kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

SLAB_ELEMENTS = 1 << 14  # sources per program, block_tokens·N·D (padded), when not given
TRITON = pltriton.CompilerParams()  # on GPU, the Triton lowering (not Mosaic GPU)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def default_block_tokens(tokens: int, sources: int, width: int) -> int:
    """Tokens per program: the largest power of two whose slab of padded sources has at most
    `SLAB_ELEMENTS` elements, at least 1, at most the tokens rounded up to a power of two."""
    per_token = _next_power_of_two(sources) * _next_power_of_two(width)
    tile = 1
    while tile * 2 * per_token <= SLAB_ELEMENTS and tile < tokens:
        tile *= 2
    return tile


def _scores_and_weights(query, values, inverse, valid):
    """z (TM×N), α (TM×N) of one tile; query 1×D or TM×D, values TM×N×D float32."""
    raw = jnp.sum(values * query[:, None, :], axis=2)
    scores = jnp.where(valid != 0, raw * inverse, -jnp.inf)
    exponentials = jnp.exp(scores - jnp.max(scores, axis=1)[:, None])
    return raw, exponentials / jnp.sum(exponentials, axis=1)[:, None]


def _forward_kernel(query_ref, sources_ref, inverse_ref, valid_ref, out_ref):
    values = sources_ref[...].astype(jnp.float32)
    query = query_ref[...].astype(jnp.float32)
    _, weights = _scores_and_weights(query, values, inverse_ref[...], valid_ref[...])
    out_ref[...] = jnp.sum(weights[:, :, None] * values, axis=1)


def _backward_kernel(query_ref, sources_ref, inverse_ref, valid_ref, cotangent_ref,
                     query_cotangent_ref, sources_cotangent_ref, inverse_cotangent_ref):
    values = sources_ref[...].astype(jnp.float32)
    query = query_ref[...].astype(jnp.float32)
    inverse, cotangent = inverse_ref[...], cotangent_ref[...]
    raw, weights = _scores_and_weights(query, values, inverse, valid_ref[...])
    along = jnp.sum(values * cotangent[:, None, :], axis=2)  # a_j = g · v_j
    score_cotangent = weights * (along - jnp.sum(weights * along, axis=1)[:, None])
    raw_cotangent = score_cotangent * inverse
    sources_cotangent_ref[...] = (weights[:, :, None] * cotangent[:, None, :]
                                  + raw_cotangent[:, :, None] * query[:, None, :]
                                  ).astype(sources_cotangent_ref.dtype)
    inverse_cotangent_ref[...] = score_cotangent * raw
    query_cotangent = jnp.sum(raw_cotangent[:, :, None] * values, axis=1)  # TM×D
    if query_cotangent_ref.shape[0] != query_cotangent.shape[0]:  # static query: this tile's sum
        query_cotangent = jnp.sum(query_cotangent, axis=0)[None, :]
    query_cotangent_ref[...] = query_cotangent


def _pad_to(x, shape):
    pads = [(0, size - dim) for dim, size in zip(x.shape, shape, strict=True)]
    return x if all(high == 0 for _, high in pads) else jnp.pad(x, pads)


def _operands(query, sources_BxTxNxD, inverse_BxTxN, valid_N, tile):
    """The padded token-major operands (M_p × …) and the specs of the tiled ones."""
    batch, length, count, width = sources_BxTxNxD.shape
    tokens = batch * length
    padded_tokens = pl.cdiv(tokens, tile) * tile
    count_p, width_p = _next_power_of_two(count), _next_power_of_two(width)
    sources = _pad_to(sources_BxTxNxD.reshape(tokens, count, width),
                      (padded_tokens, count_p, width_p))
    inverse = _pad_to(inverse_BxTxN.reshape(tokens, count).astype(jnp.float32),
                      (padded_tokens, count_p))
    valid = _pad_to(valid_N.astype(jnp.int32)[None, :], (1, count_p))
    if query.ndim == 1:
        query = _pad_to(query[None, :], (1, width_p))
        query_spec = pl.BlockSpec((1, width_p), lambda i: (0, 0))
    else:
        query = _pad_to(query.reshape(tokens, width), (padded_tokens, width_p))
        query_spec = pl.BlockSpec((tile, width_p), lambda i: (i, 0))
    specs = [query_spec,
             pl.BlockSpec((tile, count_p, width_p), lambda i: (i, 0, 0)),
             pl.BlockSpec((tile, count_p), lambda i: (i, 0)),
             pl.BlockSpec((1, count_p), lambda i: (0, 0))]
    return (query, sources, inverse, valid), specs, padded_tokens // tile


def _resolve(interpret, block_tokens, sources_BxTxNxD):
    batch, length, count, width = sources_BxTxNxD.shape
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if block_tokens is None:
        block_tokens = default_block_tokens(batch * length, count, width)
    if block_tokens < 1 or block_tokens & (block_tokens - 1):
        raise ValueError(f"block_tokens={block_tokens} must be a power of two")
    return bool(interpret), int(block_tokens)


def pallas_softmax_read(query, sources_BxTxNxD, inverse_rms_BxTxN, valid_N, *,
                        interpret: bool | None = None,
                        block_tokens: int | None = None) -> jax.Array:
    """`softmax_read` (query D or B×T×D, sources B×T×N×D, inverse RMS B×T×N, valid N bool) as
    the fused kernel, float32 B×T×D, with the fused backward. `interpret` None: unless on GPU;
    `block_tokens` (a power of two) None: `default_block_tokens`."""
    interpret, block_tokens = _resolve(interpret, block_tokens, sources_BxTxNxD)
    return _fused_read(query, sources_BxTxNxD, inverse_rms_BxTxN, valid_N, interpret,
                       block_tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused_read(query, sources, inverse, valid, interpret, tile):
    return _forward(query, sources, inverse, valid, interpret, tile)[0]


def _forward(query, sources, inverse, valid, interpret, tile):
    batch, length, _, width = sources.shape
    operands, specs, tiles = _operands(query, sources, inverse, valid, tile)
    width_p = operands[1].shape[2]
    out = pl.pallas_call(
        _forward_kernel, grid=(tiles,), in_specs=specs,
        out_specs=pl.BlockSpec((tile, width_p), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((tiles * tile, width_p), jnp.float32),
        interpret=interpret, compiler_params=TRITON, name="depth_read_forward")(*operands)
    out = out[:batch * length, :width].reshape(batch, length, width)
    return out, (query, sources, inverse, valid)


def _backward(interpret, tile, residuals, cotangent_BxTxD):
    query, sources, inverse, valid = residuals
    batch, length, count, width = sources.shape
    tokens = batch * length
    operands, specs, tiles = _operands(query, sources, inverse, valid, tile)
    padded_tokens, count_p, width_p = operands[1].shape
    cotangent = _pad_to(cotangent_BxTxD.astype(jnp.float32).reshape(tokens, width),
                        (padded_tokens, width_p))
    query_rows = tiles if query.ndim == 1 else padded_tokens  # static: one partial sum per tile
    query_block = 1 if query.ndim == 1 else tile
    query_cotangent, sources_cotangent, inverse_cotangent = pl.pallas_call(
        _backward_kernel, grid=(tiles,),
        in_specs=[*specs, pl.BlockSpec((tile, width_p), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((query_block, width_p), lambda i: (i, 0)),
                   pl.BlockSpec((tile, count_p, width_p), lambda i: (i, 0, 0)),
                   pl.BlockSpec((tile, count_p), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((query_rows, width_p), jnp.float32),
                   jax.ShapeDtypeStruct((padded_tokens, count_p, width_p), sources.dtype),
                   jax.ShapeDtypeStruct((padded_tokens, count_p), jnp.float32)],
        interpret=interpret, compiler_params=TRITON,
        name="depth_read_backward")(*operands, cotangent)
    if query.ndim == 1:
        query_cotangent = query_cotangent.sum(axis=0)[:width]
    else:
        query_cotangent = query_cotangent[:tokens, :width].reshape(batch, length, width)
    sources_cotangent = sources_cotangent[:tokens, :count, :width].reshape(sources.shape)
    inverse_cotangent = inverse_cotangent[:tokens, :count].reshape(inverse.shape)
    return (query_cotangent.astype(query.dtype), sources_cotangent,
            inverse_cotangent.astype(inverse.dtype), None)


_fused_read.defvjp(_forward, _backward)
