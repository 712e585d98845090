"""Looped depth (`model.loop_count` = R, `TransformerLM._loop`): R passes of L shared blocks equal
an unrolled stack of R·L blocks holding the L blocks repeated, the embedding re-injection is
x ← stack(x + x⁰), KV-cache decoding keeps one cache per (loop, layer), the books keep the
parameters and multiply the stack's FLOPs, and the early-exit probe reads the loss after each
pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.accounting import (
    flops_per_token,
    kv_cache_bytes_per_token,
    parameter_breakdown,
    parameter_count,
)
from arch.attention import ATTENTION
from arch.moe import AuxLoss, DroppedFraction
from config import ConfigError, resolve
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
)
from train.instruments.early_exit import early_exit_losses
from train.step import next_token_loss

T, LOOPS = 16, 3


def with_params_of(target, source, loops: int = 1):
    """`target` holding `source`'s parameters, its block stack repeated `loops` times."""
    params = nnx.to_pure_dict(nnx.state(source, nnx.Param))
    params["blocks"] = jax.tree.map(lambda x: jnp.concatenate([x] * loops), params["blocks"])
    state = nnx.state(target, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(target, state)
    return target


def total(model, kind) -> float:
    return sum(float(jnp.sum(leaf)) for leaf in jax.tree.leaves(nnx.state(model, kind)))


@pytest.mark.parametrize("fields", [dict(), dict(ffn="moe", moe__experts=4)],
                         ids=["dense", "moe"])
@pytest.mark.slow
def test_loops_equal_the_unrolled_stack_of_repeated_blocks(fields):
    _, looped = tiny_model(loop_count=LOOPS, **fields)
    _, unrolled = tiny_model(seed=1, num_layers=2 * LOOPS, **fields)
    unrolled = with_params_of(unrolled, looped, LOOPS)
    tokens = random_tokens((2, T))
    np.testing.assert_allclose(looped(tokens), unrolled(tokens), atol=2e-5, rtol=1e-5)
    if fields:  # MoE: the auxiliary losses sum over all R·L layers, the dropped fraction averages
        np.testing.assert_allclose(total(looped, AuxLoss), total(unrolled, AuxLoss), rtol=1e-5)
        np.testing.assert_allclose(total(looped, DroppedFraction) / 2,
                                   total(unrolled, DroppedFraction) / (2 * LOOPS), rtol=1e-5)


def test_one_loop_is_the_plain_model_and_injection_re_adds_the_embedding():
    _, plain = tiny_model()
    _, one = tiny_model(loop_count=1, loop_inject=True)
    tokens = random_tokens((2, T))
    np.testing.assert_array_equal(one(tokens), plain(tokens))
    assert init_cache_shape(one) == init_cache_shape(plain)
    # x¹ = stack(x⁰), x^r = stack(x^{r−1} + x⁰), by hand with the plain model's own stack.
    _, injected = tiny_model(loop_count=LOOPS, loop_inject=True)
    plain = with_params_of(plain, injected)
    positions = jnp.broadcast_to(jnp.arange(T), tokens.shape)
    x0 = plain.position.embed(plain.embed(tokens), positions)
    graphdef, params, states = nnx.split(plain.blocks, nnx.Param, ...)
    x, _ = plain._scan(x0, positions, graphdef, params, states, None)
    for _ in range(LOOPS - 1):
        x, _ = plain._scan(x + x0, positions, graphdef, params, states, None)
    np.testing.assert_allclose(injected(tokens), plain.logits_of_hidden(x), atol=2e-5, rtol=1e-5)


def test_the_stack_is_traced_once_whatever_the_loop_count():
    tokens = random_tokens((2, T))
    for loops in (2, 5):
        _, model = tiny_model(loop_count=loops, loop_inject=True)
        jaxpr = str(jax.make_jaxpr(lambda tokens, model=model: model(tokens))(tokens))
        assert jaxpr.count("scan[") == 2, loops  # the passes' scan around the layer scan


def init_cache_shape(model):
    return {name: value.shape for name, value in model.init_cache(2, T).items()}


@pytest.mark.parametrize("fields", [dict(), dict(attention__window=4)], ids=["full", "window"])
def test_decoding_keeps_one_cache_per_loop_and_layer_and_equals_the_forward_pass(fields):
    _, model = tiny_model(loop_count=LOOPS, loop_inject=True, **fields)
    assert {shape[:2] for shape in init_cache_shape(model).values()} == {(LOOPS, 2)}
    tokens = random_tokens((2, T))
    np.testing.assert_allclose(prefill_then_decode(JittedDecoder(model), tokens, 8, T),
                               model(tokens), atol=2e-5, rtol=1e-5)


def test_books_keep_the_parameters_and_multiply_the_stack():
    cfg, _ = tiny_model()
    looped, _ = tiny_model(loop_count=LOOPS)
    assert parameter_count(looped) == parameter_count(cfg)
    assert parameter_breakdown(looped) == parameter_breakdown(cfg)
    d, f, layers = cfg.d_model, cfg.ffn.d_ff, cfg.num_layers
    h, k, p = cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim
    block = (2 * h * p * d + 2 * d * k * p) + 3 * d * f  # attention + SwiGLU kernels
    per_pass = 2 * layers * block + layers * ATTENTION["mha"].score_flops_per_token(cfg, T)
    for training, factor in ((False, 1), (True, 3)):
        np.testing.assert_allclose(flops_per_token(looped, T, training),
                                   flops_per_token(cfg, T, training)
                                   + factor * (LOOPS - 1) * per_pass)
    assert kv_cache_bytes_per_token(looped) == LOOPS * kv_cache_bytes_per_token(cfg)


def test_early_exit_losses_are_the_losses_of_fewer_loops():
    tokens_BxT1 = random_tokens((2, T + 1))
    _, model = tiny_model(loop_count=LOOPS, loop_inject=True)
    losses = early_exit_losses(model, tokens_BxT1)
    assert losses.shape == (LOOPS,)
    for loops in range(1, LOOPS + 1):  # exit after pass r = the same parameters looped r times
        _, fewer = tiny_model(seed=1, loop_count=loops, loop_inject=True)
        fewer = with_params_of(fewer, model)
        expected = next_token_loss(fewer(tokens_BxT1[:, :-1]), tokens_BxT1[:, 1:])
        np.testing.assert_allclose(losses[loops - 1], expected, rtol=1e-5)
    assert len(set(losses.tolist())) == LOOPS


@pytest.mark.parametrize("fields, mesh, message", [
    (dict(loop_count=0), {}, "model.loop_count=0 is invalid: must be a positive integer"),
    (dict(loop_count=2, residual="hc"), {}, "single-stream model.residual.name .* got 'hc'"),
    (dict(loop_count=2, reversible=True), {}, "does not run reversible blocks"),
    (dict(loop_count=2), dict(data=1, stage=2), r"does not run in the pipeline \(mesh.stage=2\)"),
])
def test_config_errors(fields, mesh, message):
    config = tiny_config(**fields)
    config.mesh.update(mesh)
    with pytest.raises(ConfigError, match=message):
        config = resolve(config, 2 if mesh else 1)
