"""Differential attention (arch/differential_attention.py; Ye et al. 2024, "Differential
Transformer", eqs. 1–4): the equation against a hand-written reference, training, sharding,
KV-cache decoding and accounting."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch import accounting
from arch.attention import ATTENTION, AttentionWeights
from arch.differential_attention import LAMBDA_INIT, DifferentialAttention
from arch.positions import POSITIONS
from config import ConfigError, resolve
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
    train_on_mesh,
)

DIFFERENTIAL = dict(attention="differential")
ROOT = Path(__file__).resolve().parents[1]


def _rope(x_BxTxHxR, positions_BxT, base):
    half = x_BxTxHxR.shape[-1] // 2
    angle = positions_BxT[:, :, None, None] * base ** (-jnp.arange(half) / half)
    x1, x2 = x_BxTxHxR[..., :half], x_BxTxHxR[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                            x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)


def reference_differential(cfg, p, x_BxTxD, positions_BxT):
    """Ye et al. eqs. 1–4 in plain jnp from the layer's parameter dict (float32): each head's
    query/key halves Q₁, Q₂ / K₁, K₂ (RoPE on each half), A_i = softmax(Q_i K_iᵀ/√d + M),
    λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, head = (1 − λ_init)·RMSNorm((A₁ − λA₂)V),
    y = concat(heads) W_O. Returns (y, the differential maps B×H×T×S)."""
    h, kv, width = cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim
    d = width // 2
    rope = ((lambda x: _rope(x, positions_BxT, cfg.position.rope_base))
            if cfg.position.name == "rope" else (lambda x: x))
    q = jnp.einsum("btm,mhp->bthp", x_BxTxD, p["query"]["kernel"])
    k = jnp.repeat(jnp.einsum("bsm,mkp->bskp", x_BxTxD, p["key"]["kernel"]), h // kv, axis=2)
    v = jnp.repeat(jnp.einsum("bsm,mkp->bskp", x_BxTxD, p["value"]["kernel"]), h // kv, axis=2)
    t = x_BxTxD.shape[1]
    lag = jnp.arange(t)[:, None] - jnp.arange(t)[None, :]
    allowed = (lag >= 0) & ((lag < cfg.attention.window) if cfg.attention.window else True)

    def softmax_map(q_i, k_i):
        scores = jnp.einsum("bthd,bshd->bhts", rope(q_i), rope(k_i)) / np.sqrt(d)
        return jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)

    lam = (jnp.exp(jnp.sum(p["lambda_q1"] * p["lambda_k1"]))
           - jnp.exp(jnp.sum(p["lambda_q2"] * p["lambda_k2"])) + LAMBDA_INIT)
    maps = softmax_map(q[..., :d], k[..., :d]) - lam * softmax_map(q[..., d:], k[..., d:])
    o = jnp.einsum("bhts,bshp->bthp", maps, v)
    o = o / jnp.sqrt(jnp.mean(o**2, -1, keepdims=True) + cfg.norm.eps) * p["norm"]["scale"]
    return jnp.einsum("bthp,hpm->btm", (1 - LAMBDA_INIT) * o, p["output"]["kernel"]), maps


def resolved(**overrides):
    return resolve(tiny_config(**{**DIFFERENTIAL, **overrides}), 1).model


@nnx.jit
def capture(layer, position, x_BxTxD, positions_BxT):
    """The layer's output and the attention weights it records for the probes."""
    (y, _), captured = nnx.capture(layer, AttentionWeights)(x_BxTxD, positions_BxT,
                                                             position.rotate)
    return y, captured["attention_weights"][0]


@pytest.mark.parametrize("overrides", [
    dict(), dict(attention__num_kv_heads=4, position="none"), dict(attention__window=5),
], ids=["gqa-rope", "mha-no-positions", "window"])
@pytest.mark.slow
def test_matches_the_equations(overrides):
    cfg = resolved(**overrides)
    layer = DifferentialAttention(cfg, rngs=nnx.Rngs(0))
    position = POSITIONS[cfg.position.name](cfg, rngs=nnx.Rngs(0))
    keys = jax.random.split(jax.random.key(7), 6)
    # λ far from λ_init and a non-unit norm gain, so that each term of the equation shows.
    for key, name in zip(keys[:4], ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"),
                         strict=True):
        getattr(layer, name)[...] = 0.5 * jax.random.normal(key, (4,))
    layer.norm.scale[...] = 1 + 0.3 * jax.random.normal(keys[4], (8,))
    x = jax.random.normal(keys[5], (2, 12, 32))
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    params = nnx.to_pure_dict(nnx.state(layer, nnx.Param))
    expected, maps_BxHxTxS = jax.jit(reference_differential, static_argnums=0)(
        cfg, params, x, positions)
    assert abs(float(layer.differential_weight()) - LAMBDA_INIT) > 0.1
    y, cache = nnx.jit(lambda layer, x, positions: layer(x, positions, position.rotate))(
        layer, x, positions)
    assert cache is None and y.shape == x.shape
    np.testing.assert_allclose(y, expected, atol=2e-5, rtol=1e-5)
    # What the probes read: the differential map A₁ − λA₂, B×K×G×T×S (head h = k·G + g).
    captured_y, weights = capture(layer, position, x, positions)
    np.testing.assert_allclose(captured_y, y, atol=1e-6)
    b, k, g, t, s = weights.shape
    assert (b, k * g, t, s) == maps_BxHxTxS.shape and k == cfg.attention.num_kv_heads
    np.testing.assert_allclose(weights.reshape(b, k * g, t, s), maps_BxHxTxS, atol=1e-6)


@pytest.mark.parametrize("position, message", [
    ("rope", "model.attention.head_dim=6 is invalid: differential attention splits each head "
             "into two halves that RoPE rotates, so it must be a multiple of 4"),
    ("none", "model.attention.head_dim=5 is invalid: differential attention splits each head "
             "into two halves, so it must be even"),
])
def test_head_width_must_split_into_halves_before_jax_loads(position, message):
    """The rule is the record's (`config.catalogue`): `resolve` refuses the width in one line,
    in a process that never imports JAX."""
    width = 6 if position == "rope" else 5
    script = ("import sys\n"
              "from config import ConfigError, resolve\n"
              "from config.defaults import base_config\n"
              "config = base_config()\n"
              "config.model.update(vocab_size=64, d_model=20)\n"
              f"config.model.position.name = {position!r}\n"
              f"config.model.attention.update(name='differential', num_heads=4, num_kv_heads=4, "
              f"head_dim={width}, width={4 * width})\n"
              "try:\n"
              "    resolve(config, 1)\n"
              "except ConfigError as error:\n"
              "    print(error)\n"
              "print('jax' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.splitlines() == [message, "False"], done.stderr
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolved(attention__head_dim=width, attention__width=4 * width, position=position)


def train(devices: int, mesh: tuple[int, int, int], tokens):
    """(initial logits, 6 train steps' losses, the sharding of query's kernel) of the tiny
    differential LM on a data × fsdp × tensor mesh."""
    return train_on_mesh(DIFFERENTIAL, devices, mesh, tokens,
                         ("attention", "query", "kernel"), steps=6)


@pytest.fixture(scope="module")
def single_device():
    tokens = np.asarray(random_tokens((8, 17)))
    return tokens, train(1, (1, 1, 1), tokens)


@pytest.mark.slow
def test_it_trains(single_device):
    _, (_, losses, _) = single_device
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_sharded_equals_single_device(single_device):
    tokens, (logits_1, losses_1, _) = single_device
    logits, losses, spec = train(8, (2, 2, 2), tokens)
    assert spec == (None, "fsdp", "tensor", None)  # layers, d over fsdp, heads over tensor
    np.testing.assert_allclose(logits, logits_1, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(losses, losses_1, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 4], ids=["full", "ring-of-4"])
@pytest.mark.slow
def test_kv_cache_decoding_equals_the_full_forward(window):
    _, model = tiny_model(**DIFFERENTIAL, attention__window=window)
    tokens = random_tokens((2, 11))
    full = nnx.jit(lambda model, tokens: model(tokens))(model, tokens)
    decoded = prefill_then_decode(JittedDecoder(model), tokens, prefill=6, cache_length=16)
    np.testing.assert_allclose(decoded, full, atol=2e-5, rtol=1e-5)
    cache = model.init_cache(2, 16)
    assert cache["key"].shape == cache["value"].shape == (2, 2, min(16, window or 16), 2, 8)
    assert ("position" in cache) == bool(window)


def test_accounting_counts_the_parameters_and_the_two_maps():
    cfg, model = tiny_model(**DIFFERENTIAL)
    built = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert accounting.parameter_count(cfg) == built
    layers, d, h, k, p = 2, 32, 4, 2, 8
    mha = resolve(tiny_config(), 1).model
    # MHA's projections at the same H, K, P, plus λ_q1, λ_k1, λ_q2, λ_k2 (P/2 each) and the gain.
    assert built == accounting.parameter_count(mha) + layers * (4 * p // 2 + p)
    assert accounting.parameter_breakdown(cfg)["attention"] == layers * (
        d * h * p + 2 * d * k * p + h * p * d + 3 * p)
    scores = ATTENTION["differential"].score_flops_per_token(cfg, 16)
    assert scores == 6 * h * p * (16 + 1) / 2  # two QKᵀ of width P/2, two AV of width P
    assert accounting.flops_per_token(cfg, 16, training=False) == (
        2 * accounting.matmul_parameter_count(cfg) + layers * scores)
    assert accounting.kv_cache_bytes_per_token(cfg) == layers * 2 * k * p * 4
    assert accounting.recurrent_state_bytes(cfg) == 0
