"""Model tests: tensor contracts, attention geometry, causality, KV cache, the pure-JAX oracle."""

import itertools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from arch import reference
from arch.accounting import flops_per_token, matmul_parameter_count, parameter_count
from arch.attention import MultiHeadAttention, causal_mask
from arch.norms import LayerNorm, RMSNorm
from arch.positions import POSITIONS, RoPE
from config import ConfigError
from tests.helpers import JittedDecoder, prefill_then_decode, random_tokens, tiny_model

VARIANTS = [dict(norm=n, position=p, ffn=f, head=h)
            for n, p, (f, h) in itertools.product(("rmsnorm", "layernorm"),
                                                   ("rope", "learned", "none"),
                                                   (("swiglu", "tied"), ("mlp", "untied")))]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v.values()))
def test_matches_reference_and_contract(variant):
    cfg, model = tiny_model(**variant)
    tokens = random_tokens((2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    expected = reference.logits(cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), tokens)
    np.testing.assert_allclose(logits, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal", "none"])
def test_causality_future_tokens_leave_the_past_exactly_unchanged(position):
    _, model = tiny_model(position=position)
    tokens = random_tokens((2, 16))
    changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % 256)
    before, after = model(tokens), model(changed)
    np.testing.assert_array_equal(before[:, :9], after[:, :9])
    assert not np.allclose(before[:, 9:], after[:, 9:])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_attention_head_geometry(heads, kv_heads):
    cfg, _ = tiny_model(attention__num_heads=heads, attention__num_kv_heads=kv_heads)
    attention = MultiHeadAttention(cfg, rngs=nnx.Rngs(0))
    d, p = cfg.d_model, cfg.attention.head_dim
    assert attention.query.kernel.shape == (d, heads, p)
    assert attention.key.kernel.shape == attention.value.kernel.shape == (d, kv_heads, p)
    assert attention.output.kernel.shape == (heads, p, d)
    # Grouping: K shared KV heads act like H heads whose K/V weights repeat each KV head G times.
    expanded = ml_collections.ConfigDict(cfg.to_dict())
    expanded.attention.num_kv_heads = heads
    mha = MultiHeadAttention(expanded, rngs=nnx.Rngs(1))
    for name in ("query", "output"):
        getattr(mha, name).kernel[...] = getattr(attention, name).kernel[...]
    for name in ("key", "value"):
        getattr(mha, name).kernel[...] = jnp.repeat(getattr(attention, name).kernel[...],
                                                    heads // kv_heads, axis=1)
    x = jax.random.normal(jax.random.key(2), (2, 8, d))
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    rotate = RoPE(cfg, rngs=nnx.Rngs(0)).rotate
    np.testing.assert_allclose(attention(x, positions, rotate)[0], mha(x, positions, rotate)[0],
                               atol=1e-5)


def test_attention_width_different_from_d_model():
    cfg, model = tiny_model(attention__num_heads=2, attention__head_dim=24, attention__width=48)
    assert model.blocks.attention.query.kernel.shape == (2, 32, 2, 24)  # layers, d, h, p
    tokens = random_tokens((2, 16))
    expected = reference.logits(cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), tokens)
    np.testing.assert_allclose(model(tokens), expected, atol=2e-5, rtol=1e-5)


def test_causal_mask_is_additive_zero_or_minus_infinity():
    positions = jnp.arange(4)[None]
    mask = causal_mask(positions, positions)[0]
    np.testing.assert_array_equal(mask == 0, np.tril(np.ones((4, 4), bool)))
    assert np.all(np.isneginf(mask[np.triu_indices(4, 1)]))


def test_rope_scores_depend_only_on_relative_position():
    cfg, _ = tiny_model()
    rope = RoPE(cfg, rngs=nnx.Rngs(0))
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, cfg.attention.head_dim))

    def score(t, s):
        rq = rope.rotate(q, jnp.array([[t]]))
        rk = rope.rotate(k, jnp.array([[s]]))
        return float(jnp.sum(rq * rk))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


@pytest.mark.parametrize("d", [6, 7])
def test_sinusoidal_positions_are_the_closed_form(d):
    """PE[t, 2i] = sin(t / 10000^{2i/d}), PE[t, 2i+1] = cos(t / 10000^{2i/d}) (Vaswani et al.
    2017 §3.5), added to the embedding, from the positions given (here not 0..T−1)."""
    cfg, _ = tiny_model(position="sinusoidal", d_model=d, attention__num_heads=1,
                        attention__num_kv_heads=1)
    positions = np.array([[0, 1, 5, 300]])
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, 4, d)))
    expected = np.zeros((4, d))
    for t, pos in enumerate(positions[0]):
        for j in range(d):
            angle = pos / 10_000 ** (2 * (j // 2) / d)
            expected[t, j] = np.sin(angle) if j % 2 == 0 else np.cos(angle)
    got = POSITIONS["sinusoidal"](cfg, rngs=nnx.Rngs(0)).embed(jnp.asarray(x), positions)
    np.testing.assert_allclose(got - x, expected[None], atol=1e-5)  # f32 angles up to ~300


def test_norms_shift_and_scale_properties():
    x = jax.random.normal(jax.random.key(0), (3, 16)) + 2.0
    rms, ln = RMSNorm(16, rngs=nnx.Rngs(0)), LayerNorm(16, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(ln(x + 5.0), ln(x), atol=1e-4)           # LayerNorm drops a shift
    assert not np.allclose(rms(x + 5.0), rms(x), atol=1e-2)             # RMSNorm does not
    for norm in (rms, ln):
        np.testing.assert_allclose(norm(3.7 * x), norm(x), atol=1e-4)  # positive rescaling
    np.testing.assert_allclose(ln(jnp.full((1, 16), 3.0)), 0.0, atol=1e-6)
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(rms(x) ** 2, -1)), 1.0, atol=1e-4)


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal"])
def test_kv_cache_decoding_equals_the_full_forward_pass(position):
    _, model = tiny_model(position=position, attention__num_kv_heads=1)
    tokens = random_tokens((2, 12))
    decoded = prefill_then_decode(JittedDecoder(model), tokens, prefill=7, cache_length=16)
    np.testing.assert_allclose(decoded, model(tokens), atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_unrolled_layer_scan_computes_the_same_logits_and_gradients():
    """`execution.scan_unroll` only changes how many layers one loop iteration runs (3 layers by 2:
    a remainder iteration), not the function or its gradient."""
    tokens = random_tokens((2, 8))

    def logits_and_grads(unroll):
        _, model = tiny_model(num_layers=3, execution__scan_unroll=unroll)
        loss = lambda m: jnp.mean(m(tokens) ** 2)
        return nnx.jit(lambda m: (m(tokens), nnx.grad(loss)(m)))(model)

    for got, expected in zip(jax.tree.leaves(logits_and_grads(2)),
                             jax.tree.leaves(logits_and_grads(1)), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=1e-5)
    with pytest.raises(ConfigError, match="execution.scan_unroll=0 is invalid"):
        tiny_model(execution__scan_unroll=0)


def test_bfloat16_compute_keeps_float32_parameters():
    cfg, model = tiny_model(dtype="bfloat16")
    tokens = random_tokens((2, 16))
    logits = model(tokens)
    assert logits.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    cfg32, model32 = tiny_model(dtype="float32")
    # same weights, lower precision: close but not identical
    diff = jnp.abs(logits - model32(tokens))
    assert 0 < float(diff.max()) < 0.1


def test_every_parameter_has_logical_axis_names():
    _, model = tiny_model(head="untied", position="learned", norm="layernorm")
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == variable[...].ndim and all(names), path


def test_parameter_count_equals_closed_form():
    # SwiGLU, GQA, tied head, RMSNorm: per block d·h·p + 2·d·k·p + h·p·d + 3·d·f + 2d
    cfg, _ = tiny_model(ffn__d_ff=48)
    d, h, k, p, f, v, layers = 32, 4, 2, 8, 48, 256, 2
    block = d * h * p + 2 * d * k * p + h * p * d + 3 * d * f + 2 * d
    assert parameter_count(cfg) == v * d + layers * block + d
    cfg, _ = tiny_model(ffn__d_ff=48, head="untied", norm="layernorm", ffn="mlp",
                        position="learned")
    block = d * h * p + 2 * d * k * p + h * p * d + 2 * d * f + 4 * d
    assert parameter_count(cfg) == v * d + 16 * d + layers * block + 2 * d + d * v


def test_flops_per_token_closed_form():
    cfg, _ = tiny_model(ffn__d_ff=48)
    d, h, k, p, f, v, layers, t = 32, 4, 2, 8, 48, 256, 2, 16
    matmul = layers * (d * h * p + 2 * d * k * p + h * p * d + 3 * d * f) + v * d
    assert matmul_parameter_count(cfg) == matmul
    assert flops_per_token(cfg, t) == 3 * (2 * matmul + layers * 2 * h * p * (t + 1))


def test_flops_count_reused_head_weights_and_mla_widths():
    cfg_mos, _ = tiny_model(head="mos", head__mos_components=3)
    cfg_moc, _ = tiny_model(head="moc", head__mos_components=3)
    v, d = 256, 32
    assert matmul_parameter_count(cfg_mos) - matmul_parameter_count(cfg_moc) == 2 * v * d
    cfg, _ = tiny_model(attention="mla", mla__kv_rank=16, mla__rope_dim=8, mla__nope_dim=6,
                        mla__v_dim=12)
    attention = 2 * 4 * (6 + 8 + 12) * (16 + 1)  # layers · H · (N + R + V) · (T + 1)
    assert flops_per_token(cfg, 16) == 3 * (2 * matmul_parameter_count(cfg) + attention)


def test_dense_contracts_one_token_axis_and_equals_tensordot():
    """Dense merges batch and time before its product, so its weight gradient contracts a single
    axis (XLA:CPU transposes the cotangent for two; arch/layers.py). Values and gradients equal
    the plain tensordot over B×T×(H, P) inputs."""
    from arch.layers import Dense

    graphdef, state = nnx.split(Dense((2, 3), (4,), ("heads", "head_dim"), ("embed",),
                                      rngs=nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (5, 7, 2, 3))

    def framework(state, x):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x)))

    def plain(kernel, x):
        return jnp.sum(jnp.sin(jnp.tensordot(x, kernel, 2)))

    kernel = state["kernel"][...]
    np.testing.assert_allclose(framework(state, x), plain(kernel, x), rtol=1e-6)
    got_state, got_x = jax.grad(framework, (0, 1))(state, x)
    want_kernel, want_x = jax.grad(plain, (0, 1))(kernel, x)
    np.testing.assert_allclose(got_state["kernel"][...], want_kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-6)
    jaxpr = jax.make_jaxpr(jax.grad(framework))(state, x)
    [weight_gradient] = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"
                         and eqn.outvars[0].aval.size == kernel.size]  # [4, 2, 3] or [2, 3, 4]
    (lhs_axes, rhs_axes), _ = weight_gradient.params["dimension_numbers"]
    assert len(lhs_axes) == len(rhs_axes) == 1
