"""Initialization schemes per parameter group (arch/init.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.init import INITS, group_init
from config import ConfigError, resolve
from experiments.common import use_deepnorm
from tests.helpers import random_tokens, tiny_config, tiny_model

FAN_IN, FAN_OUT = 256, 512


def resolved(layers: int = 6):
    cfg, _ = tiny_model(num_layers=layers)
    return cfg


@pytest.mark.parametrize("name,std", [
    ("fan_in", FAN_IN**-0.5),
    ("bert", 0.02),
    ("depth_scaled", (2 * 6 * FAN_IN) ** -0.5),
    ("xavier", (2 / (FAN_IN + FAN_OUT)) ** 0.5),
    ("deepnorm", (8 * 6) ** -0.25 * (2 / (FAN_IN + FAN_OUT)) ** 0.5),
])
def test_scheme_has_its_stated_standard_deviation(name, std):
    w = INITS[name](resolved(), FAN_IN, FAN_OUT)(jax.random.key(0), (FAN_IN, FAN_OUT), jnp.float32)
    assert float(jnp.std(w)) == pytest.approx(std, rel=0.02)
    assert float(jnp.abs(w).max()) <= 2 * std / 0.8796 + 1e-6  # truncated at two raw std


def test_zeros_and_group_overrides():
    cfg, model = tiny_model(init=dict(attention_output="zeros", ffn_output="zeros"))
    blocks = model.blocks
    assert not np.any(blocks.attention.output.kernel[...])
    assert not np.any(blocks.ffn.down.kernel[...])
    assert np.any(blocks.attention.query.kernel[...]) and np.any(blocks.ffn.up.kernel[...])
    # zero output projections: every block starts as the identity on the stream
    tokens = random_tokens((2, 16))
    stream = model.embed(tokens)
    graphdef, layers = nnx.split(model.blocks)
    block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], layers))
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    np.testing.assert_array_equal(block(stream, positions, model.position.rotate)[0], stream)


def test_use_deepnorm_scales_value_output_and_ffn_but_not_query_key():
    config = use_deepnorm(tiny_config(num_layers=6, d_model=64, attention__num_heads=4,
                                      attention__num_kv_heads=4))
    config.mesh.data = 1
    config = resolve(config, 1)
    from arch.model import TransformerLM

    model = TransformerLM(config.model, rngs=nnx.Rngs(0))
    beta = (8 * 6) ** -0.25
    attention, ffn = model.blocks.attention, model.blocks.ffn
    d, hp, f = 64, 64, config.model.ffn.d_ff
    expected = {attention.value: beta * (2 / (d + hp)) ** 0.5,
                attention.output: beta * (2 / (hp + d)) ** 0.5,
                ffn.up: beta * (2 / (d + f)) ** 0.5, ffn.down: beta * (2 / (f + d)) ** 0.5,
                attention.query: d**-0.5, attention.key: d**-0.5}
    for layer, std in expected.items():
        assert float(jnp.std(layer.kernel[...])) == pytest.approx(std, rel=0.1)
    assert config.model.residual.name == "deepnorm" and not config.model.norm.final


def test_group_init_uses_the_default_for_unset_groups():
    cfg, _ = tiny_model(num_layers=6, init=dict(default="bert"))
    w = group_init(cfg, "query")(FAN_IN, FAN_OUT)(jax.random.key(0), (FAN_IN, FAN_OUT),
                                                    jnp.float32)
    assert float(jnp.std(w)) == pytest.approx(0.02, rel=0.02)


@pytest.mark.parametrize("group", ["default", "value"])
def test_unknown_scheme_is_a_config_error(group):
    config = tiny_config()
    config.model.init[group] = "orthogonal"
    with pytest.raises(ConfigError, match=f"model.init.{group}='orthogonal' is invalid: valid "
                                          "inits: bert, deepnorm, depth_scaled, fan_in"):
        config = resolve(config, 1)
