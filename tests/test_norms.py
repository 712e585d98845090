"""New normalizations: ScaleNorm, DyT, GatedNorm, none, and FixNorm on the embedding.

Each test checks the defining property of its variant (an exact norm, an invariance or its
absence, equality with a hand computation from the parameters, the stated initialization), and
every new norm is run inside the full model: finite logits and exact causality.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.layers import Embedding
from arch.norms import (
    NORMS,
    DynamicTanh,
    GatedNorm,
    Identity,
    LayerNorm,
    RMSNorm,
    ScaleNorm,
    make_norm,
)
from config import ConfigError, resolve
from sharding.rules import LOGICAL_RULES
from tests.helpers import random_tokens, tiny_config, tiny_model

NEW_NORMS = ["none", "scalenorm", "dyt", "gatednorm"]
D = 32


def resolved(**model_overrides):
    config = tiny_config(**model_overrides)
    config = resolve(config, 1)
    return config.model


def inputs(seed: int = 0, shape=(2, 5, D), shift: float = 0.5) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape) * 3.0 + shift


def randomize(module: nnx.Module, seed: int = 7) -> None:
    """Replace every parameter by random values, so a hand computation sees non-trivial ones."""
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    for _, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        variable[...] = 0.5 + jax.random.uniform(next(keys), variable[...].shape)


def params_of(module: nnx.Module) -> dict:
    return {".".join(map(str, path)): np.asarray(v[...], np.float64)
            for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


# RMSNorm and LayerNorm: rematerialized ------------------------------------------------------------

@pytest.mark.parametrize("norm", [RMSNorm, LayerNorm], ids=["rmsnorm", "layernorm"])
def test_statistical_norm_gradients_equal_the_formula_and_keep_only_the_input(norm):
    """RMSNorm (eq. 4 of Zhang & Sennrich 2019) and LayerNorm recompute their statistics in the
    backward pass: gradients equal autodiff of the plain formula, and of the B×T×D arrays the VJP
    keeps only x (autodiff of the formula keeps more)."""
    module = norm(D, eps=1e-5, rngs=nnx.Rngs(0))
    randomize(module)
    graphdef, params = nnx.split(module)
    x, probe = inputs(1), inputs(2)

    def formula(params, x):
        p = {name: value[...] for name, value in params.items()}
        if norm is LayerNorm:
            x = x - x.mean(-1, keepdims=True)
        y = x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * p["scale"]
        return y + p["bias"] if norm is LayerNorm else y

    def module_call(params, x):
        return nnx.merge(graphdef, params)(x)

    (_, vjp), (_, formula_vjp) = jax.vjp(module_call, params, x), jax.vjp(formula, params, x)
    for got, expected in zip(jax.tree.leaves(vjp(probe)), jax.tree.leaves(formula_vjp(probe)),
                             strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    kept = [leaf for leaf in jax.tree.leaves(vjp) if leaf.shape == x.shape]
    assert len(kept) == 1 and kept[0] is x
    assert sum(leaf.shape == x.shape for leaf in jax.tree.leaves(formula_vjp)) >= 2


# ScaleNorm ----------------------------------------------------------------------------------------

def test_scalenorm_output_has_norm_g_and_is_scale_invariant():
    norm = ScaleNorm(D, rngs=nnx.Rngs(0))
    assert norm.scale[...].shape == (1,) and float(norm.scale[0]) == pytest.approx(D**0.5)
    x = inputs()
    np.testing.assert_allclose(jnp.linalg.norm(norm(x), axis=-1), D**0.5, rtol=1e-6)
    norm.scale[...] = jnp.array([2.5])  # the one learned scalar sets every token's norm
    np.testing.assert_allclose(jnp.linalg.norm(norm(x), axis=-1), 2.5, rtol=1e-6)
    np.testing.assert_allclose(norm(x), 2.5 * x / jnp.linalg.norm(x, axis=-1, keepdims=True),
                               rtol=1e-6)
    for factor in (0.01, 3.7, 1e4):
        np.testing.assert_allclose(norm(factor * x), norm(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(norm(jnp.zeros((1, D))), 0.0)  # the ε floor: no 0/0
    # g = √d at initialization: ScaleNorm starts as RMSNorm with unit gain (ε aside).
    np.testing.assert_allclose(ScaleNorm(D, eps=0.0, rngs=nnx.Rngs(0))(x),
                               RMSNorm(D, eps=0.0, rngs=nnx.Rngs(0))(x), rtol=1e-5, atol=1e-6)


# DyT ----------------------------------------------------------------------------------------------

def test_dyt_is_gamma_tanh_alpha_x_plus_beta_with_configured_alpha():
    cfg = resolved(norm="dyt", norm__dyt_alpha_init=0.8)
    norm = make_norm(cfg, rngs=nnx.Rngs(0))
    assert isinstance(norm, DynamicTanh)
    assert isinstance(norm.alpha, nnx.Param) and norm.alpha[...].shape == (1,)  # one scalar α
    assert float(norm.alpha[0]) == pytest.approx(0.8)
    assert float(DynamicTanh(D, rngs=nnx.Rngs(0)).alpha[0]) == 0.5  # the paper's default α₀
    x = inputs()
    np.testing.assert_allclose(norm(x), jnp.tanh(0.8 * x), rtol=1e-6)  # γ = 1, β = 0 at init
    randomize(norm)
    p, x64 = params_of(norm), np.asarray(x, np.float64)
    assert p["scale"].shape == p["bias"].shape == (D,)
    expected = p["scale"] * np.tanh(p["alpha"] * x64) + p["bias"]
    np.testing.assert_allclose(norm(x), expected, rtol=1e-5, atol=1e-6)


def test_dyt_is_not_scale_invariant_unlike_the_statistical_norms():
    x = inputs()
    dyt, rms = DynamicTanh(D, rngs=nnx.Rngs(0)), RMSNorm(D, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(rms(3.7 * x), rms(x), rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(dyt(3.7 * x) - dyt(x)))) > 0.1
    assert float(jnp.max(jnp.abs(dyt(100.0 * x)))) <= 1.0  # tanh saturates: |y| ≤ |γ| + |β|


# GatedNorm ----------------------------------------------------------------------------------------

def test_gatednorm_equals_rmsnorm_times_sigmoid_gate_by_hand():
    cfg = resolved(norm="gatednorm", norm__gated_rank=4)
    norm = make_norm(cfg, rngs=nnx.Rngs(0))
    assert isinstance(norm, GatedNorm)
    assert norm.scale[...].shape == (D,)
    assert norm.gate_down.kernel[...].shape == (D, 4) and norm.gate_up.kernel[...].shape == (4, D)
    x = inputs()
    rms = RMSNorm(D, eps=cfg.norm.eps, rngs=nnx.Rngs(0))
    # At initialization W_up = 0: the gate is exactly σ(0) = 1/2 for every feature and token.
    np.testing.assert_array_equal(norm.gate_up.kernel[...], 0.0)
    np.testing.assert_allclose(norm(x), 0.5 * rms(x), rtol=1e-6)
    randomize(norm)  # gain and W_down
    norm.gate_up.kernel[...] = 0.3 * jax.random.normal(jax.random.key(3), (4, D))
    p, x64 = params_of(norm), np.asarray(x, np.float64)
    n = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + cfg.norm.eps) * p["scale"]
    gate = 1 / (1 + np.exp(-(n @ p["gate_down.kernel"] @ p["gate_up.kernel"])))
    assert gate.min() < 0.25 and gate.max() > 0.75  # a real, feature-wise gate of both signs
    np.testing.assert_allclose(norm(x), n * gate, rtol=1e-5, atol=1e-6)


def test_gatednorm_rank_comes_from_config_and_must_be_positive():
    assert GatedNorm(D, rngs=nnx.Rngs(0)).gate_down.kernel[...].shape == (D, 16)  # default r
    norm = make_norm(resolved(norm="gatednorm", norm__gated_rank=3), dim=8, rngs=nnx.Rngs(0))
    assert norm.gate_up.kernel[...].shape == (3, 8)
    with pytest.raises(ConfigError, match=r"^model.norm.gated_rank=0 is invalid: must be a "):
        resolved(norm="gatednorm", norm__gated_rank=0)


# none ---------------------------------------------------------------------------------------------

def test_none_is_the_identity_without_parameters():
    norm = make_norm(resolved(norm="none"), rngs=nnx.Rngs(0))
    assert isinstance(norm, Identity)
    assert jax.tree.leaves(nnx.state(norm, nnx.Param)) == []
    x = inputs().astype(jnp.bfloat16)
    assert norm(x) is x


def test_make_norm_builds_the_configured_norm_with_its_options():
    for name in ["rmsnorm", "layernorm", *NEW_NORMS]:
        norm = make_norm(resolved(norm=name), dim=8, rngs=nnx.Rngs(0))
        assert type(norm) is NORMS[name]
        x = inputs(shape=(3, 8)).astype(jnp.bfloat16)
        assert norm(x).shape == x.shape and norm(x).dtype == jnp.bfloat16  # compute dtype kept
    with pytest.raises(ConfigError, match=r"^model.norm.dyt_alpha_init=0.0 is invalid"):
        resolved(norm="dyt", norm__dyt_alpha_init=0.0)


# FixNorm ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [None, 3.0])
def test_fixnorm_rows_have_the_fixed_norm_in_lookup_and_tied_head(scale):
    table = Embedding(256, D, rngs=nnx.Rngs(0), fixnorm=True, fixnorm_scale=scale)
    g = 1.0 if scale is None else scale  # the default: unit-length rows
    tokens = random_tokens((2, 16))
    np.testing.assert_allclose(jnp.linalg.norm(table(tokens), axis=-1), g, rtol=1e-6)
    e = np.asarray(table.embedding[...], np.float64)
    normalized = g * e / np.linalg.norm(e, axis=-1, keepdims=True)
    np.testing.assert_allclose(table(tokens), normalized[np.asarray(tokens)], rtol=1e-6)
    x = inputs(shape=(2, 3, D))
    np.testing.assert_allclose(table.attend(x), np.asarray(x, np.float64) @ normalized.T,
                               rtol=1e-5, atol=1e-5)
    plain = Embedding(256, D, rngs=nnx.Rngs(0))  # same table, FixNorm off: raw rows
    np.testing.assert_array_equal(plain.embedding[...], table.embedding[...])
    np.testing.assert_allclose(plain(tokens), e[np.asarray(tokens)], rtol=1e-6)
    assert not np.allclose(jnp.linalg.norm(plain(tokens), axis=-1), g, rtol=1e-2)


def test_fixnorm_needs_a_tied_head():
    with pytest.raises(ConfigError,
                       match=r"^model.fixnorm=True is invalid: .*model.head.name='tied'"):
        resolved(fixnorm=True, head="untied")
    with pytest.raises(ConfigError, match=r"^model.fixnorm_scale=-1.0 is invalid"):
        resolved(fixnorm=True, fixnorm_scale=-1.0)
    assert resolved(fixnorm=True).fixnorm


# Composition with the full model ------------------------------------------------------------------

def assert_finite_and_causal(model) -> None:
    tokens = random_tokens((2, 16))
    changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % 256)
    before, after = model(tokens), model(changed)
    assert before.shape == (2, 16, 256) and before.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(before)))
    np.testing.assert_array_equal(before[:, :9], after[:, :9])
    assert not np.allclose(before[:, 9:], after[:, 9:])


@pytest.mark.parametrize("name", NEW_NORMS)
def test_new_norms_compose_with_the_model(name):
    _, model = tiny_model(norm=name)
    assert type(model.final_norm) is NORMS[name]
    assert type(model.blocks.attention_residual.norm) is NORMS[name]
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == variable[...].ndim and all(n in LOGICAL_RULES for n in names), path
    assert_finite_and_causal(model)


def test_fixnorm_composes_with_the_model():
    cfg, model = tiny_model(fixnorm=True)
    assert model.embed.fixnorm_scale == 1.0
    assert_finite_and_causal(model)
