"""FFN tests: activations against their closed forms, each FFN against its equation computed by
hand, the hidden-width rule and its parameter budget, composition with the model, bad names."""

import math

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from arch.ffn import ACTIVATIONS, FFNS, activation
from config import ConfigError, catalogue, resolve
from config.model_rules import FFN_WIDTHS, resolve_model
from experiments.common import model_config
from tests.helpers import override, random_tokens, tiny_config, tiny_model


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


CLOSED_FORMS = {  # float64 numpy, independent of the jax implementations
    "relu": lambda x: np.maximum(x, 0),
    "gelu": _gelu_tanh,
    "silu": lambda x: x * _sigmoid(x),
    "leaky_relu": lambda x: np.where(x >= 0, x, 0.01 * x),  # default slope
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "hardtanh": lambda x: np.clip(x, -1, 1),
}
GATE_OF = {"glu": "sigmoid", "reglu": "relu", "geglu": "gelu", "swiglu": "silu"}
GATED = sorted(GATE_OF)
GRID = np.concatenate([np.linspace(-6, 6, 241), [-1.0, 1.0, -1e-3, 1e-3, 0.0]]).astype(np.float32)


def _resolved(**overrides) -> ml_collections.ConfigDict:
    cfg = model_config()
    cfg.d_model = 32
    override(cfg, **overrides)
    resolve_model(cfg)
    return cfg


def _ffn(cfg, seed: int = 0):
    return FFNS[cfg.ffn.name](ml_collections.FrozenConfigDict(cfg), rngs=nnx.Rngs(seed))


def _kernel(module) -> np.ndarray:
    return np.asarray(module.kernel[...], np.float64)


def _param_count(cfg) -> int:
    module = nnx.eval_shape(lambda: _ffn(cfg))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def test_every_activation_and_ffn_is_covered_here():
    assert set(ACTIVATIONS) == set(CLOSED_FORMS)
    assert set(FFNS) == {"mlp", "moe", *GATED}  # moe: tests/test_moe.py
    projections = {name: catalogue.record("ffn", name).projections for name in FFNS}
    assert projections == {"mlp": 2, "moe": 3, **{name: 3 for name in GATED}}


@pytest.mark.parametrize("name", sorted(CLOSED_FORMS))
def test_activation_matches_its_closed_form(name):
    phi = activation(_resolved(ffn__activation=name))
    np.testing.assert_allclose(phi(GRID), CLOSED_FORMS[name](GRID.astype(np.float64)),
                               atol=2e-6, rtol=1e-5)


def test_leaky_relu_slope_and_hardtanh_clip_points():
    phi = activation(_resolved(ffn__activation="leaky_relu", ffn__leaky_relu_slope=0.2))
    np.testing.assert_allclose(phi(GRID), np.where(GRID >= 0, GRID, 0.2 * GRID), rtol=1e-6)
    np.testing.assert_array_equal(phi(np.float32([-5.0, 0.0, 3.0])), np.float32([-1.0, 0, 3]))
    hardtanh = ACTIVATIONS["hardtanh"]
    np.testing.assert_array_equal(hardtanh(np.float32([-7, -1, -0.5, 0.5, 1, 7])),
                                  np.float32([-1, -1, -0.5, 0.5, 1, 1]))


@pytest.mark.parametrize("name", GATED)
def test_gated_ffn_equals_its_equation_by_hand(name):
    cfg = _resolved(ffn=name,
                    ffn__activation="tanh")  # model.ffn.activation must not matter for gates
    ffn = _ffn(cfg)
    x = np.asarray(jax.random.normal(jax.random.key(3), (2, 5, cfg.d_model)), np.float64)
    w, v, w2 = _kernel(ffn.gate), _kernel(ffn.up), _kernel(ffn.down)
    assert w.shape == v.shape == (cfg.d_model, cfg.ffn.d_ff) and w2.shape == (cfg.ffn.d_ff,
                                                                              cfg.d_model)
    expected = (CLOSED_FORMS[GATE_OF[name]](x @ w) * (x @ v)) @ w2
    np.testing.assert_allclose(ffn(x.astype(np.float32)), expected, atol=1e-5, rtol=1e-5)
    for layer in (ffn.gate, ffn.up, ffn.down):
        assert layer.kernel.get_metadata()["out_sharding"] in (("embed", "mlp"), ("mlp", "embed"))


@pytest.mark.parametrize("name", sorted(CLOSED_FORMS))
def test_mlp_equals_its_equation_by_hand(name):
    slope = 0.01 if name != "leaky_relu" else 0.2
    cfg = _resolved(ffn="mlp", ffn__activation=name, ffn__leaky_relu_slope=slope)
    ffn = _ffn(cfg)
    x = np.asarray(jax.random.normal(jax.random.key(4), (2, 5, cfg.d_model)), np.float64)
    phi = CLOSED_FORMS[name] if name != "leaky_relu" else (lambda h: np.where(h >= 0, h, 0.2 * h))
    expected = phi(x @ _kernel(ffn.up)) @ _kernel(ffn.down)
    np.testing.assert_allclose(ffn(x.astype(np.float32)), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("d,ratio", [(32, 4.0), (48, 8 / 3), (64, 2.5), (96, 4.0)])
@pytest.mark.parametrize("name", GATED)
def test_match_mlp_width_keeps_the_two_projection_parameter_budget(name, d, ratio):
    mlp = _resolved(d_model=d, ffn__ratio=ratio, ffn="mlp", ffn__width="match_mlp")
    assert mlp.ffn.d_ff == round(ratio * d)  # non-gated: match_mlp is the ratio
    gated = _resolved(d_model=d, ffn__ratio=ratio, ffn=name, ffn__width="match_mlp")
    assert gated.ffn.d_ff == round(2 / 3 * ratio * d)
    assert _param_count(gated) == 3 * d * gated.ffn.d_ff
    assert abs(_param_count(gated) - _param_count(mlp)) <= 3 * d
    assert abs(_param_count(gated) - _param_count(mlp)) <= 0.01 * _param_count(mlp)  # within 1%


@pytest.mark.parametrize("name", GATED)
def test_ratio_width_and_explicit_d_ff(name):
    gated = _resolved(ffn=name)  # default width: ratio
    mlp = _resolved(ffn="mlp")
    assert gated.ffn.d_ff == mlp.ffn.d_ff == 128
    assert (_param_count(gated), _param_count(mlp)) == (3 * 32 * 128, 2 * 32 * 128)
    for width in FFN_WIDTHS:
        assert _resolved(ffn=name, ffn__width=width, ffn__d_ff=50,
                         ffn__multiple_of=16).ffn.d_ff == 50


@pytest.mark.parametrize("multiple", [1, 8, 64, 100])
def test_ffn_multiple_of_rounds_a_derived_width_up(multiple):
    unrounded = round(2 / 3 * 4 * 32)  # 85
    d_ff = _resolved(ffn="swiglu", ffn__width="match_mlp", ffn__multiple_of=multiple).ffn.d_ff
    assert d_ff % multiple == 0 and unrounded <= d_ff < unrounded + multiple
    mlp_d_ff = _resolved(ffn="mlp", ffn__multiple_of=multiple).ffn.d_ff
    assert mlp_d_ff == multiple * math.ceil(128 / multiple)


COMPOSITIONS = ([("mlp", a) for a in sorted(CLOSED_FORMS)] + [(n, "gelu") for n in GATED])


@pytest.mark.parametrize("ffn,act", COMPOSITIONS, ids=lambda v: v)
def test_each_ffn_composes_with_the_model_finite_and_causal(ffn, act):
    cfg, model = tiny_model(ffn=ffn, ffn__activation=act, ffn__width="match_mlp")
    assert cfg.ffn.d_ff == (128 if ffn == "mlp" else 85)
    tokens = random_tokens((2, 16))
    changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % 256)
    before, after = model(tokens), model(changed)
    assert np.all(np.isfinite(before))
    np.testing.assert_array_equal(before[:, :9], after[:, :9])
    assert not np.allclose(before[:, 9:], after[:, 9:])


def test_same_config_gives_equal_graph_definitions():
    # Module attributes that are functions are static (part of the graphdef, i.e. a jit cache
    # key): two builds of one config, the bound leaky slope included, must compare equal.
    cfg = ml_collections.FrozenConfigDict(_resolved(ffn="mlp", ffn__activation="leaky_relu",
                                                    ffn__leaky_relu_slope=0.3))
    first, second = (nnx.graphdef(FFNS["mlp"](cfg, rngs=nnx.Rngs(s))) for s in (0, 1))
    assert first == second and hash(first) == hash(second)


@pytest.mark.parametrize("field,value,valid", [
    ("name", "geglu2", FFNS), ("activation", "swish", ACTIVATIONS),
    ("width", "match", FFN_WIDTHS), ("multiple_of", 0, ["positive integer"]),
])
def test_bad_names_give_one_line_listing_the_valid_ones(field, value, valid):
    config = tiny_config(**{f"ffn__{field}": value})
    with pytest.raises(ConfigError) as error:
        config = resolve(config, 1)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"model.ffn.{field}={value!r} is invalid")
    assert all(name in message for name in valid)
