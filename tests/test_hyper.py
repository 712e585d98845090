"""Multi-stream residuals (arch/hyper.py): Hyper-Connections, mHC and the width baseline."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.hyper import HyperConnection, ManifoldHyperConnection, StreamState, WidthBaseline
from arch.kernels.sinkhorn import sinkhorn
from config import ConfigError, resolve
from config.defaults import model_config
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
@pytest.mark.slow
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


@pytest.mark.slow
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
    """Sinkhorn–Knopp in float64: columns, then rows, `iterations` times (from the row-max-shifted
    exp, the same matrices)."""
    m = np.exp(logits - np.max(logits, axis=(-2, -1), keepdims=True))
    for _ in range(iterations):
        m = m / m.sum(-2, keepdims=True)
        m = m / m.sum(-1, keepdims=True)
    return m


def random_logits(scale, identity, count=256, seed=0, n=4):
    """`count` i.i.d. N(0, scale²) n×n logits, batch (count/8)×8, plus `identity`·I (mHC's
    initial 4·I)."""
    return (scale * jax.random.normal(jax.random.key(seed), (count // 8, 8, n, n))
            + identity * jnp.eye(n))


# Logit scales σ (and the 4·I of mHC's initialization). We have no trained mHC checkpoint: the
# trained runs' largest 20-iteration column error, 0.11, lies between those of random logits of
# σ = 4 and 8 (docs/performance.md#mhcs-sinkhorn-column-error), so σ = 10 stands for "larger".
SCALES = [(0.5, 0.0), (4.0, 0.0), (10.0, 0.0), (1.0, 4.0), (10.0, 4.0)]
HYPER = model_config().hyper  # the default tolerance and cap


@pytest.mark.parametrize("scale,identity", SCALES)
@pytest.mark.slow
def test_sinkhorn_reaches_the_tolerance_and_the_projection_at_every_scale(scale, identity):
    """With the default tolerance (1e-3) and a cap of 50 steps: columns within the tolerance and
    rows to rounding, the recorded error and counts true, and the matrix the doubly-stochastic
    projection: equal to plain Sinkhorn–Knopp run to convergence in float64, as far as the
    tolerance allows."""
    logits = random_logits(scale, identity)
    cap, tolerance = 50, HYPER.sinkhorn_tolerance  # 50: enough for std 10 (20, the default: 8)
    assert tolerance == 1e-3
    result = jax.jit(sinkhorn, static_argnums=(1, 2))(logits, cap, tolerance)
    matrix = np.asarray(result.matrix, np.float64)
    columns = np.abs(matrix.sum(-2) - 1).max(-1)
    assert columns.max() <= tolerance
    np.testing.assert_allclose(result.column_error, columns, atol=1e-6)
    np.testing.assert_allclose(matrix.sum(-1), 1, atol=1e-5)
    assert matrix.min() >= 0
    assert result.iterations.dtype == jnp.int32 and int(result.iterations.max()) <= cap
    start_error = np.abs(np.asarray(jax.nn.softmax(logits, -1)).sum(-2) - 1).max(-1)
    assert np.all(np.asarray(result.iterations)[start_error > tolerance] >= 1)
    exact = plain_sinkhorn(np.asarray(logits, np.float64), 20_000)
    converged = np.abs(exact.sum(-2) - 1).max(-1) < 1e-8  # where the reference got there
    assert converged.mean() > 0.5
    tight = jax.jit(sinkhorn, static_argnums=(1, 2))(logits, cap, 1e-4)
    assert float(tight.column_error.max()) <= 1e-4
    np.testing.assert_allclose(np.asarray(tight.matrix)[converged], exact[converged], atol=1e-4)
    np.testing.assert_allclose(matrix[converged], exact[converged], atol=2e-3)


def unrolled_sinkhorn(logits, iterations):
    """Reverse-mode differentiable Sinkhorn–Knopp in float32, a fixed number of iterations."""
    def step(_, log_m):
        log_m = log_m - jax.nn.logsumexp(log_m, axis=-2, keepdims=True)
        return log_m - jax.nn.logsumexp(log_m, axis=-1, keepdims=True)
    return jnp.exp(jax.lax.fori_loop(0, iterations, step, logits))


@pytest.mark.parametrize("scale,identity", [(1.0, 0.0), (3.0, 0.0), (1.0, 4.0)])
def test_sinkhorn_gradient_equals_the_unrolled_iterations_where_both_converge(scale,
                                                                              identity):
    """The implicit gradient against reverse-mode through 3,000 plain iterations, on the
    matrices where those converged (columns within 1e-6), for the loss Σ W ⊙ M; and against a
    central finite difference of the tolerance-based function along a random direction."""
    logits = random_logits(scale, identity, count=64)
    weights = jax.random.normal(jax.random.key(1), logits.shape)

    def loss(function, logits):
        return jnp.sum(weights * function(logits))

    ours = jax.jit(jax.grad(lambda x: loss(lambda y: sinkhorn(y, 50, 1e-6).matrix, x)))(logits)
    reference_matrix = unrolled_sinkhorn(logits, 3000)
    converged = np.abs(np.asarray(reference_matrix).sum(-2) - 1).max(-1) < 1e-6
    assert converged.mean() > 0.9
    reference = jax.jit(jax.grad(lambda x: loss(lambda y: unrolled_sinkhorn(y, 3000), x)))(
        logits)
    assert np.all(np.isfinite(ours))
    np.testing.assert_allclose(np.asarray(ours)[converged], np.asarray(reference)[converged],
                               atol=2e-3 * float(np.abs(reference).max()))
    direction = jax.random.normal(jax.random.key(2), logits.shape)
    epsilon = 1e-2
    value = jax.jit(lambda x: loss(lambda y: sinkhorn(y, 50, 1e-6).matrix, x))
    finite_difference = (value(logits + epsilon * direction)
                         - value(logits - epsilon * direction)) / (2 * epsilon)
    assert float(jnp.sum(ours * direction)) == pytest.approx(float(finite_difference), rel=2e-2)


def test_sinkhorn_gradients_stay_finite_at_large_logits():
    """Logits of std 10 and 30 (near-permutation matrices, entries down to float32's smallest):
    the ridge in the backward solve keeps every gradient finite."""
    for scale in (10.0, 30.0):
        logits = random_logits(scale, 4.0, count=256)
        gradient = jax.grad(lambda x: jnp.sum(jnp.arange(16.0).reshape(4, 4)
                                              * sinkhorn(x, 50, 1e-3).matrix))(logits)
        assert np.all(np.isfinite(gradient)), scale


def test_mhc_read_and_write_follow_the_paper_equations():
    """Xie et al. 2025 §4: x̃ = RMSNorm(vec x); H_pre = σ(α_pre x̃φ_pre + b_pre),
    H_post = 2σ(α_post x̃φ_post + b_post), H_res = Sinkhorn(α_res mat(x̃φ_res) + b_res);
    x ← H_res x + H_postᵀ F(norm(H_pre x)), Sinkhorn to convergence (tolerance 1e-6). b_pre
    carries the ±4 sublayer-k offset."""
    mechanism, state, x, y, p = mechanism_and_state(ManifoldHyperConnection, sublayer=6,
                                                    hyper__sinkhorn_tolerance=1e-6)
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
    res = plain_sinkhorn(res_logits, 5000)
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


@pytest.mark.slow
def test_mhc_mixing_matrices_are_doubly_stochastic():
    """Captured from a model forward with random non-zero parameters: every recorded H_res has
    non-negative entries, rows summing to 1 and columns within the default tolerance 1e-3 (the
    mixing logits of std 5, where 20 plain Sinkhorn iterations are not), as recorded with the
    iterations per token; read weights lie in (0, 1) and write strengths in (0, 2)."""
    cfg, model = mixing_model("mhc")
    twenty_iterations_error = 0.0
    for seed, name in enumerate(RESIDUAL_MODULES):  # mixing logits far from the identity init
        bias = getattr(model.blocks, name).mixing_bias
        bias[...] = 5 * jax.random.normal(jax.random.key(10 + seed), bias.shape)
        twenty = plain_sinkhorn(np.asarray(bias[...], np.float64), 20)
        twenty_iterations_error = max(twenty_iterations_error, np.abs(twenty.sum(-2) - 1).max())
    assert twenty_iterations_error > 2e-3
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
        (iterations,) = recorded["sinkhorn_iterations"]
        (column_error,) = recorded["sinkhorn_column_error"]
        assert iterations.shape == column_error.shape == (layers, 2, 16)
        assert 0 < int(iterations.max()) <= cfg.hyper.sinkhorn_iters
        np.testing.assert_allclose(mixing.sum(-1), 1, atol=1e-5)
        np.testing.assert_allclose(column_error, jnp.abs(mixing.sum(-2) - 1).max(-1), atol=1e-6)
        assert float(column_error.max()) <= cfg.hyper.sinkhorn_tolerance == 1e-3
        assert float(jnp.abs(mixing - jnp.eye(n)).max()) > 0.3  # not the identity
        assert float(read.min()) > 0 and float(read.max()) < 1
        assert float(write.min()) > 0 and float(write.max()) < 2


@pytest.mark.slow
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
     "model.hyper.sinkhorn_iters=0 is invalid: must be a positive integer (the most steps of "
     "the Sinkhorn projection)"),
    (dict(residual="mhc", hyper__sinkhorn_tolerance=-1e-3),
     "model.hyper.sinkhorn_tolerance=-0.001 is invalid: must be a number in [0, 1): the largest "
     "|column sum − 1| of the mixing matrices (0: as close as float32 gets, in at most "
     "model.hyper.sinkhorn_iters steps)"),
], ids=["width-streams", "hc-scale", "mhc-sinkhorn", "mhc-tolerance"])
def test_config_errors_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as error:
        resolved_model_config(**overrides)
    assert str(error.value) == message
