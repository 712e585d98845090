"""The softmax bottleneck diagnostic: the seeds' 2×2 log-odds example, which a d = 1 bias-free
softmax cannot represent (its log-odds matrix has rank ≤ 1) and a two-component Mixture of
Softmaxes can; the diagnostic's statement of dimensions, precision and threshold; and a model."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from arch.bottleneck import model_bottleneck, softmax_bottleneck
from arch.heads import HEADS
from arch.layers import Embedding
from experiments.common import model_config
from tests.helpers import override, random_tokens, tiny_model

LOG2 = float(np.log(2))
# Two contexts, tokens (a, b) against the reference token r: context 1 prefers a two to one over
# b and r, context 2 prefers b. det = (log 2)², so the matrix has rank 2.
TARGET = np.array([[LOG2, 0.0], [0.0, LOG2]])


def fit(head: str, seed: int, steps: int = 1500, **overrides):
    """Adam-fit the 2 contexts (d = 1) and the head's parameters so that the head's log-odds of
    tokens (1, 2) against token 0 match TARGET; returns (log-probs 2×3, squared error)."""
    cfg = model_config()
    override(cfg, vocab_size=3, d_model=1, head=head, head__bias=False, **overrides)
    cfg = ml_collections.FrozenConfigDict(cfg)
    rngs = nnx.Rngs(seed)
    modules = nnx.Dict(embedding=Embedding(3, 1, rngs=rngs), head=HEADS[head](cfg, rngs=rngs))
    graphdef, params = nnx.split(modules)
    params = {"modules": params, "contexts": jax.random.normal(jax.random.key(seed), (1, 2, 1))}

    def log_probs(params):
        modules = nnx.merge(graphdef, params["modules"])
        scores = modules["head"](params["contexts"], modules["embedding"])
        return jax.nn.log_softmax(scores, axis=-1)[0]

    def loss(params):
        lp = log_probs(params)
        return jnp.sum((lp[:, 1:] - lp[:, :1] - TARGET) ** 2)

    optimizer = optax.adam(0.05)

    @jax.jit
    def run(params):
        def step(carry, _):
            params, opt_state = carry
            grads = jax.grad(loss)(params)
            updates, opt_state = optimizer.update(grads, opt_state)
            return (optax.apply_updates(params, updates), opt_state), None

        (params, _), _ = jax.lax.scan(step, (params, optimizer.init(params)), None, steps)
        return log_probs(params), loss(params)

    lp, error = run(params)
    return np.asarray(lp), float(error)


def test_two_by_two_example_needs_more_than_a_d1_softmax():
    assert np.isclose(np.linalg.det(TARGET), LOG2**2)
    # A d = 1 bias-free softmax: A_ij = h_i (e_j − e_0) has rank 1, so by Eckart–Young its
    # squared error to TARGET is at least σ_min(TARGET)² = (log 2)², whatever the fit.
    lp, error = fit("untied", seed=0)
    report = softmax_bottleneck(lp, tokens=[1, 2], reference_token=0)
    assert report["numerical_rank"] == 1, report
    assert error >= LOG2**2 - 1e-6 and error < LOG2**2 + 1e-3  # the fit reaches the bound
    # Mixture of Softmaxes with two components represents it: an existence proof, by a fit that
    # reaches it (the loss is not convex: from seeds 0, 1, 4 and 5 Adam stops at local optima,
    # 0.25 or the rank-1 bound; from seeds 2 and 3 it reaches 0).
    lp, error = fit("mos", seed=2, head__mos_components=2, head__mos_tied=False)
    report = softmax_bottleneck(lp, tokens=[1, 2], reference_token=0)
    assert error < 1e-6, error
    assert report["numerical_rank"] == 2
    np.testing.assert_allclose(np.prod(report["singular_values"]), LOG2**2, rtol=1e-3)


def test_diagnostic_states_dimensions_precision_and_threshold():
    rng = np.random.default_rng(0)
    hidden_Nx3, table_Vx3 = rng.normal(size=(40, 3)), rng.normal(size=(20, 3))
    log_probs = jax.nn.log_softmax(jnp.asarray(hidden_Nx3 @ table_Vx3.T, jnp.float32))
    report = softmax_bottleneck(log_probs, tokens=np.arange(1, 20), reference_token=0)
    assert (report["contexts"], report["tokens"], report["reference_token"]) == (40, 19, 0)
    assert report["precision"] == "float64 SVD of float32 log-probabilities"
    assert report["rtol"] == 40 * np.finfo(np.float32).eps
    assert report["threshold"] == pytest.approx(report["rtol"] * report["singular_values"][0])
    assert report["numerical_rank"] == 3  # d = 3, no bias
    with pytest.raises(ValueError, match=r"^reference_token=2 is also in tokens"):
        softmax_bottleneck(log_probs, tokens=[1, 2], reference_token=2)


@pytest.mark.parametrize("head", ["tied", "mos", "sigsoftmax"])
def test_model_bottleneck_respects_the_d_plus_one_bound(head):
    """A tiny LM (d = 32) over 256 positions and 64 tokens: a tied softmax stays at rank ≤ d;
    MoS (K = 4) and sigsoftmax exceed d + 1."""
    cfg, model = tiny_model(head=head, head__mos_components=4)
    report = model_bottleneck(model, random_tokens((8, 32), seed=3), num_tokens=64)
    assert report["contexts"] == 256 and report["tokens"] == 64
    if head == "tied":
        assert report["bound"] == cfg.d_model and report["numerical_rank"] <= cfg.d_model
    else:
        assert report["bound"] is None and report["numerical_rank"] > cfg.d_model + 1
