"""BatchNorm for sequences: statistics, masks, causality, running averages, data parallelism."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.batchnorm import BatchNorm, CausalBatchNorm
from tests.helpers import random_tokens, tiny_model
from tests.test_sharding import program_on

X = jax.random.normal(jax.random.key(0), (3, 6, 4)) * 2.0 + 1.0


def test_batchnorm_normalizes_each_feature_over_batch_and_positions():
    y = BatchNorm(4, eps=1e-6, rngs=nnx.Rngs(0))(X)
    np.testing.assert_allclose(y.mean((0, 1)), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var((0, 1)), 1.0, atol=1e-4)


def test_padding_is_left_out_of_the_statistics():
    mask = jnp.ones((3, 6)).at[1, 3:].set(0).at[2, 5].set(0)
    real = X[np.asarray(mask, bool)]                       # N × D, the unpadded tokens
    y = BatchNorm(4, eps=1e-6, rngs=nnx.Rngs(0))(X, mask)
    expected = (real - real.mean(0)) / jnp.sqrt(real.var(0) + 1e-6)
    np.testing.assert_allclose(y[np.asarray(mask, bool)], expected, atol=1e-5)
    changed = X.at[1, 4].set(100.0)                        # a padded position
    np.testing.assert_allclose(BatchNorm(4, eps=1e-6, rngs=nnx.Rngs(0))(changed, mask)[0], y[0],
                               atol=1e-6)


def test_causal_statistics_use_only_earlier_positions():
    norm = CausalBatchNorm(4, eps=1e-6, rngs=nnx.Rngs(0))
    y = norm(X)
    for t in (0, 2, 5):
        seen = X[:, : t + 1].reshape(-1, 4)
        expected = (X[:, t] - seen.mean(0)) / jnp.sqrt(seen.var(0) + 1e-6)
        np.testing.assert_allclose(y[:, t], expected, atol=1e-4)
    changed = X.at[0, 4].set(50.0)  # a future token of any sequence changes no earlier output
    np.testing.assert_array_equal(CausalBatchNorm(4, eps=1e-6, rngs=nnx.Rngs(0))(changed)[:, :4],
                                  y[:, :4])


@pytest.mark.parametrize("cls", [BatchNorm, CausalBatchNorm])
def test_running_statistics_update_in_training_and_serve_evaluation(cls):
    norm = cls(4, eps=1e-6, momentum=0.75, rngs=nnx.Rngs(0))
    norm(X)
    flat = X.reshape(-1, 4)
    np.testing.assert_allclose(norm.running_mean[...], 0.25 * flat.mean(0), atol=1e-5)
    np.testing.assert_allclose(norm.running_var[...], 0.75 + 0.25 * flat.var(0), atol=1e-4)
    norm.eval()
    before = norm.running_mean[...]
    y = norm(X[:1])
    np.testing.assert_array_equal(norm.running_mean[...], before)  # evaluation does not update
    expected = (X[:1] - before) / jnp.sqrt(norm.running_var[...] + 1e-6)
    np.testing.assert_allclose(y, expected, atol=1e-5)


def test_causal_batchnorm_model_is_causal_in_training():
    _, model = tiny_model(norm="causal_batchnorm")
    tokens = random_tokens((4, 16))
    changed = tokens.at[2, 10:].set((tokens[2, 10:] + 5) % 256)
    np.testing.assert_array_equal(model(tokens)[:, :10], model(changed)[:, :10])


@pytest.mark.slow
def test_data_parallel_statistics_equal_single_device():
    tokens = np.asarray(random_tokens((8, 17)))
    results = []
    for devices, data in ((1, 1), (8, 8)):
        program = program_on(devices, data, 1, 1, norm="causal_batchnorm")
        state = program.init(0)
        losses = []
        for _ in range(2):
            state, metrics = program.train_step(state, program.put_batch(tokens))
            losses.append(float(metrics["loss"]))
        evaluation = float(program.eval_loss(state, program.put_batch(tokens)))
        results.append((losses, evaluation, jax.device_get(state["model_state"])))
    (losses_1, eval_1, stats_1), (losses_8, eval_8, stats_8) = results
    np.testing.assert_allclose(losses_8, losses_1, rtol=1e-5)
    np.testing.assert_allclose(eval_8, eval_1, rtol=1e-5)
    chex.assert_trees_all_close(stats_8, stats_1, rtol=1e-5, atol=1e-6)
    mean = stats_1["blocks"]["attention_residual"]["norm"]["running_mean"]
    assert np.abs(mean).max() > 0  # the train step really updated the running statistics
