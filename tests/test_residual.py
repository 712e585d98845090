"""Residual placements (Pre-Norm, Post-Norm, DeepNorm) and the rank-collapse ablation switches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.init import INITS
from arch.norms import LayerNorm
from arch.residual import RESIDUALS
from tests.helpers import random_tokens, tiny_config, tiny_model
from train.config import validate


def mechanism(name, **overrides):
    cfg, _ = tiny_model(norm="layernorm", **overrides)
    return cfg, RESIDUALS[name](cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", ["prenorm", "postnorm", "deepnorm", "noskip"])
def test_read_and_write_follow_their_equations(name):
    cfg, residual = mechanism(name, num_layers=6)
    x, y = jax.random.normal(jax.random.key(0), (2, 2, 5, cfg.d_model))
    norm = LayerNorm(cfg.d_model, eps=cfg.norm_eps, rngs=nnx.Rngs(0))
    alpha = (2 * 6) ** 0.25
    expected_read = {"prenorm": norm(x), "noskip": norm(x)}.get(name, x)
    expected_write = {"prenorm": x + y, "postnorm": norm(x + y), "deepnorm": norm(alpha * x + y),
                      "noskip": y}[name]
    np.testing.assert_allclose(residual.read(x), expected_read, atol=1e-6)
    np.testing.assert_allclose(residual.write(x, y), expected_write, atol=1e-6)


@pytest.mark.parametrize("residual,use_ffn", [("postnorm", True), ("deepnorm", True),
                                              ("noskip", True), ("noskip", False),
                                              ("prenorm", False)])
def test_placements_compose_with_the_model_and_stay_causal(residual, use_ffn):
    _, model = tiny_model(residual=residual, use_ffn=use_ffn, final_norm=residual == "prenorm")
    tokens = random_tokens((2, 16))
    changed = tokens.at[:, 11:].set((tokens[:, 11:] + 3) % 256)
    before, after = model(tokens), model(changed)
    assert np.isfinite(before).all()
    np.testing.assert_array_equal(before[:, :11], after[:, :11])
    assert ("ffn" in nnx.state(model.blocks)) == use_ffn


def distance_from_rank_one(x_TxD):
    """‖X − 1x̄ᵀ‖ / ‖X‖ with x̄ the mean token (Dong et al. 2021's residual, normalized)."""
    return float(jnp.linalg.norm(x_TxD - x_TxD.mean(0)) / jnp.linalg.norm(x_TxD))


def per_depth_distances(model, tokens):
    graphdef, layers = nnx.split(model.blocks)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    x = model.embed(tokens)
    distances = [distance_from_rank_one(x[0])]
    for i in range(model.cfg.num_layers):
        block = nnx.merge(graphdef, jax.tree.map(lambda s, i=i: s[i], layers))
        x, _ = block(x, positions, model.position.rotate)
        distances.append(distance_from_rank_one(x[0]))
    return distances


def test_pure_attention_without_skips_collapses_toward_rank_one():
    tokens = random_tokens((1, 16))
    _, pure = tiny_model(residual="noskip", use_ffn=False, num_layers=8, position="none")
    _, skip = tiny_model(residual="prenorm", use_ffn=False, num_layers=8, position="none")
    collapsing, kept = per_depth_distances(pure, tokens), per_depth_distances(skip, tokens)
    # Causal attention with a token-local norm: monotone, roughly geometric decay (the first token
    # only ever sees itself, so the collapse is slower than the paper's doubly exponential bound).
    assert all(b < a for a, b in zip(collapsing, collapsing[1:], strict=False))
    assert collapsing[-1] < 0.1 * collapsing[0]
    assert kept[-1] > 0.3 * kept[0] and collapsing[-1] < 0.25 * kept[-1]  # skips keep diversity


@pytest.mark.parametrize("blocks", [1, 6, 24, 100])
def test_deepnorm_constants(blocks):
    config = tiny_config(num_layers=blocks, residual="deepnorm")
    validate(config, 1)
    assert RESIDUALS["deepnorm"](config.model, rngs=nnx.Rngs(0)).alpha == pytest.approx(
        (2 * blocks) ** 0.25)
    weights = INITS["deepnorm"](config.model, 256, 256)(jax.random.key(0), (256, 256),
                                                        jnp.float32)
    beta = (8 * blocks) ** -0.25
    assert float(jnp.std(weights)) == pytest.approx(beta * (2 / 512) ** 0.5, rel=0.02)
