"""Output heads: bias, Mixture of Softmaxes / Contexts against float64 references, the softmax
bottleneck (rank), composition with the model, and MoS under tensor parallelism."""

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from arch.bottleneck import softmax_bottleneck
from arch.heads import HEADS
from arch.layers import Embedding
from config import ConfigError, resolve
from experiments.common import model_config
from sharding.mesh import make_mesh
from tests.helpers import override, random_tokens, tiny_config, tiny_model
from train.step import TrainProgram, next_token_loss


def build_head(head: str, seed: int = 0, vocab: int = 64, d: int = 8, **overrides):
    """(embedding, head) built standalone from a model config with the given overrides."""
    cfg = model_config()
    override(cfg, vocab_size=vocab, d_model=d, head=head, **overrides)
    cfg = ml_collections.FrozenConfigDict(cfg)
    rngs = nnx.Rngs(seed)
    return Embedding(vocab, d, rngs=rngs), HEADS[head](cfg, rngs=rngs)


def hidden(shape, seed: int = 3, scale: float = 1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape)


def set_random_bias(bias: nnx.Param, seed: int = 4) -> np.ndarray:
    b = np.asarray(jax.random.normal(jax.random.key(seed), bias.shape))
    bias[...] = jnp.asarray(b)
    return b


def softmax64(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def mixture_reference(head, embedding, x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 numpy (π [..., K], h_k [..., K, d], E_out [V, d], b [V]) from the module's params."""
    x = np.asarray(x, np.float64)
    w_pi = np.asarray(head.mixing.kernel[...], np.float64)           # d×K
    w_ctx = np.asarray(head.contexts.kernel[...], np.float64)        # d×K×d
    table = (np.asarray(embedding.embedding[...], np.float64) if head.output is None
             else np.asarray(head.output.kernel[...], np.float64).T)  # V×d
    bias = (np.zeros(table.shape[0]) if head.bias is None
            else np.asarray(head.bias[...], np.float64))
    pi = softmax64(x @ w_pi)
    contexts = np.tanh(np.einsum("...d,dke->...ke", x, w_ctx))
    return pi, contexts, table, bias


def mos_reference(head, embedding, x) -> np.ndarray:
    """p = Σ_k π_k softmax(h_k E_outᵀ + b), directly in probability space."""
    pi, contexts, table, bias = mixture_reference(head, embedding, x)
    return np.einsum("...k,...kv->...v", pi, softmax64(contexts @ table.T + bias))


def moc_reference(head, embedding, x) -> np.ndarray:
    """p = softmax((Σ_k π_k h_k) E_outᵀ + b)."""
    pi, contexts, table, bias = mixture_reference(head, embedding, x)
    return softmax64(np.einsum("...k,...kd->...d", pi, contexts) @ table.T + bias)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_bias_adds_b_to_the_logits(head):
    embedding, with_bias = build_head(head, head__bias=True)
    _, without = build_head(head, head__bias=False)
    if head == "untied":
        np.testing.assert_array_equal(with_bias.output.kernel[...], without.output.kernel[...])
        bias = with_bias.output.bias
    else:
        bias = with_bias.bias
    assert bias.shape == (64,) and not np.any(bias[...])  # zero-initialized
    assert bias.out_sharding == ("vocab",)
    b = set_random_bias(bias)
    x = hidden((2, 5, 8))
    np.testing.assert_allclose(with_bias(x, embedding), without(x, embedding) + b,
                               atol=1e-6, rtol=1e-6)


def test_bias_and_mixture_params_have_logical_axes():
    _, head = build_head("mos", head__bias=True, head__mos_tied=False)
    assert head.mixing.kernel.out_sharding == ("embed", "head_mixture")
    assert head.contexts.kernel.out_sharding == ("embed", "head_mixture", "head_context")
    assert head.output.kernel.out_sharding == ("embed", "vocab")
    assert head.bias.out_sharding == ("vocab",)
    assert head.contexts.kernel.shape == (8, 4, 8)  # d × K × d: one d×d W_k per component


@pytest.mark.parametrize("tied,bias", [(True, False), (False, True)], ids=["tied", "untied+bias"])
def test_mos_equals_probability_space_mixture(tied, bias):
    embedding, head = build_head("mos", head__mos_tied=tied, head__bias=bias,
                                 head__mos_components=3)
    if bias:
        set_random_bias(head.bias)
    x = hidden((2, 5, 8), scale=2.0)
    log_p = head(x, embedding)
    chex.assert_shape(log_p, (2, 5, 64))
    chex.assert_type(log_p, jnp.float32)
    expected = mos_reference(head, embedding, x)
    np.testing.assert_allclose(np.exp(np.asarray(log_p, np.float64)), expected,
                               atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(np.exp(np.asarray(log_p, np.float64)).sum(-1), 1.0, atol=1e-5)


def test_mos_is_stable_for_large_logits():
    embedding, head = build_head("mos")
    x = hidden((2, 5, 8), scale=1e3)  # mixing logits ~1e3: π is nearly one-hot
    log_p = np.asarray(head(x, embedding), np.float64)
    assert np.all(np.isfinite(log_p))
    np.testing.assert_allclose(np.exp(log_p).sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.exp(log_p), mos_reference(head, embedding, x), atol=1e-5)


def test_moc_is_one_softmax_of_the_mixed_context():
    embedding, head = build_head("moc", head__mos_components=3)
    x = hidden((2, 5, 8), scale=2.0)
    log_p = np.asarray(jax.nn.log_softmax(head(x, embedding)), np.float64)
    np.testing.assert_allclose(np.exp(log_p), moc_reference(head, embedding, x),
                               atol=1e-6, rtol=1e-5)


def test_one_component_mos_and_moc_give_the_same_distribution():
    embedding, mos = build_head("mos", head__mos_components=1)
    _, moc = build_head("moc", head__mos_components=1)  # same seed: same parameters
    x = hidden((2, 5, 8))
    np.testing.assert_allclose(mos(x, embedding), jax.nn.log_softmax(moc(x, embedding)),
                               atol=1e-5)


def test_sigsoftmax_is_exp_times_sigmoid_normalized():
    """p_v = exp(z_v) σ(z_v) / Σ_w exp(z_w) σ(z_w) with z the tied head's logits (Kanai et al.
    2018, eq. 8), against float64 numpy, also for logits large enough to overflow exp."""
    embedding, head = build_head("sigsoftmax", head__bias=True)
    bias = set_random_bias(head.bias)
    for scale in (1.0, 40.0):
        x = hidden((2, 5, 8), scale=scale)
        z = (np.asarray(x, np.float64) @ np.asarray(embedding.embedding[...], np.float64).T
             + bias)
        # exp(z)σ(z) = exp(z − log(1 + e^{−z})); shift by the max for a stable float64 reference
        log_weights = z - np.logaddexp(0.0, -z)
        expected = softmax64(log_weights)
        log_p = head(x, embedding)
        chex.assert_tree_all_finite(log_p)
        np.testing.assert_allclose(np.exp(log_p), expected, atol=1e-6)


@pytest.mark.parametrize("head", ["tied", "moc", "mos", "sigsoftmax"])
def test_softmax_bottleneck_rank(head):
    """Log-probs of N=64 random contexts over V=32 tokens with d=4, minus a reference column.

    A single softmax of a d-dim context gives log p_v − log p_0 = h·(E_v − E_0) (+ b_v − b_0):
    rank ≤ d + 1. MoS with K=4 mixes normalized distributions and escapes the bound. Numerical
    rank: `arch.bottleneck.softmax_bottleneck`'s default threshold. Sigsoftmax's log σ(z) is not
    bilinear in (h, E) either, so it escapes the bound with no extra parameters.
    """
    d, vocab = 4, 32
    embedding, module = build_head(head, vocab=vocab, d=d, head__mos_components=4)
    log_p = jax.nn.log_softmax(module(hidden((1, 64, d), seed=5), embedding))[0]
    report = softmax_bottleneck(log_p, tokens=np.arange(1, vocab), reference_token=0)
    if head in ("mos", "sigsoftmax"):
        assert report["numerical_rank"] > d + 1, report
    else:
        assert report["numerical_rank"] <= d + 1, report


def test_mos_components_must_be_positive():
    config = tiny_config(head="mos", head__mos_components=0)
    with pytest.raises(ConfigError, match=r"^model\.head\.mos_components=0 is invalid: .*≥ 1$"):
        config = resolve(config, 1)


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [dict(head="tied", head__bias=True),
                                     dict(head="untied", head__bias=True),
                                     dict(head="mos"),
                                     dict(head="moc"),
                                     dict(head="sigsoftmax")],
                         ids=["tied+bias", "untied+bias", "mos", "moc", "sigsoftmax"])
@pytest.mark.slow
def test_heads_compose_with_the_model(variant):
    _, model = tiny_model(**variant)
    tokens = random_tokens((2, 17))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    forward = nnx.jit(lambda model, tokens: model(tokens))
    outputs = forward(model, inputs)
    chex.assert_shape(outputs, (2, 16, 256))
    chex.assert_type(outputs, jnp.float32)
    chex.assert_tree_all_finite(outputs)
    changed = inputs.at[:, 9:].set((inputs[:, 9:] + 7) % 256)
    after = forward(model, changed)
    np.testing.assert_array_equal(outputs[:, :9], after[:, :9])  # causal: the past is unchanged
    assert not np.allclose(outputs[:, 9:], after[:, 9:])
    loss = next_token_loss(outputs, targets)
    assert np.isfinite(loss)
    if variant["head"] in ("mos", "sigsoftmax"):  # log-probs: the loss is −mean log p(target)
        np.testing.assert_allclose(np.exp(outputs).sum(-1), 1.0, atol=1e-5)
        nll = -jnp.take_along_axis(outputs, targets[..., None], axis=-1).mean()
        np.testing.assert_allclose(loss, nll, rtol=1e-6)


@pytest.mark.slow
def test_mos_under_tensor_parallelism_matches_single_device():
    """Two train steps of the MoS head (untied, with bias) on a (data=2, fsdp=2, tensor=2) mesh
    equal the same steps on one device; the second loss also checks the first step's update."""
    def program_on(devices, data, fsdp, tensor):
        config = tiny_config(head="mos", head__mos_tied=False, head__bias=True, num_layers=1)
        config.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
        config = resolve(config, devices)
        return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))

    sharded, single = program_on(8, 2, 2, 2), program_on(1, 1, 1, 1)
    sharded_state = sharded.init(0)
    head = sharded_state["params"]["head"]  # the new parameters really are sharded
    assert head["contexts"]["kernel"][...].sharding.spec == P("fsdp", None, "tensor")
    assert head["output"]["kernel"][...].sharding.spec == P("fsdp", "tensor")
    assert head["bias"][...].sharding.spec == P("tensor")
    # Same initial state on one device (saves compiling a second init; test_sharding checks init).
    single_state = jax.device_put(jax.device_get(sharded_state), single.state_shardings)

    tokens = np.asarray(random_tokens((8, 17)))
    losses = {"sharded": [], "single": []}
    for _ in range(2):
        sharded_state, metrics = sharded.train_step(sharded_state, sharded.put_batch(tokens))
        losses["sharded"].append(float(metrics["loss"]))
        single_state, metrics = single.train_step(single_state, single.put_batch(tokens))
        losses["single"].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["sharded"], losses["single"], rtol=1e-5)
