"""Attention implementations (arch/kernels/attention_implementations.py): `blocked` equals the
explicit `xla` path in values and gradients (causal, GQA/MQA, MLA widths, windows, any position
order, KV-cache decoding), skips fully masked tiles, and keeps its memory linear in T; `auto`'s
rule; the accelerator kernels against the explicit path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.attention import (
    AttentionWeights,
    MultiHeadAttention,
    attend,
    dot_product_attention,
)
from arch.kernels.attention_implementations import (
    BLOCKED_FROM_LENGTH,
    allowed_mask,
    blocked_attention,
    choose_implementation,
    cudnn_attention,
    splash_attention,
)
from config import ConfigError
from sharding.sequence import stripe_order
from tests.helpers import JittedDecoder, prefill_then_decode, random_tokens, tiny_model
from tests.test_sequence_parallel import loss_grads_logits, program_on

TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(b, t, s, h, k, p, v, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(keys[0], (b, t, h, p), dtype),
            jax.random.normal(keys[1], (b, s, k, p), dtype),
            jax.random.normal(keys[2], (b, s, k, v), dtype),
            jax.random.normal(keys[3], (b, t, h, v), dtype))  # output cotangent


def _explicit(q, k, v, query_positions, key_positions, window=0, scale=None):
    mask = jnp.where(allowed_mask(query_positions, key_positions, window), 0.0, -jnp.inf)
    return dot_product_attention(q, k, v, mask, scale=scale)


def _value_and_grads(fn, q, k, v, cotangent):
    out, pullback = jax.vjp(fn, q, k, v)
    return (out, *pullback(cotangent))


# name: (B, T, S, H, K, P, V, chunk, window, positions of the queries, of the keys)
CASES = {
    "causal_mha": (2, 24, 24, 4, 4, 8, 8, 8, 0, "order", "order"),
    "gqa": (2, 24, 24, 4, 2, 8, 8, 8, 0, "order", "order"),
    "mqa_ragged_tiles": (1, 21, 21, 4, 1, 8, 8, 8, 0, "order", "order"),
    "mla_widths": (2, 16, 16, 2, 2, 12, 8, 4, 0, "order", "order"),
    "window": (2, 24, 24, 4, 2, 8, 8, 8, 5, "order", "order"),
    "window_wider_than_tile": (1, 32, 32, 2, 1, 8, 8, 4, 11, "order", "order"),
    "striped_order": (2, 16, 16, 2, 1, 8, 8, 4, 0, "striped", "striped"),
    "decode_block": (2, 3, 32, 4, 2, 8, 8, 8, 0, "cache", "arange"),
    "decode_one_token": (2, 1, 40, 4, 2, 8, 8, 16, 0, "cache", "arange"),
    "decode_window": (1, 1, 40, 2, 1, 8, 8, 8, 6, "cache", "arange"),
    "one_tile": (2, 16, 16, 4, 2, 8, 8, 512, 0, "order", "order"),
}


def _positions(kind, b, length, cache_start=13):
    if kind == "striped":  # the sequence-parallel layout: tokens out of order, true positions
        order = stripe_order(length, 2)
    elif kind == "cache":  # a block of queries at positions 13, 14, … against a KV cache
        order = cache_start + np.arange(length)
    else:
        order = np.arange(length)
    return jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, length))


@pytest.mark.parametrize("case", CASES)
def test_blocked_equals_explicit_in_values_and_gradients(case):
    b, t, s, h, k, p, v, chunk, window, query_kind, key_kind = CASES[case]
    q, key, value, cotangent = _inputs(b, t, s, h, k, p, v)
    query_positions, key_positions = _positions(query_kind, b, t), _positions(key_kind, b, s)
    blocked = jax.jit(lambda *a: _value_and_grads(
        lambda q, k, v: blocked_attention(q, k, v, query_positions, key_positions, chunk=chunk,
                                          window=window), *a))
    explicit = jax.jit(lambda *a: _value_and_grads(
        lambda q, k, v: _explicit(q, k, v, query_positions, key_positions, window), *a))
    for got, expected, name in zip(blocked(q, key, value, cotangent),
                                   explicit(q, key, value, cotangent),
                                   ("out", "dq", "dk", "dv"), strict=True):
        np.testing.assert_allclose(got, expected, **TOL, err_msg=name)


def test_blocked_scale_argument_matches_explicit():
    q, key, value, _ = _inputs(1, 8, 8, 2, 1, 8, 8)
    positions = _positions("order", 1, 8)
    np.testing.assert_allclose(
        blocked_attention(q, key, value, positions, positions, chunk=4, scale=0.3),
        _explicit(q, key, value, positions, positions, scale=0.3), **TOL)


@pytest.mark.slow
def test_fully_masked_tiles_are_skipped():
    """Values behind every query of a tile are never read: NaN in the values of positions
    16… leaves the outputs and query gradients of queries 0…15 exact (0·NaN would be NaN if a
    masked tile were computed), and so are unwritten KV-cache slots when decoding. (Key
    gradients do see later queries' NaN outputs; value gradients do not read values.)"""
    q, key, value, cotangent = _inputs(1, 32, 32, 2, 1, 8, 8)
    positions = _positions("order", 1, 32)
    poisoned = value.at[:, 16:].set(jnp.nan)
    out, dq, _, dv = _value_and_grads(
        lambda q, k, v: blocked_attention(q, k, v, positions, positions, chunk=8),
        q, key, poisoned, cotangent)
    want_out, want_dq, _, want_dv = _value_and_grads(
        lambda q, k, v: _explicit(q, k, v, positions, positions), q, key, value, cotangent)
    np.testing.assert_allclose(out[:, :16], want_out[:, :16], **TOL)
    np.testing.assert_allclose(dq[:, :16], want_dq[:, :16], **TOL)
    np.testing.assert_allclose(dv, want_dv, **TOL)
    query_positions = _positions("cache", 1, 1, cache_start=5)
    decoded = blocked_attention(q[:, :1], key, poisoned, query_positions, positions, chunk=8)
    np.testing.assert_allclose(
        decoded, _explicit(q[:, :1], key[:, :8], value[:, :8], query_positions,
                           positions[:, :8]), **TOL)


def _train_step_temp_bytes(implementation, length):
    """Compiled temp bytes of the gradient of two attention layers in a scan (as the model's
    layer stack runs them), positions an argument (as the train step's)."""
    q, _, _, _ = _inputs(1, length, length, 1, 1, 8, 8)

    def loss(q, positions):
        def layer(x, _):
            return attend(x, x, x, positions, positions, implementation=implementation,
                          chunk=256), None
        return jnp.sum(jax.lax.scan(layer, q, None, length=2)[0] ** 2)

    compiled = jax.jit(jax.grad(loss)).lower(q, _positions("order", 1, length)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blocked_memory_grows_linearly_in_length():
    """4× the tokens: blocked temp memory ≤ 5× (O(T·chunk)); explicit scores ≥ 10× (O(T²))."""
    blocked = _train_step_temp_bytes("blocked", 4096) / _train_step_temp_bytes("blocked", 1024)
    explicit = _train_step_temp_bytes("xla", 4096) / _train_step_temp_bytes("xla", 1024)
    assert blocked <= 5, blocked
    assert explicit >= 10, explicit


@pytest.mark.parametrize("overrides", [dict(attention__num_kv_heads=2),
                                       dict(attention="mla", mla__kv_rank=16, mla__rope_dim=8),
                                       dict(attention__num_kv_heads=1, execution__remat="full")],
                         ids=["gqa", "mla", "mqa_remat"])
@pytest.mark.slow
def test_model_with_blocked_attention_equals_xla_in_logits_and_gradients(overrides):
    tokens = random_tokens((2, 16))

    def logits_and_grads(implementation):
        _, model = tiny_model(execution__attention_implementation=implementation,
                              execution__attention_chunk=4,
                              **overrides)
        loss = lambda m: jnp.mean(m(tokens) ** 2)
        return nnx.jit(lambda m: (m(tokens), nnx.grad(loss)(m)))(model)

    for got, expected in zip(jax.tree.leaves(logits_and_grads("blocked")),
                             jax.tree.leaves(logits_and_grads("xla")), strict=True):
        np.testing.assert_allclose(got, expected, **TOL)


@pytest.mark.parametrize("overrides", [dict(attention__num_kv_heads=1),
                                       dict(attention="mla", mla__kv_rank=16, mla__rope_dim=8),
                                       dict(attention="mla", mla__kv_rank=16, mla__rope_dim=8,
                                            mla__absorb=True)],
                         ids=["mqa", "mla", "mla_absorbed"])
def test_kv_cache_decoding_with_blocked_attention_equals_the_full_forward_pass(overrides):
    tokens = random_tokens((2, 12))
    _, blocked = tiny_model(execution__attention_implementation="blocked",
                            execution__attention_chunk=4, **overrides)
    _, explicit = tiny_model(execution__attention_implementation="xla", **overrides)
    decoded = prefill_then_decode(JittedDecoder(blocked), tokens, prefill=7, cache_length=16)
    np.testing.assert_allclose(decoded, explicit(tokens), atol=2e-5, rtol=1e-5)


def test_probes_still_see_attention_weights_under_blocked():
    """Under `nnx.capture(…, AttentionWeights)` (the probes) the explicit path runs, so the
    probabilities exist; they equal those of an `xla` model."""
    x = jax.random.normal(jax.random.key(0), (1, 8, 32))
    positions = _positions("order", 1, 8)
    weights = []
    for implementation in ("blocked", "xla"):
        cfg, _ = tiny_model(execution__attention_implementation=implementation)
        attention = MultiHeadAttention(cfg, rngs=nnx.Rngs(0))
        _, captured = nnx.capture(lambda a, h: a(h, positions, lambda y, _: y, None),
                                  AttentionWeights)(attention, x)
        weights.append(captured["attention_weights"][0])
    np.testing.assert_allclose(weights[0], weights[1], **TOL)


def test_auto_rule_and_backend_errors():
    shape = dict(query_len=256, key_len=256, dtype=jnp.bfloat16, key_width=64, value_width=64,
                 in_order=True)
    long = dict(shape, query_len=BLOCKED_FROM_LENGTH, key_len=BLOCKED_FROM_LENGTH)
    assert choose_implementation("auto", backend="cpu", **shape) == "xla"
    assert choose_implementation("auto", backend="cpu", **long) == "blocked"
    assert choose_implementation("auto", backend="gpu", **shape) == "cudnn"
    assert choose_implementation("auto", backend="gpu", **dict(long, dtype=jnp.float32)) \
        == "blocked"
    assert choose_implementation("auto", backend="gpu", **dict(shape, value_width=32)) == "xla"
    assert choose_implementation("auto", backend="tpu", **shape) == "splash"
    assert choose_implementation("auto", backend="tpu", **dict(long, in_order=False)) \
        == "blocked"
    assert choose_implementation("splash", backend="tpu", **dict(shape, in_order=False)) \
        == "blocked"
    decoding = dict(long, query_len=1)  # one query against a long cache
    assert choose_implementation("auto", backend="cpu", **decoding) == "xla"
    for name in ("xla", "blocked"):
        assert choose_implementation(name, backend="cpu", **long) == name
    with pytest.raises(ValueError, match="'cudnn' needs an NVIDIA GPU"):
        choose_implementation("cudnn", backend="cpu", **shape)
    with pytest.raises(ValueError, match="'splash' needs a TPU"):
        choose_implementation("splash", backend="cpu", **shape)
    with pytest.raises(ConfigError, match="execution.attention_implementation='flash' is invalid: "
                                          "valid: auto, xla, blocked, cudnn, splash"):
        tiny_model(execution__attention_implementation="flash")
    with pytest.raises(ConfigError, match="execution.attention_chunk=0 is invalid"):
        tiny_model(execution__attention_chunk=0)


@pytest.mark.slow
def test_splash_kernel_equals_explicit_in_the_pallas_interpreter():
    """The TPU kernel itself, run by the Pallas interpreter on CPU (GQA, causal and local)."""
    q, key, value, _ = _inputs(1, 256, 256, 2, 1, 128, 128)
    positions = _positions("order", 1, 256)
    for window in (0, 100):
        np.testing.assert_allclose(
            splash_attention(q, key, value, block=128, window=window, interpret=True),
            _explicit(q, key, value, positions, positions, window), **TOL)


@pytest.mark.skipif(jax.default_backend() != "tpu",
                    reason="splash compiles only for a TPU (its CPU check runs in the Pallas "
                           "interpreter above); scripts/accelerator_check.sh runs this on one")
def test_splash_equals_explicit_on_tpu():
    q, key, value, cotangent = _inputs(2, 512, 512, 4, 2, 128, 128)
    positions = _positions("order", 2, 512)
    got = _value_and_grads(lambda q, k, v: splash_attention(q, k, v), q, key, value, cotangent)
    want = _value_and_grads(lambda q, k, v: _explicit(q, k, v, positions, positions),
                            q, key, value, cotangent)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=2e-3)  # TPU matmuls: bf16 passes


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="cuDNN attention needs an NVIDIA GPU; scripts/accelerator_check.sh "
                           "runs this on one")
def test_cudnn_equals_explicit_on_gpu():
    q, key, value, cotangent = _inputs(2, 256, 256, 4, 2, 64, 64, dtype=jnp.bfloat16)
    positions = _positions("order", 2, 256)
    for in_order in (True, False):
        got = _value_and_grads(lambda q, k, v, in_order=in_order: cudnn_attention(
            q, k, v, positions, positions, in_order=in_order), q, key, value, cotangent)
        want = _value_and_grads(lambda q, k, v: _explicit(q, k, v, positions, positions),
                                q, key, value, cotangent)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.float32(a), np.float32(b), atol=3e-2, rtol=3e-2)


@pytest.mark.slow
def test_blocked_under_data_sequence_and_tensor_parallelism_equals_one_device_xla():
    """8 devices (data 2 × sequence 2 × tensor 2, keys and values all-gathered, tokens striped
    out of order): loss, logits, gradients and KV-cache decoding equal one device's xla path."""
    reference = program_on({}, "prenorm", execution__attention_implementation="xla")
    with jax.set_mesh(reference.mesh):
        state = jax.device_get(jax.jit(reference._init_state)(0))
    variables = state["params"], state["model_state"]
    expected, _ = loss_grads_logits(reference, *variables)
    program = program_on(dict(data=2, sequence=2, tensor=2), "prenorm",
                         execution__attention_implementation="blocked",
                         execution__attention_chunk=4)
    got, _ = loss_grads_logits(program, *variables, decode=True)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["logits"], expected["logits"], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(got["decoded"], expected["logits"], atol=2e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4),
                 got["grads"], expected["grads"])


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_explicit_attention_equals_softmax_and_reduces_no_size_one_axis(heads, kv_heads):
    """The explicit path equals softmax(QKᵀ/√P + M)V written out per head. Without grouping it
    leaves the group axis out: XLA:CPU reduces an array with an inner size-1 axis many times
    slower (docs/performance.md), so no reduction may see one (a trailing kept axis of softmax's
    own is another layout). Recorded probabilities keep the B×K×G×T×S shape either way."""
    q, k, v, _ = _inputs(2, 6, 6, heads, kv_heads, 8, 8)
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    mask = jnp.where(allowed_mask(positions, positions, 0), 0.0, -jnp.inf)
    group = heads // kv_heads
    scores = jnp.einsum("bthp,bshp->bhts", q, jnp.repeat(k, group, axis=2)) / jnp.sqrt(8.0)
    want = jnp.einsum("bhts,bshv->bthv", jax.nn.softmax(scores + mask[:, None], axis=-1),
                      jnp.repeat(v, group, axis=2))
    np.testing.assert_allclose(dot_product_attention(q, k, v, mask), want, **TOL)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: dot_product_attention(q, k, v, mask).sum()))(q)
    reduced = [eqn.invars[0].aval.shape for eqn in jaxpr.jaxpr.eqns
               if eqn.primitive.name in ("reduce_max", "reduce_sum")]
    assert reduced and all(1 not in shape[:-1] for shape in reduced), reduced

    class Recorder(nnx.Module):
        pass

    _, captured = nnx.capture(lambda recorder: dot_product_attention(q, k, v, mask,
                                                                      recorder=recorder),
                              AttentionWeights)(Recorder())
    assert jax.tree.leaves(captured)[0].shape == (2, kv_heads, group, 6, 6)
