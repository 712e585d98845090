"""Head importance, iterative pruning and physical head removal
(train/instruments/head_pruning.py)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from arch.model import TransformerLM
from config import resolve
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
)
from train.instruments import head_pruning
from train.step import next_token_loss

# 2 layers, H = 4 query heads in K = 2 KV groups of G = 2.
PER_GROUP = np.array([[False, True, True, False], [True, False, False, True]])
WHOLE_GROUPS = np.array([[True, True, False, False], [False, False, True, True]])


@pytest.mark.parametrize("keep, heads, kv_heads", [(PER_GROUP, 2, 2), (WHOLE_GROUPS, 2, 1)])
@pytest.mark.slow
def test_physically_pruned_model_equals_the_masked_one(keep, heads, kv_heads):
    _, model = tiny_model(linear_bias=True)
    for seed, name in enumerate(("query", "key", "value", "output")):  # nonzero biases
        bias = getattr(model.blocks.attention, name).bias
        bias[...] = 0.05 * jax.random.normal(jax.random.key(seed), bias.shape)
    tokens_BxT = random_tokens((2, 16))
    pruned_cfg, pruned = head_pruning.prune_heads(model, keep)
    assert (pruned_cfg.attention.num_heads, pruned_cfg.attention.num_kv_heads) == (heads, kv_heads)
    assert (pruned_cfg.attention.head_dim, pruned_cfg.attention.width) == (8, 8 * heads)
    assert pruned.blocks.attention.query.kernel.shape == (2, 32, heads, 8)
    assert pruned.blocks.attention.key.kernel.shape == (2, 32, kv_heads, 8)
    np.testing.assert_allclose(np.asarray(pruned(tokens_BxT)),
                               np.asarray(head_pruning.masked_model(model, keep)(tokens_BxT)),
                               rtol=1e-5, atol=1e-5)
    # It generates: KV-cache decoding of the smaller model equals its full forward.
    decoded = prefill_then_decode(JittedDecoder(pruned), tokens_BxT, 10, 16)
    np.testing.assert_allclose(np.asarray(decoded), np.asarray(pruned(tokens_BxT)), rtol=1e-4,
                               atol=1e-4)
    # The config describes the smaller model: it validates and builds the same shapes.
    config = tiny_config(linear_bias=True)
    config.model = pruned_cfg
    config = resolve(config, 1)
    rebuilt = TransformerLM(ml_collections.FrozenConfigDict(config.model), rngs=nnx.Rngs(0))
    assert (jax.tree.map(jnp.shape, nnx.state(rebuilt, nnx.Param))
            == jax.tree.map(jnp.shape, nnx.state(pruned, nnx.Param)))


def test_a_mask_the_stacked_layers_cannot_hold_is_refused():
    _, model = tiny_model()
    uneven = np.array([[False, True, True, True], [True, True, True, True]])
    with pytest.raises(ValueError, match=r"^keep mask keeps \[\[1, 2\], \[2, 2\]\] query heads per"
                                         r" \(layer, KV group\): stacked layers need"):
        head_pruning.prune_heads(model, uneven)
    empty = np.array([[True] * 4, [False] * 4])
    with pytest.raises(ValueError, match=r"removes every head of layer 1"):
        head_pruning.prune_heads(model, empty)


@pytest.mark.slow
def test_importance_is_the_mean_absolute_per_sequence_mask_gradient():
    """Unnormalized I equals mean_b |∂L(x_b)/∂ξ| from separate gradients of each sequence's loss;
    a head whose W_O slice is zero has ∂L/∂ξ = 0, so iterative pruning removes it first."""
    _, model = tiny_model()
    kernel = model.blocks.attention.output.kernel
    kernel[...] = kernel[...].at[0, 1].set(0)
    tokens_BxT1 = random_tokens((3, 17))
    importance = head_pruning.head_importance(model, [tokens_BxT1], normalize=False)

    graphdef, state = nnx.split(model)

    def loss(mask_LxH, tokens):
        masked = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        out = masked.blocks.attention.output.kernel
        out[...] = out[...] * mask_LxH[:, :, None, None]
        return next_token_loss(masked(tokens[:, :-1]), tokens[:, 1:])

    grad = jax.jit(jax.grad(loss))  # one compile for the three sequences
    expected = np.mean([np.abs(np.asarray(grad(jnp.ones((2, 4)), tokens_BxT1[b:b + 1])))
                        for b in range(3)], axis=0)
    np.testing.assert_allclose(importance, expected, rtol=1e-4, atol=1e-7)
    assert importance[0, 1] == 0 and (np.delete(importance.ravel(), 1) > 0).all()
    normalized = head_pruning.head_importance(model, [tokens_BxT1])
    np.testing.assert_allclose(np.linalg.norm(normalized, axis=1), 1.0, rtol=1e-6)
    points = head_pruning.iterative_head_pruning(model, [tokens_BxT1], [tokens_BxT1],
                                                 step_fraction=1 / 8, max_fraction=0.25)
    assert [p["fraction"] for p in points] == [0.0, 0.125, 0.25]
    assert not points[1]["keep"][0, 1] and points[1]["keep"].sum() == 7
    # Removing a head whose output is zero leaves the loss unchanged.
    assert points[1]["loss"] == pytest.approx(points[0]["loss"], abs=1e-6)


def test_structured_rounds_stay_physically_removable():
    _, model = tiny_model()
    tokens_BxT1 = random_tokens((2, 17))
    for structure, fractions in (("per_group", [0.0, 0.5]), ("whole_groups", [0.0, 0.5])):
        points = head_pruning.iterative_head_pruning(model, [tokens_BxT1], [tokens_BxT1],
                                                     structure=structure)
        assert [p["fraction"] for p in points] == fractions
        head_pruning.prune_heads(model, points[-1]["keep"])  # does not raise


@pytest.mark.slow
def test_a_pruned_model_written_as_a_run_restores_and_generates(tmp_path):
    from tests.helpers import write_run
    from train.instruments import pruning
    from train.restore import restore_for_analysis, restore_run
    from train.sampling import generate_text

    config = tiny_config(linear_bias=True)
    config.mesh.data = -1
    write_run(config, tmp_path / "run", step=1)
    program, _, model, tokens_BxT1 = restore_for_analysis(tmp_path / "run", 8)
    pruned_cfg, pruned = head_pruning.prune_heads(model, WHOLE_GROUPS)
    pruning.write_run(program.config, pruned, tmp_path / "pruned")
    restored_program, step, state = restore_run(tmp_path / "pruned")
    assert step == 0 and restored_program.config.model.attention.num_kv_heads == 1
    restored = nnx.merge(restored_program.graphdef, state["params"], state["model_state"])
    inputs_BxT = tokens_BxT1[:, :-1]
    np.testing.assert_allclose(np.asarray(restored(inputs_BxT)), np.asarray(pruned(inputs_BxT)),
                               rtol=1e-6, atol=1e-6)
    assert len(generate_text(restored_program, state, "In the", 5)) >= len("In the") + 1
    with pytest.raises(FileExistsError, match="already holds a run"):
        pruning.write_run(program.config, pruned, tmp_path / "pruned")
