"""Residual placements (Pre-Norm, Post-Norm, DeepNorm, no skip) and the ablation switches (the
rank collapse of a pure-attention stack without skips is measured in tests/test_probes.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.init import INITS
from arch.norms import LayerNorm
from arch.residual import RESIDUALS
from config import resolve
from tests.helpers import random_tokens, tiny_config, tiny_model


def mechanism(name, **overrides):
    cfg, _ = tiny_model(norm="layernorm", **overrides)
    return cfg, RESIDUALS[name](cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("name", ["prenorm", "postnorm", "deepnorm", "noskip"])
def test_read_and_write_follow_their_equations(name):
    cfg, residual = mechanism(name, num_layers=6)
    x, y = jax.random.normal(jax.random.key(0), (2, 2, 5, cfg.d_model))
    norm = LayerNorm(cfg.d_model, eps=cfg.norm.eps, rngs=nnx.Rngs(0))
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
    _, model = tiny_model(residual=residual, use_ffn=use_ffn, norm__final=residual == "prenorm")
    tokens = random_tokens((2, 16))
    changed = tokens.at[:, 11:].set((tokens[:, 11:] + 3) % 256)
    before, after = model(tokens), model(changed)
    assert np.isfinite(before).all()
    np.testing.assert_array_equal(before[:, :11], after[:, :11])
    assert ("ffn" in nnx.state(model.blocks)) == use_ffn


@pytest.mark.parametrize("blocks", [1, 6, 24, 100])
def test_deepnorm_constants(blocks):
    config = tiny_config(num_layers=blocks, residual="deepnorm")
    config = resolve(config, 1)
    assert RESIDUALS["deepnorm"](config.model, rngs=nnx.Rngs(0)).alpha == pytest.approx(
        (2 * blocks) ** 0.25)
    weights = INITS["deepnorm"](config.model, 256, 256)(jax.random.key(0), (256, 256),
                                                        jnp.float32)
    beta = (8 * blocks) ** -0.25
    assert float(jnp.std(weights)) == pytest.approx(beta * (2 / 512) ** 0.5, rel=0.02)
