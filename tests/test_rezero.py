"""ReZero (arch/rezero.py): x ← x + α·F(x), α zero-initialized, through the residual protocol.

Training and 2×2×2 sharding equal to one device: tests/test_variants.py gives every registered
mechanism a variant ("rezero-alone"). Here: the defining property (identity at initialization),
the gradient that starts it, the pipeline, accounting, probes and pruning.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.accounting import parameter_count, residual_accounting
from arch.residual import RESIDUALS, MixingParam
from tests.helpers import random_tokens, tiny_model
from tests.test_pipeline import logits_loss_and_grads, program_on, single_device
from train.instruments import ablation, probes
from train.step import next_token_loss


def output_path_logits(model, tokens_BxT):
    """The network without its blocks: embedding, position, final norm, head."""
    positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    return model.logits_of_hidden(model.position.embed(model.embed(tokens_BxT), positions_BxT))


def test_read_and_write_follow_the_equation():
    cfg, _ = tiny_model(residual="rezero")
    residual = RESIDUALS["rezero"](cfg, rngs=nnx.Rngs(0))
    assert isinstance(residual.residual_weight, MixingParam)
    np.testing.assert_array_equal(residual.residual_weight[...], [0.0])
    x, y = jax.random.normal(jax.random.key(0), (2, 2, 5, cfg.d_model))
    residual.residual_weight[...] = jnp.asarray([0.3])
    np.testing.assert_array_equal(residual.read(x), x)  # no norm
    np.testing.assert_allclose(residual.write(x, y), x + 0.3 * y, rtol=1e-6)


@pytest.mark.parametrize("layers", [1, 4])
def test_identity_at_initialization_and_only_alpha_gets_gradient(layers):
    """α = 0: every block is the identity, so the logits are the output path's of the
    embedding, exactly; ∂loss/∂α = ⟨∂loss/∂x, F(x)⟩ ≠ 0 for every sublayer, while every sublayer
    weight's gradient is exactly 0 (it reaches the loss only through α·F)."""
    _, model = tiny_model(residual="rezero", num_layers=layers)
    tokens = random_tokens((2, 17))
    np.testing.assert_array_equal(model(tokens[:, :-1]), output_path_logits(model, tokens[:, :-1]))

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        return next_token_loss(nnx.merge(graphdef, params, rest)(tokens[:, :-1]), tokens[:, 1:])

    grads = jax.jit(jax.grad(loss))(params)["blocks"]
    for name in ("attention_residual", "ffn_residual"):
        alpha_grad = np.asarray(grads[name]["residual_weight"][...])
        assert alpha_grad.shape == (layers, 1) and np.all(alpha_grad != 0), name
    for name in ("attention", "ffn"):
        for leaf in jax.tree.leaves(grads[name]):
            np.testing.assert_array_equal(leaf, 0)
    # Once α ≠ 0 the blocks act: the identity above is the initialization's, not the code's.
    for name in ("attention_residual", "ffn_residual"):
        getattr(model.blocks, name).residual_weight[...] = jnp.full((layers, 1), 0.5)
    assert not np.allclose(model(tokens[:, :-1]), output_path_logits(model, tokens[:, :-1]))


@pytest.mark.slow
def test_pipeline_stage_2_matches_single_device():
    """Random parameters (α ≠ 0), GPipe over mesh.stage=2 with data=2, tensor=2: the logits,
    loss and every gradient equal one device's."""
    state, tokens, (logits_1, loss_1, grads_1) = single_device("rezero")
    program = program_on(8, dict(data=2, tensor=2, stage=2), residual="rezero")
    _, (logits, loss, grads) = logits_loss_and_grads(program, state, tokens)
    np.testing.assert_allclose(logits, logits_1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, loss_1, rtol=1e-6)
    scale = max(np.abs(g).max() for g in jax.tree.leaves(grads_1))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale),
                 grads, grads_1)


def test_accounting():
    """The plain sum's I/O and state; the 2L scalars α replace the Pre-Norm's 2L norm gains."""
    cfg, _ = tiny_model(residual="rezero", num_layers=3)
    books = residual_accounting(cfg)
    d, sublayers = cfg.d_model, 6
    assert books["io_per_token_per_sublayer"] == 3
    assert books["history_elements_per_token"] == books["state_elements_per_token"] == d
    assert books["added_parameters"] == sublayers * (1 - d)
    prenorm, _ = tiny_model(residual="prenorm", num_layers=3)
    assert parameter_count(cfg) - parameter_count(prenorm) == sublayers * (1 - d)


@pytest.mark.slow
def test_probes_see_identity_blocks_and_pruning_keeps_the_logits():
    """At initialization: the hidden state and its gradient are the same at every depth, no
    block has influence, the sublayers have no norm (NaN), and the loss is the model's; pruning
    a block leaves the logits unchanged."""
    _, model = tiny_model(residual="rezero", num_layers=3)
    tokens = random_tokens((2, 17))
    profile = probes.depth_profile(model, tokens)
    assert profile["loss"] == pytest.approx(ablation.batch_loss(model, tokens), rel=1e-6)
    np.testing.assert_allclose(profile["hidden_rms"], profile["hidden_rms"][0], rtol=1e-6)
    np.testing.assert_allclose(profile["gradient_rms"], profile["gradient_rms"][0], rtol=1e-5)
    np.testing.assert_allclose(profile["block_influence"], 0, atol=1e-6)
    assert np.all(profile["branch_rms"] > 0)  # F(x) itself is not zero, α·F(x) is
    assert np.isnan(profile["norms"]["attention"]["input_rms"]).all()
    pruned_cfg, pruned = ablation.prune_blocks(model, [1])
    assert pruned_cfg.num_layers == 2
    inputs = tokens[:, :-1]
    np.testing.assert_allclose(pruned(inputs), model(inputs), rtol=1e-6, atol=1e-6)
