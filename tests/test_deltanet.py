"""Gated DeltaNet (arch/deltanet.py): the chunked form equals the recurrence, decoding equals the
training forward, and hybrid layer patterns (`model.layer_pattern`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.deltanet import GatedDeltaNet, gated_delta_chunked, gated_delta_recurrence
from arch.model import BlockGroup
from config import ConfigError, resolve
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
)


def naive_gated_delta(q, k, v, g, beta, state=None):
    """S_t = α_t S_{t−1}(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t, written out with the
    explicit K×K matrix per token and head, in a Python loop (float64 numpy)."""
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    b, t, h, p_k = q.shape
    s = (np.zeros((b, h, v.shape[-1], p_k)) if state is None
         else np.array(state, np.float64))
    out = np.zeros((b, t, h, v.shape[-1]))
    eye = np.eye(p_k)
    for i in range(t):
        kk = np.einsum("bhk,bhl->bhkl", k[:, i], k[:, i])
        s = (np.exp(g[:, i])[..., None, None]
             * np.einsum("bhvk,bhkl->bhvl", s, eye - beta[:, i, :, None, None] * kk)
             + beta[:, i, :, None, None] * np.einsum("bhv,bhk->bhvk", v[:, i], k[:, i]))
        out[:, i] = np.einsum("bhvk,bhk->bhv", s, q[:, i])
    return out, s


def random_inputs(b=2, t=13, h=3, p_k=4, p_v=5, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q = unit(jax.random.normal(keys[0], (b, t, h, p_k)))
    k = unit(jax.random.normal(keys[1], (b, t, h, p_k)))
    v = jax.random.normal(keys[2], (b, t, h, p_v))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (b, t, h)))  # log α < 0
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
    state = jax.random.normal(keys[5], (b, h, p_v, p_k))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [4, 5, 13, 64])  # T = 13: padded, exact, one short chunk
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_and_recurrent_forms_equal_the_naive_recurrence(chunk, with_state):
    q, k, v, g, beta, state = random_inputs()
    state = state if with_state else None
    expected_out, expected_state = naive_gated_delta(q, k, v, g, beta, state)
    chunked = jax.jit(gated_delta_chunked, static_argnames="chunk")
    for out, final in (chunked(q, k, v, g, beta, state, chunk=chunk),
                       jax.jit(gated_delta_recurrence)(q, k, v, g, beta, state)):
        np.testing.assert_allclose(out, expected_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(final, expected_state, rtol=1e-5, atol=1e-5)


def test_chunked_gradients_equal_the_recurrence_gradients():
    inputs = random_inputs(t=11)
    weights = jax.random.normal(jax.random.key(9), (2, 11, 3, 5))

    def loss(form, *args):
        out, final = form(*args)
        return jnp.sum(out * weights) + jnp.sum(jnp.sin(final))

    chunked = jax.jit(jax.grad(lambda *a: loss(lambda *b: gated_delta_chunked(*b, chunk=4), *a),
                               argnums=tuple(range(6))))(*inputs)
    recurrent = jax.jit(jax.grad(lambda *a: loss(gated_delta_recurrence, *a),
                                 argnums=tuple(range(6))))(*inputs)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "state"), chunked, recurrent,
                               strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("pattern", [pytest.param("", marks=pytest.mark.slow), "LA"])
def test_decoding_token_by_token_equals_the_training_forward(pattern):
    overrides = dict(deltanet__chunk=4)
    overrides.update(layer_pattern=pattern) if pattern else overrides.update(
        attention="gated_deltanet")
    _, model = tiny_model(**overrides)
    tokens = random_tokens((2, 11))
    full = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
    decoded = prefill_then_decode(JittedDecoder(model), tokens, prefill=6, cache_length=11)
    np.testing.assert_allclose(decoded, full, rtol=1e-4, atol=1e-4)


def test_cache_is_the_recurrent_state_constant_in_length():
    cfg, model = tiny_model(layer_pattern="LA")
    cache = model.init_cache(2, 50)
    deltanet, attention = cache
    dn = cfg.deltanet
    assert deltanet["state"].shape == (1, 2, dn.num_heads, dn.value_dim, dn.head_dim)
    assert deltanet["state"].dtype == jnp.float32
    assert deltanet["key_conv"].shape == (1, 2, dn.conv_width - 1, dn.num_heads, dn.head_dim)
    assert attention["key"].shape[:3] == (1, 2, 50)
    assert model.init_cache(2, 7)[0]["state"].shape == deltanet["state"].shape


def test_layer_pattern_scans_one_group_per_pattern_unit():
    cfg, model = tiny_model(num_layers=4, layer_pattern="LA")
    assert model.stack_shape == (2, 2)
    assert isinstance(model.blocks, BlockGroup)
    assert isinstance(model.blocks.block_0.attention, GatedDeltaNet)
    assert type(model.blocks.block_1.attention).__name__ == "MultiHeadAttention"
    assert model.blocks.block_0.attention.query.kernel.shape == (2, 32, 4, 8)  # 2 groups stacked


def test_layer_pattern_composes_with_moe_interleaving():
    _, model = tiny_model(num_layers=4, layer_pattern="LA", ffn="moe", moe__every=4,
                          moe__experts=2)
    assert model.stack_shape == (1, 4)  # lcm(2, 4)
    kinds = [(type(getattr(model.blocks, f"block_{j}").attention).__name__,
              type(getattr(model.blocks, f"block_{j}").ffn).__name__) for j in range(4)]
    assert kinds == [("GatedDeltaNet", "SwiGLU"), ("MultiHeadAttention", "SwiGLU"),
                     ("GatedDeltaNet", "SwiGLU"), ("MultiHeadAttention", "MixtureOfExperts")]


@pytest.mark.parametrize("overrides, mesh, message", [
    (dict(layer_pattern="LX"), {}, "model.layer_pattern='LX' is invalid"),
    (dict(layer_pattern="LLA"), {}, "model.num_layers=2 must be a multiple of the pattern's "
                                     "length 3"),
    (dict(layer_pattern="LA", deltanet__chunk=0), {}, "model.deltanet.chunk=0 is invalid"),
    (dict(layer_pattern="LA"), dict(data=1, sequence=2),
     "gated_deltanet blocks do not pass their state between sequence shards"),
    (dict(attention="gated_deltanet", deltanet__num_heads=3), dict(data=1, tensor=2),
     "model.deltanet.num_heads=3 is invalid: must be divisible by mesh.tensor=2"),
])
def test_config_errors(overrides, mesh, message):
    config = tiny_config(**overrides)
    config.mesh.update(mesh)
    with pytest.raises(ConfigError, match=re.escape(message)):
        config = resolve(config, 2)


@pytest.mark.slow
def test_accounting_counts_the_state_not_a_kv_cache_and_no_attention_scores():
    from arch import accounting

    config = tiny_config(layer_pattern="LA")
    config = resolve(config, 1)
    cfg = config.model
    d, dn = cfg.d_model, cfg.deltanet
    h, k, v, w = dn.num_heads, dn.head_dim, dn.value_dim, dn.conv_width
    # The A block's keys and values only (2 KV heads of 8, float32); the L block: S and conv tails.
    assert accounting.kv_cache_bytes_per_token(cfg) == 2 * 2 * 8 * 4
    assert accounting.recurrent_state_bytes(cfg) == (h * v * k + (w - 1) * h * (2 * k + v)) * 4
    short, long = accounting.books(cfg, 8), accounting.books(cfg, 16)
    assert (short["kv_cache"]["recurrent_state_bytes_per_sequence"]
            == long["kv_cache"]["recurrent_state_bytes_per_sequence"])
    assert long["kv_cache"]["bytes_per_sequence"] == (
        16 * 2 * 2 * 8 * 4 + accounting.recurrent_state_bytes(cfg))
    # Parameters measured from the built model: W_Q, W_K, W_V, W_G, W_α (+ b_Δ), W_β, log A, the
    # three convolutions, the norm gain and W_O of the L block, beside the A block's MHA.
    deltanet = (d * h * (2 * k + 2 * v + 2) + 2 * h + w * h * (2 * k + v) + v + h * v * d)
    mha = d * 4 * 8 + 2 * d * 2 * 8 + 4 * 8 * d
    assert accounting.parameter_breakdown(cfg)["attention"] == deltanet + mha
    # FLOPs: the A block's causal scores and the L block's chunked form, never scores for L.
    mixing = (accounting.ATTENTION["mha"].score_flops_per_token(cfg, 16)
              + GatedDeltaNet.score_flops_per_token(cfg, 16))
    assert accounting.flops_per_token(cfg, 16, training=False) == (
        2 * accounting.matmul_parameter_count(cfg) + mixing)
    assert GatedDeltaNet.score_flops_per_token(cfg, 16) == h * (
        4 * 16 * k + 16 * (k + v) + 2 * 16 * v + 6 * k * v + 2 * w * (2 * k + v))


def test_the_traced_program_does_not_grow_with_depth():
    """One scan step holds one pattern unit: 2 and 4 layers of "LA" trace the same operations."""
    def operations(num_layers):
        _, model = tiny_model(num_layers=num_layers, layer_pattern="LA")
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state,
                                                                       random_tokens((1, 8)))
        text = str(jaxpr)
        return {name: text.count(name) for name in ("triangular_solve", "dot_general", "scan")}

    shallow, deep = operations(2), operations(4)
    assert shallow == deep
    assert shallow["triangular_solve"] == 2  # U' and W of the one Gated DeltaNet block


def test_probes_refuse_hybrid_stacks():
    from train.instruments.probes import require_probeable

    config = tiny_config(layer_pattern="LA")
    config = resolve(config, 1)
    with pytest.raises(ValueError, match="model.layer_pattern / gated_deltanet"):
        require_probeable(config.model)
