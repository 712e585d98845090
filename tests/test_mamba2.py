"""Mamba-2 (arch/mamba2.py): the chunked SSD form and the recurrence equal the quadratic form,
cached decoding equals the training forward, the accounting equals the built model, it trains,
and sharding does not change the numbers. It is its module, its record (with its rules and its
options' defaults) and its import line: no other library file names it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch import accounting
from arch.mamba2 import Mamba2, chunked_flops_per_token, ssd_chunked, ssd_recurrence
from config import ConfigError, resolve
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
    train_on_mesh,
)

MAMBA = dict(attention="mamba2", mamba2__state_dim=8, mamba2__chunk=4)


def quadratic_form(x, a, b, c, state=None):
    """y = (L ∘ C Bᵀ) X + diag(exp γ) C S₀ᵀ, L_ij = exp(γ_i − γ_j) for j ≤ i (γ the cumulative
    log-decays), with the explicit T×T matrix, and the final state
    exp(γ_T) S₀ + Σ_j exp(γ_T − γ_j) x_j b_jᵀ; float64 numpy."""
    x, a, b, c = (np.asarray(v, np.float64) for v in (x, a, b, c))
    batch, t, h, p = x.shape
    n = b.shape[-1]
    s0 = np.zeros((batch, h, p, n)) if state is None else np.asarray(state, np.float64)
    gamma = np.cumsum(a, axis=1)                                         # B×T×H
    mask = np.exp(gamma[:, :, None] - gamma[:, None, :])                 # B×T(i)×T(j)×H
    mask = mask * np.tril(np.ones((t, t)))[None, :, :, None]
    scores = np.einsum("bin,bjn->bij", c, b)
    y = np.einsum("bij,bijh,bjhp->bihp", scores, mask, x)
    y += np.exp(gamma)[..., None] * np.einsum("bhpn,bin->bihp", s0, c)
    to_end = np.exp(gamma[:, -1:] - gamma)                               # B×T×H
    final = (np.exp(gamma[:, -1])[..., None, None] * s0
             + np.einsum("bjhp,bjn,bjh->bhpn", x, b, to_end))
    return y, final


def random_inputs(dtype, batch=2, t=13, h=3, p=4, n=5, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (batch, t, h, p), dtype)
    a = -jax.nn.softplus(jax.random.normal(keys[1], (batch, t, h), dtype))  # log-decays < 0
    b = jax.random.normal(keys[2], (batch, t, n), dtype)
    c = jax.random.normal(keys[3], (batch, t, n), dtype)
    state = jax.random.normal(keys[4], (batch, h, p, n), dtype)
    return x, a, b, c, state


@pytest.mark.parametrize("chunk", [4, 5, 13, 64])  # T = 13: padded, exact, one short chunk
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_and_recurrent_forms_equal_the_quadratic_form_in_float64(chunk, with_state):
    with jax.enable_x64(True):
        x, a, b, c, state = random_inputs(jnp.float64)
        state = state if with_state else None
        expected_y, expected_state = quadratic_form(x, a, b, c, state)
        for form in (ssd_recurrence, lambda *args: ssd_chunked(*args, chunk=chunk)):
            y, final = jax.jit(form)(x, a, b, c, state)
            assert y.dtype == final.dtype == jnp.float64
            np.testing.assert_allclose(y, expected_y, rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(final, expected_state, rtol=1e-10, atol=1e-10)


def test_chunked_gradients_equal_the_recurrence_gradients():
    x, a, b, c, state = random_inputs(jnp.float32)

    def loss(form, *args):
        y, final = form(*args)
        return jnp.sum(jnp.sin(y)) + jnp.sum(final**2)

    chunked = lambda *args: ssd_chunked(*args, chunk=4)
    expected = jax.jit(jax.grad(lambda *v: loss(ssd_recurrence, *v), argnums=range(5)))(
        x, a, b, c, state)
    got = jax.jit(jax.grad(lambda *v: loss(chunked, *v), argnums=range(5)))(x, a, b, c, state)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("pattern", ["", "MA"])
@pytest.mark.slow
def test_cached_decoding_equals_the_training_forward(pattern):
    overrides = dict(MAMBA, layer_pattern=pattern, attention="mha") if pattern else MAMBA
    _, model = tiny_model(**overrides)
    tokens = random_tokens((2, 11))
    full = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
    decoded = prefill_then_decode(JittedDecoder(model), tokens, prefill=6, cache_length=11)
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-4)


def test_the_cache_is_the_state_and_convolution_tails_constant_in_length():
    cfg, model = tiny_model(**dict(MAMBA, attention="mha"), layer_pattern="MA")
    m = cfg.mamba2
    mamba, attention = model.init_cache(2, 50)
    assert mamba["state"].shape == (1, 2, m.num_heads, m.head_dim, m.state_dim)
    assert mamba["state"].dtype == jnp.float32
    assert mamba["x_conv"].shape == (1, 2, m.conv_width - 1, m.num_heads, m.head_dim)
    assert mamba["b_conv"].shape == mamba["c_conv"].shape == (1, 2, m.conv_width - 1, m.state_dim)
    assert attention["key"].shape[:3] == (1, 2, 50)
    assert model.init_cache(2, 7)[0]["state"].shape == mamba["state"].shape


def dot_flops(jaxpr) -> int:
    """FLOPs of every matrix product (`dot_general`) in a jaxpr, sub-programs included (a scan's
    body × its length)."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
                np.prod([lhs[i] for i in contracting]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += dot_flops(inner) * eqn.params.get("length", 1)
    return total


def test_accounting_is_the_built_models_parameters_and_flops():
    cfg, model = tiny_model(**MAMBA, attention__num_heads=4, num_layers=1)
    m, d = cfg.mamba2, cfg.d_model
    h, p, n, w = m.num_heads, m.head_dim, m.state_dim, m.conv_width
    layer = Mamba2(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    # Parameters: W_X, W_Z, W_B, W_C, W_Δ (+ b_Δ), log A, D, the three convolutions with their
    # biases, the norm gain and W_O; the accounting measures the built model's.
    expected = (d * (2 * h * p + 2 * n + h) + h + 2 * h + (w + 1) * (h * p + 2 * n) + h * p
                + h * p * d)
    assert sum(leaf.size for leaf in jax.tree.leaves(state)) == expected
    assert accounting.parameter_breakdown(cfg)["attention"] == expected
    # FLOPs per token: the matrix products of the built layer's forward, counted in its traced
    # program, are its Dense kernels twice and the chunked SSD's; the convolutions 2·W per
    # channel (their kernels' size); nothing is a score over keys.
    t = 16  # a multiple of the chunk: no padding
    x = jnp.zeros((2, t, d))
    jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x, None, None))(state, x)
    dense = 2 * (d * (2 * h * p + 2 * n + h) + h * p * d)
    assert dot_flops(jaxpr.jaxpr) / (2 * t) == dense + chunked_flops_per_token(h, p, n, m.chunk)
    convolutions = 2 * sum(conv.kernel.size for conv in (layer.x_conv, layer.b_conv,
                                                         layer.c_conv))
    assert Mamba2.score_flops_per_token(cfg, t) == (chunked_flops_per_token(h, p, n, m.chunk)
                                                    + convolutions)
    assert accounting.flops_per_token(cfg, t, training=False) == (
        2 * accounting.matmul_parameter_count(cfg) + Mamba2.score_flops_per_token(cfg, t))
    # The cache: no bytes per token, a constant state (float32) and convolution tails.
    assert accounting.kv_cache_bytes_per_token(cfg) == 0
    assert accounting.recurrent_state_bytes(cfg) == 4 * (h * p * n + (w - 1) * (h * p + 2 * n))


def train(devices: int, mesh: tuple[int, int, int], tokens):
    """(initial logits, 8 train steps' losses, the sharding of x_proj's kernel) of the tiny
    Mamba-2 LM on a data × fsdp × tensor mesh."""
    return train_on_mesh(MAMBA, devices, mesh, tokens,
                         ("attention", "x_proj", "kernel"), steps=8)


@pytest.fixture(scope="module")
def single_device():
    tokens = np.asarray(random_tokens((8, 17)))
    return tokens, train(1, (1, 1, 1), tokens)


@pytest.mark.slow
def test_it_trains(single_device):
    _, (_, losses, _) = single_device
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_sharded_2x2x2_equals_single_device(single_device):
    tokens, (logits_1, losses_1, _) = single_device
    logits, losses, spec = train(8, (2, 2, 2), tokens)
    assert spec == (None, "fsdp", "tensor", None)  # layers, d over fsdp, heads over tensor
    np.testing.assert_allclose(logits, logits_1, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(losses, losses_1, rtol=1e-4)


@pytest.mark.parametrize("overrides, mesh, message", [
    (dict(layer_pattern="MX"), {}, "model.layer_pattern='MX' is invalid: a string over A, L, M "
                                   "(L: gated_deltanet, M: mamba2, A: model.attention.name)"),
    (dict(MAMBA, mamba2__state_dim=0), {}, "model.mamba2.state_dim=0 is invalid"),
    (dict(MAMBA, mamba2__head_dim=6), {}, "model.mamba2.head_dim=6 is invalid: must divide "
                                          "2·model.d_model = 64"),
    (dict(MAMBA, mamba2__num_heads=3, mamba2__head_dim=6), dict(data=1, tensor=2),
     "model.mamba2.num_heads=3 is invalid: must be divisible by mesh.tensor=2"),
    (dict(MAMBA), dict(data=1, sequence=2),
     "mesh.sequence=2 is invalid: mamba2 blocks do not pass their state between sequence "
     "shards"),
    (dict(layer_pattern="MA", mamba2__state_dim=8), dict(data=1, sequence=2),
     "mamba2 blocks do not pass their state between sequence shards"),
    (dict(MAMBA, linear_bias=True), {}, "model.attention.name='mamba2' has no biases"),
])
def test_config_errors_are_one_line_before_jax(overrides, mesh, message):
    config = tiny_config(**overrides)
    config.mesh.update(mesh)
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(config, 2)
