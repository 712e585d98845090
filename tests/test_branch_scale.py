"""Branch scaling (arch/branch_scale.py): LayerScale's γ ⊙ F and the fixed c·F act on the branch
before the residual mechanism writes, under Pre-Norm and Post-Norm; their initial values follow
CaiT's depth rule and 1/√(2L); γ stays out of weight decay; accounting sees γ."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.accounting import parameter_breakdown
from arch.residual import MixingParam
from config import ConfigError, resolve
from tests.helpers import random_tokens, tiny_config, tiny_model
from train.optim import decay_mask


def with_parameters_of(model, source):
    """`model` with every parameter it shares (by path) with `source` copied from it."""
    shared = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path in shared:
            variable[...] = shared[path][...]
    return model


def set_gammas(model, value: float) -> None:
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "gamma":
            variable[...] = jnp.full(variable.shape, value)


@pytest.mark.parametrize("residual", ["prenorm", "postnorm"])
def test_unit_gamma_is_the_plain_model_and_constant_gamma_is_the_fixed_multiplier(residual):
    tokens = random_tokens((2, 12))
    _, plain = tiny_model(residual=residual)
    _, scaled = tiny_model(residual=residual, branch_scale="layerscale")
    scaled = with_parameters_of(scaled, plain)
    set_gammas(scaled, 1.0)
    np.testing.assert_allclose(scaled(tokens), plain(tokens), atol=1e-6)
    set_gammas(scaled, 0.3)
    _, fixed = tiny_model(residual=residual, branch_scale=dict(name="fixed", multiplier=0.3))
    fixed = with_parameters_of(fixed, plain)
    np.testing.assert_allclose(fixed(tokens), scaled(tokens), atol=1e-6)
    assert not np.allclose(fixed(tokens), plain(tokens), atol=1e-3)


def test_a_zero_branch_scale_leaves_only_the_skip_path():
    """γ = 0 under Pre-Norm: every block is the identity, so the logits are the embedding's
    through the final norm and head alone, whatever the blocks' weights."""
    tokens = random_tokens((2, 12))
    _, model = tiny_model(branch_scale="layerscale")
    set_gammas(model, 0.0)
    expected = model.head(model.final_norm(model.embed(tokens)), model.embed)
    np.testing.assert_allclose(model(tokens), expected, atol=1e-6)


@pytest.mark.parametrize("layers,gamma", [(4, 0.1), (18, 0.1), (24, 1e-5), (36, 1e-6)])
def test_layerscale_starts_at_the_cait_value_for_its_depth(layers, gamma):
    config = tiny_config(branch_scale="layerscale", num_layers=layers)
    config = resolve(config, 1)
    assert config.model.branch_scale.layerscale_init == gamma


@pytest.mark.parametrize("use_ffn,sublayers", [(True, 8), (False, 4)])
def test_fixed_multiplier_defaults_to_one_over_root_sublayers(use_ffn, sublayers):
    config = tiny_config(branch_scale="fixed", num_layers=4, use_ffn=use_ffn)
    config = resolve(config, 1)
    assert config.model.branch_scale.multiplier == pytest.approx(sublayers ** -0.5)


def test_gamma_is_a_per_channel_mixing_weight_kept_out_of_decay_and_counted():
    cfg, model = tiny_model(branch_scale="layerscale")
    gammas = [(path, v) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
              if path[-1] == "gamma"]
    assert len(gammas) == 2  # attention and FFN branch, stacked over the layers
    for _, gamma in gammas:
        assert isinstance(gamma, MixingParam)
        assert gamma.shape == (cfg.num_layers, cfg.d_model)
        np.testing.assert_array_equal(gamma[...], np.float32(0.1))
    config = tiny_config()
    mask = nnx.to_flat_state(decay_mask(config.optimizer, nnx.state(model, nnx.Param)))
    assert not any(decayed.get_value() for path, decayed in mask if path[-1] == "gamma")
    assert all(decayed.get_value() for path, decayed in mask if path[-1] == "kernel")
    plain_cfg, _ = tiny_model()
    added = parameter_breakdown(cfg)["residual"] - parameter_breakdown(plain_cfg)["residual"]
    assert added == 2 * cfg.num_layers * cfg.d_model


def test_bad_branch_scale_fields_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"^model\.branch_scale\.name='gamma' is invalid: "
                                          r"valid: none, layerscale, fixed$"):
        resolve(tiny_config(branch_scale="gamma"), 1)
    with pytest.raises(ConfigError, match=r"^model\.branch_scale\.multiplier=0\.0 is invalid"):
        resolve(tiny_config(branch_scale=dict(name="fixed", multiplier=0.0)), 1)
    with pytest.raises(ConfigError, match=r"^model\.reversible=True is invalid: reversible "
                                          r"blocks do not scale their branches"):
        resolve(tiny_config(branch_scale="layerscale", reversible=True), 1)
