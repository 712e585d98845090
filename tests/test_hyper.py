"""Multi-stream residuals (arch/hyper.py): Hyper-Connections, mHC and the width baseline."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.hyper import HyperConnection, ManifoldHyperConnection, StreamState, WidthBaseline
from config import ConfigError, resolve
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
)

RESIDUAL_MODULES = ("attention_residual", "ffn_residual")


def flat_params(module):
    return dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))


def copy_shared_params(source, target):
    """Every parameter of `source` (attention, FFN, embeddings, head, norms) into `target`."""
    target_params = flat_params(target)
    for path, variable in flat_params(source).items():
        target_params[path][...] = variable[...]


def perturb_mixing(module, seed: int, fan_in: int):
    """Random non-zero parameters for a residual module (stacked over layers or not):
    projections N(0, 1/fan_in); static weights, biases, scales and norm gains their initial value
    plus N(0, 0.5²), so a test also sees which norm is applied where."""
    for index, (path, variable) in enumerate(sorted(flat_params(module).items())):
        noise = jax.random.normal(jax.random.key(1000 * seed + index), variable.shape)
        if str(path[-1]).endswith("projection"):
            variable[...] = noise * fan_in**-0.5
        else:
            variable[...] = variable[...] + 0.5 * noise


@functools.cache
def prenorm_logits(**model):
    _, reference = tiny_model(residual="prenorm", **model)
    return reference, reference(random_tokens((2, 16)))


# Dense/MoE block groups (two sublayer pairs per scan step), remat, LayerNorm, bfloat16 streams.
COMPOSED = dict(ffn="moe", moe__every=2, moe__experts=4, execution__remat="full", norm="layernorm",
                dtype="bfloat16")


@pytest.mark.parametrize("residual,options,tolerance", [
    ("hc", {}, 1e-5),
    ("hc", dict(residual__dynamic=False), 1e-5),
    ("mhc", {}, 3e-5),
    ("mhc", dict(residual__dynamic=False), 3e-5),
    ("width", {}, 1e-5),
    ("hc", COMPOSED, 0.1),  # bfloat16: the streams' sum and the read round differently
], ids=["hc", "hc-static", "mhc", "mhc-static", "width", "hc-moe-remat-layernorm-bf16"])
def test_at_initialization_equals_the_prenorm_model(residual, options, tolerance):
    """HC's Pre-Norm initialization (Zhu et al. 2024 §2.3; mHC's and width's likewise) makes
    every sublayer read the Pre-Norm stream and add its update to it; the streams' sum is n×
    (width: 1×) the Pre-Norm stream, which the final norm maps to the same logits (up to the
    norm's ε; in bfloat16, up to its rounding: logits of size ≈ 4 are resolved to ≈ 0.03)."""
    shared = {k: v for k, v in options.items() if k != "residual__dynamic"}
    reference, expected = prenorm_logits(**shared)
    _, model = tiny_model(residual=residual, **options)
    copy_shared_params(reference, model)
    np.testing.assert_allclose(model(random_tokens((2, 16))), expected, atol=tolerance, rtol=0)


def rms_norm(x, gain, eps=1e-6):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * gain


def resolved_model_config(**model):
    config = tiny_config(**model)
    config = resolve(config, 1)
    return config.model


def mechanism_and_state(cls, sublayer: int, **model):
    cfg = resolved_model_config(**model)
    mechanism = cls(cfg, rngs=nnx.Rngs(0))
    perturb_mixing(mechanism, seed=3, fan_in=cfg.d_model * (cfg.residual.streams
                                                            if cls is ManifoldHyperConnection
                                                            else 1))
    streams = jax.random.normal(jax.random.key(1), (cfg.residual.streams, 2, 3, cfg.d_model))
    update = jax.random.normal(jax.random.key(2), (2, 3, cfg.d_model))
    params = {".".join(map(str, k)): np.asarray(v[...], np.float64)
              for k, v in flat_params(mechanism).items()}
    return (mechanism, StreamState(streams, jnp.int32(sublayer)), np.asarray(streams, np.float64),
            np.asarray(update, np.float64), params)


def test_hc_read_and_write_follow_algorithm_2_of_the_paper():
    """Zhu et al. 2024, Appendix J: alpha = [A_m, A_r] (n×(n+1)) and beta = B, each static plus
    s·tanh(norm(h) W), computed per stream; mix = alphaᵀ h; input mix[0]; h ← beta·y + mix[1:]."""
    mechanism, state, h, y, p = mechanism_and_state(HyperConnection, sublayer=5)
    n = h.shape[0]
    h_BTND = np.moveaxis(h, 0, 2)
    normed = rms_norm(h_BTND, p["dynamic_norm.scale"])
    static_alpha = np.concatenate([(p["static_read"] + np.eye(n)[5 % n])[:, None],
                                   p["static_mixing"]], axis=1)
    w_alpha = np.concatenate([p["read_projection"][:, None], p["mixing_projection"]], axis=1)
    alpha = static_alpha + p["width_scale"] * np.tanh(normed @ w_alpha)  # B×T×n×(n+1)
    beta = p["static_write"] + p["depth_scale"] * np.tanh(normed @ p["write_projection"])
    mix = np.einsum("btnk,btnd->btkd", alpha, h_BTND)
    expected_read = rms_norm(mix[:, :, 0], p["norm.scale"])
    expected_streams = beta[..., None] * y[:, :, None] + mix[:, :, 1:]
    np.testing.assert_allclose(mechanism.read(state), expected_read, atol=1e-5)
    written, recorded = nnx.capture(mechanism.write, nnx.Intermediate)(
        state, jnp.asarray(y, jnp.float32))
    np.testing.assert_allclose(written.streams_NxBxTxD, np.moveaxis(expected_streams, 2, 0),
                               atol=1e-5)
    assert int(written.sublayer) == 6
    # recorded as M[i, j] = weight of old stream j in new stream i, i.e. A_rᵀ
    np.testing.assert_allclose(recorded["mixing_matrix"][0],
                               np.swapaxes(alpha[..., 1:], -1, -2), atol=1e-6)
    np.testing.assert_allclose(recorded["write_strengths"][0], beta, atol=1e-6)


def plain_sinkhorn(logits, iterations):
    m = np.exp(logits)
    for _ in range(iterations):
        m = m / m.sum(-2, keepdims=True)
        m = m / m.sum(-1, keepdims=True)
    return m


def test_mhc_read_and_write_follow_the_paper_equations():
    """Xie et al. 2025 §4: x̃ = RMSNorm(vec x); H_pre = σ(α_pre x̃φ_pre + b_pre),
    H_post = 2σ(α_post x̃φ_post + b_post), H_res = Sinkhorn(α_res mat(x̃φ_res) + b_res);
    x ← H_res x + H_postᵀ F(norm(H_pre x)). b_pre carries the ±4 sublayer-k offset."""
    mechanism, state, x, y, p = mechanism_and_state(ManifoldHyperConnection, sublayer=6)
    n, batch, length, d = x.shape
    vec = np.moveaxis(x, 0, 2).reshape(batch, length, n * d)  # stream-major vec(x)
    x_tilde = rms_norm(vec, p["dynamic_norm.scale"])
    offset = 4.0 * (2 * np.eye(n)[6 % n] - 1)
    pre = 1 / (1 + np.exp(-(p["read_scale"] * x_tilde @ p["read_projection"].reshape(n * d, n)
                            + p["read_bias"] + offset)))
    post = 2 / (1 + np.exp(-(p["write_scale"] * x_tilde @ p["write_projection"].reshape(n * d, n)
                             + p["write_bias"])))
    res_logits = (p["mixing_scale"] * (x_tilde @ p["mixing_projection"].reshape(n * d, n * n))
                  .reshape(batch, length, n, n) + p["mixing_bias"])
    res = plain_sinkhorn(res_logits, 20)
    expected_read = rms_norm(np.einsum("btn,nbtd->btd", pre, x), p["norm.scale"])
    expected_streams = np.einsum("btij,jbtd->ibtd", res, x) + np.einsum("bti,btd->ibtd", post, y)
    np.testing.assert_allclose(mechanism.read(state), expected_read, atol=1e-5)
    written = mechanism.write(state, jnp.asarray(y, jnp.float32))
    np.testing.assert_allclose(written.streams_NxBxTxD, expected_streams, atol=1e-4)
    assert int(written.sublayer) == 7


def test_width_reads_a_learned_mixture_and_writes_round_robin():
    """Sublayer k reads norm(Σ_m a_m x_m) and adds its update to branch k mod n; the embedding
    starts in branch 0 and the final norm reads the sum of the branches."""
    mechanism, state, _, _, p = mechanism_and_state(WidthBaseline, sublayer=0)
    n, batch, length, d = state.streams_NxBxTxD.shape
    x = jax.random.normal(jax.random.key(4), (batch, length, d))
    stream = WidthBaseline.stream(resolved_model_config(), rngs=nnx.Rngs(0))
    state = stream.begin(x)
    updates = jax.random.normal(jax.random.key(5), (2 * n + 1, batch, length, d))
    expected = np.zeros((n, batch, length, d))
    expected[0] = x
    for k, update in enumerate(updates):
        expected_read = rms_norm(np.einsum("n,nbtd->btd", p["branch_weights"], expected),
                                 p["norm.scale"])
        np.testing.assert_allclose(mechanism.read(state), expected_read, atol=1e-5)
        state = mechanism.write(state, update)
        expected[k % n] += np.asarray(update)
    np.testing.assert_allclose(state.streams_NxBxTxD, expected, atol=1e-5)
    np.testing.assert_allclose(stream.end(state), expected.sum(0), atol=1e-5)


def mixing_model(residual: str, **model):
    cfg, model = tiny_model(residual=residual, **model)
    fan_in = cfg.d_model * (cfg.residual.streams if residual == "mhc" else 1)
    for seed, name in enumerate(RESIDUAL_MODULES):
        perturb_mixing(getattr(model.blocks, name), seed, fan_in)
    return cfg, model


def test_mhc_mixing_matrices_are_doubly_stochastic():
    """Captured from a model forward with random non-zero parameters: every recorded H_res has
    non-negative entries and row and column sums of 1 (Sinkhorn, 20 iterations, within 1e-3),
    read weights lie in (0, 1) and write strengths in (0, 2)."""
    cfg, model = mixing_model("mhc")
    for seed, name in enumerate(RESIDUAL_MODULES):  # mixing logits far from the identity init
        bias = getattr(model.blocks, name).mixing_bias
        bias[...] = jax.random.normal(jax.random.key(10 + seed), bias.shape)
    _, intermediates = nnx.capture(model, nnx.Intermediate)(random_tokens((2, 16)))
    n, layers = cfg.residual.streams, cfg.num_layers
    for name in RESIDUAL_MODULES:
        recorded = intermediates["blocks"][name]
        (mixing,) = recorded["mixing_matrix"]
        (read,) = recorded["read_weights"]
        (write,) = recorded["write_strengths"]
        assert mixing.shape == (layers, 2, 16, n, n)
        assert read.shape == write.shape == (layers, 2, 16, n)
        assert float(mixing.min()) >= 0
        np.testing.assert_allclose(mixing.sum(-1), 1, atol=1e-3)
        np.testing.assert_allclose(mixing.sum(-2), 1, atol=1e-3)
        assert float(jnp.abs(mixing - jnp.eye(n)).max()) > 0.3  # not the identity
        assert float(read.min()) > 0 and float(read.max()) < 1
        assert float(write.min()) > 0 and float(write.max()) < 2


def test_decoding_with_a_kv_cache_equals_the_full_forward():
    _, model = mixing_model("mhc")
    tokens = random_tokens((2, 9))
    decoded = prefill_then_decode(JittedDecoder(model), tokens, prefill=6, cache_length=9)
    np.testing.assert_allclose(decoded, model(tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cls", [HyperConnection, ManifoldHyperConnection])
def test_a_batchnorm_for_the_dynamic_weights_updates_its_statistics_once_per_sublayer(cls):
    """Read and write both need the normalized streams; the write recomputes them without
    counting the batch a second time in the running averages r ← m·r + (1 − m)·mean."""
    mechanism, state, streams, update, _ = mechanism_and_state(cls, sublayer=0, norm="batchnorm")
    n, batch, length, d = streams.shape
    features = (streams.reshape(n * batch * length, d) if cls is HyperConnection
                else np.moveaxis(streams, 0, 2).reshape(batch * length, n * d))
    mechanism.read(state)  # running mean starts at 0
    mechanism.write(state, jnp.asarray(update, jnp.float32))
    m = mechanism.dynamic_norm.momentum
    np.testing.assert_allclose(mechanism.dynamic_norm.running_mean[...],
                               (1 - m) * features.mean(0), atol=1e-5)


@pytest.mark.parametrize("overrides,message", [
    (dict(residual="width", residual__streams=0),
     "model.residual.streams=0 is invalid: must be a positive integer (the number of residual "
     "streams n)"),
    (dict(residual="hc", hyper__dynamic_scale=0.0),
     "model.hyper.dynamic_scale=0.0 is invalid: must be positive: with the zero-initialized "
     "projections a scale of 0 keeps the dynamic part at 0 forever; set "
     "model.residual.dynamic=False for static weights"),
    (dict(residual="mhc", hyper__sinkhorn_iters=0),
     "model.hyper.sinkhorn_iters=0 is invalid: must be a positive integer (Sinkhorn-Knopp "
     "iterations; the paper uses 20)"),
], ids=["width-streams", "hc-scale", "mhc-sinkhorn"])
def test_config_errors_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as error:
        resolved_model_config(**overrides)
    assert str(error.value) == message
