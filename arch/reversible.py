"""Reversible residual blocks: activation memory for the backward pass O(1) in depth.

RevNet additive coupling (Gomez et al. 2017, "The Reversible Residual Network", eqs. 1-2 and
Alg. 1) in the Transformer layout of Reformer (Kitaev et al. 2020, §3), selected by
`model.reversible=True`:

    x₁ = x₂ = x⁰                                  (the embedding, on both streams)
    for each block:  y₁ = x₁ + F(x₂),   F(x) = attention(norm_attention(x))
                     y₂ = x₂ + G(y₁),   G(x) = ffn(norm_ffn(x))
    final norm and head read (y₁ + y₂) / 2

and the inverse (Gomez et al. eq. 2), which recovers a block's inputs from its outputs:

    x₂ = y₂ − G(y₁),   x₁ = y₁ − F(x₂).

Layout. "Channel split" is read as Reformer reads it: two d-wide streams, each the full model
width, rather than one d-wide stream cut into two d/2 halves. Every sublayer then keeps its
ordinary width and parameters (F and G are exactly the `Block`'s `attention` and `ffn` with their
Pre-Norm `read`), so a reversible model has the same parameters, initialization and FLOPs as the
ordinary Pre-Norm model and differs only in wiring; what is carried is 2·B·T·d per step of the
scan instead of B·T·d, independent of depth. Averaging the two streams at the end keeps the
output's scale that of one stream (both start equal to the embedding).

Backward pass (`jax.custom_vjp` over the whole layer scan, Alg. 1): the forward pass saves only
the stack's outputs (y₁, y₂), the stacked parameters and the positions. The backward pass scans
the layers in reverse; at each block it recomputes G(y₁) under `jax.vjp`, reconstructs x₂,
recomputes F(x₂) under `jax.vjp`, reconstructs x₁, and with output cotangents (ȳ₁, ȳ₂):

    x̄₂ = ȳ₂ + (∂F/∂x₂)ᵀ z̄₁,   x̄₁ = z̄₁ = ȳ₁ + (∂G/∂y₁)ᵀ ȳ₂,
    θ̄_G = (∂G/∂θ)ᵀ ȳ₂,        θ̄_F = (∂F/∂θ)ᵀ z̄₁.

Only one block's activations are alive at a time, so the activation memory of the gradient does
not grow with the number of layers (tests/test_reversible.py measures XLA's scratch memory of the
parameter gradient: flat from 2 to 16 layers). The parameter gradients themselves (one
parameter-sized buffer per layer) still grow with depth, as they must; inside a full train step
they are scratch memory too (`scripts/bench.py --depth_memory`). `execution.remat` has no effect
here: the custom backward pass already recomputes each block.

Dropout (`model.dropout`, arch/dropout.py): F and G take their layer's key data as an argument,
scanned with the parameters in both passes, so the backward pass recomputes F and G with the
masks of the forward pass (the inverse is exact only then) and the gradients equal ordinary
autodiff of the same masked coupling; F's output gets `attention_output` and `residual`, G's
`residual`. Non-parameter state (BatchNorm running statistics) is not supported
(`config.model_rules` rejects it). Precision: the reconstruction runs in the compute dtype; in
bfloat16 it is exact only up to rounding, which accumulates with depth (Gomez et al. §5), so
gradients are then approximate. Generation (`TransformerLM.decode` with a KV cache) runs the same
coupling forward only (`forward_with_cache`), without the custom backward pass.

No new parameters: initialization is that of the blocks' own modules.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from arch.dropout import Dropout
from arch.dropout import active as dropout_active
from sharding.rules import STREAM, constrain

Branch = Callable[[nnx.State, nnx.State, jax.Array, jax.Array], jax.Array]


def branches(graphdef, rotate, dropout: Dropout | None = None) -> tuple[Branch, Branch]:
    """The two coupling functions of one block, as pure functions of (params, states, x,
    positions): F(x) = attention(norm(x)) and G(x) = ffn(norm(x)), with the block's own modules.
    With `dropout` (the model's, arch/dropout.py) they are functions of (params, states, x,
    positions, key_data), the layer's key data from `dropout.layer_keys`, and drop as
    `Block.sublayer` does."""

    def sublayer_dropout(name, key_data):
        return None if dropout is None else dropout.from_key_data(key_data).sublayer(name)

    def attention_branch(params, states, x_BxTxD, positions_BxT, key_data=None):
        block = nnx.merge(graphdef, params, states)
        layer_dropout = sublayer_dropout("attention", key_data)
        with dropout_active(layer_dropout):
            update, _ = block.attention(block.attention_residual.read(x_BxTxD), positions_BxT,
                                        rotate, None)
        return update if layer_dropout is None else layer_dropout.output(update, "attention")

    def ffn_branch(params, states, x_BxTxD, positions_BxT, key_data=None):
        del positions_BxT
        block = nnx.merge(graphdef, params, states)
        layer_dropout = sublayer_dropout("ffn", key_data)
        with dropout_active(layer_dropout):
            update = block.ffn(block.ffn_residual.read(x_BxTxD))
        return update if layer_dropout is None else layer_dropout.output(update, "ffn")

    return attention_branch, ffn_branch


def couple(attention_branch: Branch, ffn_branch: Branch, params, states, x1_BxTxD, x2_BxTxD,
           positions_BxT, *key_data) -> tuple[jax.Array, jax.Array]:
    """One block forward: y₁ = x₁ + F(x₂), y₂ = x₂ + G(y₁), both streams constrained.
    `key_data`: the layer's dropout key data, when the branches drop."""
    y1_BxTxD = constrain(
        x1_BxTxD + attention_branch(params, states, x2_BxTxD, positions_BxT, *key_data), STREAM)
    y2_BxTxD = constrain(
        x2_BxTxD + ffn_branch(params, states, y1_BxTxD, positions_BxT, *key_data), STREAM)
    return y1_BxTxD, y2_BxTxD


def invert(attention_branch: Branch, ffn_branch: Branch, params, states, y1_BxTxD, y2_BxTxD,
           positions_BxT, *key_data) -> tuple[jax.Array, jax.Array]:
    """One block inverse: x₂ = y₂ − G(y₁), x₁ = y₁ − F(x₂)."""
    x2_BxTxD = constrain(
        y2_BxTxD - ffn_branch(params, states, y1_BxTxD, positions_BxT, *key_data), STREAM)
    x1_BxTxD = constrain(
        y1_BxTxD - attention_branch(params, states, x2_BxTxD, positions_BxT, *key_data), STREAM)
    return x1_BxTxD, x2_BxTxD


def reversible_stack(attention_branch: Branch, ffn_branch: Branch):
    """`stack(layer_params, layer_states, x1, x2, positions, layer_keys) -> (y1, y2)` over the
    stacked layers, with the memory-saving backward pass (module docstring). `layer_keys`: the
    layers' dropout key data (`Dropout.layer_keys`), scanned in both passes, or None."""

    def keys_of(layer_keys):  # one layer's key data as the branches' trailing argument
        return () if layer_keys is None else (layer_keys,)

    def forward(layer_params, layer_states, x1_BxTxD, x2_BxTxD, positions_BxT, layer_keys):
        def body(streams, layer):
            params, states, keys = layer
            return couple(attention_branch, ffn_branch, params, states, *streams,
                          positions_BxT, *keys_of(keys)), None

        streams, _ = jax.lax.scan(body, (x1_BxTxD, x2_BxTxD),
                                  (layer_params, layer_states, layer_keys))
        return streams

    def forward_saving_outputs(layer_params, layer_states, x1_BxTxD, x2_BxTxD, positions_BxT,
                               layer_keys):
        y1_BxTxD, y2_BxTxD = forward(layer_params, layer_states, x1_BxTxD, x2_BxTxD,
                                     positions_BxT, layer_keys)
        return (y1_BxTxD, y2_BxTxD), (layer_params, layer_states, y1_BxTxD, y2_BxTxD,
                                      positions_BxT, layer_keys)

    def backward(saved, cotangents):
        layer_params, layer_states, y1_BxTxD, y2_BxTxD, positions_BxT, layer_keys = saved

        def body(carry, layer):
            y1, y2, dy1, dy2 = carry
            params, states, keys = layer
            keys = keys_of(keys)  # the forward pass's masks, replayed
            g_y1, g_vjp = jax.vjp(
                lambda p, x: ffn_branch(p, states, x, positions_BxT, *keys), params, y1)
            x2 = constrain(y2 - g_y1, STREAM)  # x₂ = y₂ − G(y₁)
            dparams_g, dy1_through_g = g_vjp(dy2)
            dz1 = constrain(dy1 + dy1_through_g, STREAM)  # total cotangent of y₁ = x̄₁
            f_x2, f_vjp = jax.vjp(
                lambda p, x: attention_branch(p, states, x, positions_BxT, *keys), params, x2)
            x1 = constrain(y1 - f_x2, STREAM)  # x₁ = y₁ − F(x₂)
            dparams_f, dx2_through_f = f_vjp(dz1)
            dx2 = constrain(dy2 + dx2_through_f, STREAM)
            return (x1, x2, dz1, dx2), jax.tree.map(jnp.add, dparams_f, dparams_g)

        (_, _, dx1, dx2), dparams = jax.lax.scan(
            body, (y1_BxTxD, y2_BxTxD, *cotangents), (layer_params, layer_states, layer_keys),
            reverse=True)
        return dparams, None, dx1, dx2, None, None

    stack = jax.custom_vjp(forward)
    stack.defvjp(forward_saving_outputs, backward)
    return stack


def forward_with_cache(graphdef, layer_params, layer_states, x1_BxTxD, x2_BxTxD, positions_BxT,
                       rotate, cache):
    """The same coupling, forward only, threading each layer's KV cache (for `decode`)."""

    def body(streams, layer):
        params, states, layer_cache = layer
        x1, x2 = streams
        block = nnx.merge(graphdef, params, states)
        update, layer_cache = block.attention(block.attention_residual.read(x2), positions_BxT,
                                              rotate, layer_cache)
        y1 = constrain(x1 + update, STREAM)
        y2 = constrain(x2 + block.ffn(block.ffn_residual.read(y1)), STREAM)
        return (y1, y2), layer_cache

    streams, cache = jax.lax.scan(body, (x1_BxTxD, x2_BxTxD), (layer_params, layer_states, cache))
    return streams, cache


def run_reversible(graphdef, layer_params, layer_states, x_BxTxD, positions_BxT, rotate,
                   cache=None, dropout: Dropout | None = None):
    """The model-level entry: x⁰ on both streams, the stack, (y₁ + y₂)/2; and the cache.
    `dropout`: the model's (training; arch/dropout.py), or None."""
    x_BxTxD = constrain(x_BxTxD, STREAM)
    if cache is None:
        stack = reversible_stack(*branches(graphdef, rotate, dropout))
        layer_keys = None if dropout is None else dropout.layer_keys(
            jax.tree.leaves(layer_params)[0].shape[0])
        y1_BxTxD, y2_BxTxD = stack(layer_params, layer_states, x_BxTxD, x_BxTxD, positions_BxT,
                                   layer_keys)
    else:
        (y1_BxTxD, y2_BxTxD), cache = forward_with_cache(
            graphdef, layer_params, layer_states, x_BxTxD, x_BxTxD, positions_BxT, rotate, cache)
    return (y1_BxTxD + y2_BxTxD) / 2, cache
