"""Reversible blocks (arch/reversible.py): the coupling, its inverse, the custom backward pass
against ordinary autodiff, depth-independent gradient memory, and sharding."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from arch.model import TransformerLM
from arch.reversible import branches, invert
from config import ConfigError, resolve
from tests.helpers import random_tokens, tiny_config, tiny_model
from tests.test_sharding import program_on
from train.step import next_token_loss


def explicit_coupling(model: TransformerLM, tokens_BxT):
    """Ordinary-autodiff reference: a Python loop over the layers, y₁ = x₁ + F(x₂),
    y₂ = x₂ + G(y₁), from the model's own stacked parameters; returns logits and every stream."""
    positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
    x_BxTxD = model.position.embed(model.embed(tokens_BxT), positions_BxT)
    graphdef, params, states = nnx.split(model.blocks, nnx.Param, ...)
    streams = [(x_BxTxD, x_BxTxD)]
    for layer in range(model.cfg.num_layers):
        block = nnx.merge(graphdef, *jax.tree.map(lambda a, i=layer: a[i], (params, states)))
        x1, x2 = streams[-1]
        y1 = x1 + block.attention(block.attention_residual.read(x2), positions_BxT,
                                  model.position.rotate, None)[0]
        y2 = x2 + block.ffn(block.ffn_residual.read(y1))
        streams.append((y1, y2))
    y1, y2 = streams[-1]
    return model.logits_of_hidden((y1 + y2) / 2), streams


@pytest.fixture(scope="module")
def reversible():
    cfg, model = tiny_model(reversible=True)
    return cfg, model, random_tokens((4, 16))


def test_forward_matches_explicit_coupling_and_inverse_recovers_inputs(reversible):
    _, model, tokens = reversible
    expected, streams = explicit_coupling(model, tokens)
    np.testing.assert_allclose(model(tokens), expected, rtol=1e-5, atol=1e-5)
    # Invert every block from its outputs: x₂ = y₂ − G(y₁), x₁ = y₁ − F(x₂).
    graphdef, params, states = nnx.split(model.blocks, nnx.Param, ...)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    attention_branch, ffn_branch = branches(graphdef, model.position.rotate)
    y1, y2 = streams[-1]
    for layer in reversed(range(model.cfg.num_layers)):
        p, s = jax.tree.map(lambda a, i=layer: a[i], (params, states))
        y1, y2 = invert(attention_branch, ffn_branch, p, s, y1, y2, positions)
        np.testing.assert_allclose(y1, streams[layer][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y2, streams[layer][1], rtol=1e-5, atol=1e-5)


def test_custom_backward_matches_ordinary_autodiff(reversible):
    _, model, tokens = reversible

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def gradient(forward):
        def loss(params):
            logits = forward(nnx.merge(graphdef, params, rest), tokens[:, :-1])
            return next_token_loss(logits, tokens[:, 1:])
        return nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))

    custom = gradient(lambda m, t: m(t))
    ordinary = gradient(lambda m, t: explicit_coupling(m, t)[0])
    assert jax.tree.structure(custom) == jax.tree.structure(ordinary)
    assert "embedding" in custom["embed"] and "ffn" in custom["blocks"]
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(custom),
                            jax.tree.leaves(ordinary), strict=True):
        assert float(jnp.abs(b).max()) > 0, path  # every parameter really gets a gradient
        # Inputs are reconstructed, not stored: they differ from the forward's by f32 rounding,
        # so entries far below the leaf's scale carry absolute error ~1e-7 of that scale.
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()),
                                   err_msg=str(path))


def gradient_temp_bytes(reversible: bool, num_layers: int) -> int:
    """XLA's compiled scratch memory for the parameter gradient of the LM loss."""
    config = tiny_config(reversible=reversible, d_model=64, num_layers=num_layers)
    config.seq_len, config.batch_size = 128, 8
    config = resolve(config, 1)
    cfg = ml_collections.FrozenConfigDict(config.model)
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)

    def grads(params, tokens_BxT1):
        model = nnx.merge(graphdef, params, rest)
        return nnx.grad(lambda m: next_token_loss(m(tokens_BxT1[:, :-1]), tokens_BxT1[:, 1:]))(
            model)

    tokens = jax.ShapeDtypeStruct((8, 129), jnp.int32)
    compiled = jax.jit(grads).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_gradient_memory_does_not_grow_with_depth():
    # d=64, T=128, B=8: activations dominate. Measured on CPU: ordinary 39.2 MB → 227 MB
    # (×5.8) from 2 to 16 layers; reversible 12.0 MB at both depths (×1.0). The gradients are
    # the function's outputs here, so only activation (not parameter-sized) scratch is counted.
    ordinary = gradient_temp_bytes(False, 16) / gradient_temp_bytes(False, 2)
    reversible = gradient_temp_bytes(True, 16) / gradient_temp_bytes(True, 2)
    assert reversible <= 1.3, (reversible, ordinary)
    assert ordinary > 2, (reversible, ordinary)


def test_causal_finite_and_decode_matches_forward(reversible):
    cfg, model, tokens = reversible
    logits = model(tokens)
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % 256)
    logits_changed = model(changed)
    np.testing.assert_array_equal(logits[:, :10], logits_changed[:, :10])  # past unaffected
    assert not np.allclose(logits[:, 10:], logits_changed[:, 10:])
    assert np.isfinite(float(next_token_loss(logits[:, :-1], tokens[:, 1:])))
    # Generation: the same coupling, forward only, through the KV cache, in two chunks.
    cache = model.init_cache(tokens.shape[0], tokens.shape[1])
    positions = jnp.broadcast_to(jnp.arange(16), tokens.shape)
    first, cache = model.decode(tokens[:, :9], positions[:, :9], cache)
    second, _ = model.decode(tokens[:, 9:], positions[:, 9:], cache)
    np.testing.assert_allclose(jnp.concatenate([first, second], axis=1), logits,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_train_step_on_2x2x2_mesh_matches_one_device():
    tokens = np.asarray(random_tokens((8, 17)))
    results = []
    for devices, mesh in ((1, (1, 1, 1)), (8, (2, 2, 2))):
        program = program_on(devices, *mesh, reversible=True)
        state, metrics = program.train_step(program.init(0), program.put_batch(tokens))
        results.append((float(metrics["loss"]), float(metrics["grad_norm"]),
                        jax.device_get(state["params"])))
    (loss_1, norm_1, params_1), (loss_8, norm_8, params_8) = results
    np.testing.assert_allclose(loss_8, loss_1, rtol=1e-5)
    np.testing.assert_allclose(norm_8, norm_1, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 params_8, params_1)


@pytest.mark.parametrize("overrides, message", [
    (dict(residual="postnorm"),
     "model.reversible=True is invalid: reversible blocks need model.residual.name='prenorm' "
     "(got 'postnorm')"),
    (dict(use_ffn=False),
     "model.reversible=True is invalid: reversible blocks couple attention with an FFN; "
     "set model.use_ffn=True"),
    (dict(norm="batchnorm"),
     "model.reversible=True is invalid: reversible blocks cannot replay running statistics of "
     "model.norm.name='batchnorm'; use a stateless norm"),
    (dict(ffn="moe"),
     "model.reversible=True is invalid: reversible blocks do not carry the MoE auxiliary "
     "losses; use a dense model.ffn.name"),
])
def test_invalid_configs(overrides, message):
    config = tiny_config(reversible=True, **overrides)
    with pytest.raises(ConfigError) as error:
        config = resolve(config, 1)
    assert str(error.value) == message
