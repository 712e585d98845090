"""Sliding-window attention (`model.attention.window`): the band mask against a per-query loop,
every kernel and ring attention against it, ring-buffer KV-cache decoding against the band-masked
forward pass and against a full cache, the cache's O(W) size in memory and in the accounting."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.accounting import books, kv_cache_bytes_per_token
from arch.attention import EMPTY_SLOT, attend, mean_visible_keys
from arch.kernels.attention_implementations import blocked_attention
from config import ConfigError, resolve
from sharding.sequence import ring_attention, stripe_order
from tests.helpers import prefill_then_decode, random_tokens, tiny_config, tiny_model
from train.sampling import generate_tokens

WINDOW = 4
MLA = dict(attention="mla", mla__kv_rank=16, mla__rope_dim=8)
MODELS = {"gqa": {}, "mqa": dict(attention__num_kv_heads=1), "mla": MLA,
          "mla_absorbed": dict(**MLA, mla__absorb=True)}


def qkv(t: int = 16, heads: int = 4, kv_heads: int = 2, width: int = 8):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (2, t, heads, width)),
            jax.random.normal(keys[1], (2, t, kv_heads, width)),
            jax.random.normal(keys[2], (2, t, kv_heads, width)))


def band_loop(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, positions_T, window):
    """softmax over the keys at positions t − W + 1 … t of each query t, one query at a time."""
    q, k, v = map(np.asarray, (q_BxTxHxP, k_BxSxKxP, v_BxSxKxV))
    group = q.shape[2] // k.shape[2]
    out = np.zeros(q.shape[:3] + v.shape[-1:], np.float32)
    for i, t in enumerate(positions_T):
        seen = (positions_T <= t) & (positions_T > t - window)
        for h in range(q.shape[2]):
            scores = np.einsum("bp,bsp->bs", q[:, i, h], k[:, seen, h // group]) / np.sqrt(
                q.shape[-1])
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            out[:, i, h] = np.einsum("bs,bsv->bv", weights, v[:, seen, h // group])
    return out


@pytest.mark.parametrize("implementation", ["xla", "blocked"])
def test_band_mask_equals_a_per_query_loop(implementation):
    q, k, v = qkv()
    positions_T = np.random.default_rng(0).permutation(16)  # any order: masks read positions
    positions = jnp.broadcast_to(jnp.asarray(positions_T), (2, 16))
    got = attend(q, k, v, positions, positions, implementation=implementation, chunk=4,
                 window=WINDOW)
    np.testing.assert_allclose(got, band_loop(q, k, v, positions_T, WINDOW), atol=1e-5)
    assert np.abs(got - attend(q, k, v, positions, positions, implementation="xla")).max() > 0.1


def test_blocked_band_gradients_equal_the_explicit_ones():
    q, k, v = qkv()
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))

    def loss(implementation):
        return lambda q, k, v: jnp.sum(jnp.sin(attend(
            q, k, v, positions, positions, implementation=implementation, window=WINDOW)))

    explicit = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    blocked = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(blocked_attention(
        q, k, v, positions, positions, chunk=4, window=WINDOW))), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(blocked, explicit, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_ring_attention_with_a_window_equals_the_band_mask():
    """Sequence parallelism over 4 shards, striped order (blocks wholly outside the band
    skipped) and the all-gather path both equal the single-device band mask."""
    q, k, v = qkv(t=32)
    order = stripe_order(32, 4)
    positions = jnp.broadcast_to(jnp.asarray(order), (2, 32))
    q, k, v = q[:, order], k[:, order], v[:, order]
    mesh = jax.make_mesh((4,), ("sequence",), axis_types=(jax.sharding.AxisType.Explicit,))
    tokens = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda q, k, v, p: ring_attention(q, k, v, p, window=WINDOW))(
            *jax.device_put((q, k, v, positions), tokens))
    np.testing.assert_allclose(got, band_loop(q, k, v, order, WINDOW), atol=1e-5)


class JittedDecode:
    """`model.decode` compiled (once per block length), with its `init_cache`."""

    def __init__(self, model):
        self.init_cache = model.init_cache
        self.decode = functools.partial(nnx.jit(lambda model, *args: model.decode(*args)), model)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow
def test_ring_cache_decoding_equals_the_band_masked_forward_pass(name):
    """Prefill 6 > W tokens, then decode one at a time to 16 = 4·W positions: the ring buffer of
    W slots gives the logits of the whole sequence run at once under the band mask."""
    _, model = tiny_model(attention__window=WINDOW, **MODELS[name])
    tokens = random_tokens((2, 16))
    expected = model(tokens)
    np.testing.assert_allclose(prefill_then_decode(JittedDecode(model), tokens, 6, 16), expected,
                               atol=2e-5)
    cache = model.init_cache(2, 16)
    assert {array.shape[2] for array in cache.values()} == {WINDOW}  # layers × B × W × …
    assert (cache["position"] == EMPTY_SLOT).all()
    _, full_causal = tiny_model(**MODELS[name])  # same parameters, no window: it binds
    assert np.abs(full_causal(tokens) - expected)[:, WINDOW:].max() > 0.1


@nnx.jit(static_argnames="num_tokens")
def greedy(model, prompt_BxP, cache, num_tokens: int):
    """Greedy decoding against `cache`: (tokens B×N, logits of each decode step B×N×V)."""
    batch, prompt_len = prompt_BxP.shape
    logits, cache = model.decode(prompt_BxP, jnp.broadcast_to(
        jnp.arange(prompt_len), prompt_BxP.shape), cache)

    def step(carry, position):
        logits_BxV, cache = carry
        token_B = jnp.argmax(logits_BxV, -1).astype(jnp.int32)
        logits_Bx1xV, cache = model.decode(token_B[:, None], jnp.full((batch, 1), position),
                                           cache)
        return (logits_Bx1xV[:, 0], cache), (token_B, logits_Bx1xV[:, 0])

    _, (tokens_NxB, logits_NxBxV) = jax.lax.scan(
        step, (logits[:, -1], cache), prompt_len + jnp.arange(num_tokens))
    return tokens_NxB.T, jnp.swapaxes(logits_NxBxV, 0, 1)


@pytest.mark.slow
def test_long_generation_with_the_ring_equals_full_cache_generation():
    """40 tokens past a 3-token prompt, W = 4: the ring of W slots and a cache with a slot for
    every position (the same band mask) give the same tokens and logits; so does
    train.generate's jitted sampler, greedy. The ring's arrays hold W positions, not 43."""
    _, model = tiny_model(attention__window=WINDOW)
    model.eval()
    prompt, length = random_tokens((2, 3)).astype(jnp.int32), 43
    ring = model.init_cache(2, length)
    full = {name: jnp.zeros(array.shape[:2] + (length,) + array.shape[3:], array.dtype)
            for name, array in ring.items()}
    full["position"] = jnp.full_like(full["position"], EMPTY_SLOT)
    assert ring["key"].shape[2] == WINDOW and full["key"].shape[2] == length
    ring_tokens, ring_logits = greedy(model, prompt, ring, num_tokens=40)
    full_tokens, full_logits = greedy(model, prompt, full, num_tokens=40)
    np.testing.assert_array_equal(ring_tokens, full_tokens)
    np.testing.assert_allclose(ring_logits, full_logits, atol=2e-5)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sampled = generate_tokens(graphdef, params, rest, prompt, jax.random.key(0), num_tokens=40,
                              temperature=0.0)
    np.testing.assert_array_equal(sampled, ring_tokens)


@pytest.mark.slow
def test_accounting_reports_the_bounded_cache():
    cfg, model = tiny_model(attention__window=WINDOW)
    kv = books(cfg, 16)["kv_cache"]
    assert kv["positions_held"] == WINDOW
    assert kv["bytes_per_sequence"] == kv_cache_bytes_per_token(cfg) * WINDOW
    allocated = model.init_cache(1, 16)
    assert kv["bytes_per_sequence"] == allocated["key"].nbytes + allocated["value"].nbytes
    full_cfg, _ = tiny_model()
    assert books(full_cfg, 16)["kv_cache"]["bytes_per_sequence"] == kv["bytes_per_sequence"] * 4
    # FLOPs: position t attends to min(t + 1, W) keys
    for length, window in ((16, 4), (16, 0), (3, 4), (4, 4), (100, 7)):
        brute = np.mean([min(t + 1, window or t + 1) for t in range(length)])
        assert mean_visible_keys(length, window) == pytest.approx(brute)
    assert books(cfg, 16)["flops"]["inference_per_token"] < books(full_cfg, 16)["flops"][
        "inference_per_token"]


def test_window_config_errors():
    config = tiny_config(attention__window=-1)
    with pytest.raises(ConfigError) as error:
        config = resolve(config, 1)
    assert str(error.value) == ("model.attention.window=-1 is invalid: must be a non-negative "
                                "integer (0: full causal attention)")
