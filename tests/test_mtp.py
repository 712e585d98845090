"""Multi-token prediction (arch/mtp.py): the modules follow DeepSeek-V3's equation, the training
loss decomposes as CE₀ + (λ/k) Σ_j CE_j over the positions with a target, k = 0 is the plain
model, the forward pass and decoding ignore the modules, and the books count them apart."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from arch.accounting import flops_per_token, parameter_breakdown
from arch.attention import ATTENTION
from config import ConfigError, resolve
from sharding.mesh import make_mesh
from sharding.sequence import stripe_order
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
)
from train.step import TrainProgram, multi_token_batch, next_token_loss

T = 16


def program(devices: int = 1, mesh: dict | None = None, **model) -> TrainProgram:
    config = tiny_config(**model)
    config.mesh.update(mesh or {})
    config = resolve(config, devices)
    return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))


def loss_and_metrics(program: TrainProgram, tokens_BxT1):
    state = program.init(0)
    with jax.set_mesh(program.mesh):
        loss, _, _, metrics = jax.jit(program._loss_and_grads)(
            state["params"], state["model_state"], tokens_BxT1)
    return state, float(loss), jax.device_get(metrics)


def rms_norm(x, scale, eps=1e-6):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * scale


@pytest.mark.slow
def test_modules_follow_the_equation_and_the_loss_decomposes():
    depth, weight = 2, 0.5
    prog = program(head__mtp_depth=depth, head__mtp_weight=weight)
    tokens_BxT1 = random_tokens((2, T + 1))
    state, loss, metrics = loss_and_metrics(prog, tokens_BxT1)
    model = nnx.merge(prog.graphdef, state["params"], state["model_state"])
    inputs_BxT = tokens_BxT1[:, :-1]
    positions_BxT = jnp.broadcast_to(jnp.arange(T), inputs_BxT.shape)
    # By hand: h'ʲ = M_j [RMSNorm(hʲ⁻¹); RMSNorm(Emb(t_{i+j}))], hʲ = TRM_j(h'ʲ), head(hʲ).
    hidden, _ = model._hidden(inputs_BxT, positions_BxT, None)
    embedding = np.asarray(model.embed.embedding[...])
    hand_losses = [next_token_loss(model.logits_of_hidden(hidden), tokens_BxT1[:, 1:])]
    for j, module in enumerate(model.mtp, start=1):
        future = np.asarray(tokens_BxT1[:, j:j + T - j])      # t_{i+j}, i = 0 … T − 1 − j
        future = np.pad(future, ((0, 0), (0, j)))             # no token: any (here 0)
        joined = np.concatenate([rms_norm(np.asarray(hidden), module.hidden_norm.scale[...]),
                                 rms_norm(embedding[future], module.embedding_norm.scale[...])],
                                axis=-1)
        projected = joined @ np.asarray(module.projection.kernel[...])
        hidden, _ = module.block(jnp.asarray(projected), positions_BxT, model.position.rotate)
        logits = model.logits_of_hidden(hidden)[:, :T - j]              # positions with a target
        hand = optax.softmax_cross_entropy_with_integer_labels(
            logits, tokens_BxT1[:, j + 1:]).mean()
        np.testing.assert_allclose(metrics[f"mtp_loss_{j}"], hand, rtol=1e-5)
        hand_losses.append(hand)
    expected = hand_losses[0] + weight / depth * sum(hand_losses[1:])
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    np.testing.assert_allclose(metrics["next_token_loss"], hand_losses[0], rtol=1e-5)
    np.testing.assert_allclose(metrics["mtp_loss"], loss - hand_losses[0], rtol=1e-4)


@pytest.mark.slow
def test_sequence_parallelism_changes_no_loss():
    """Under mesh.sequence = 2 the batch is striped: the future tokens, targets and masks are
    permuted with it, so every loss equals one device's."""
    # The program and batch of the equation test above: its one-device compile is shared.
    tokens_BxT1 = random_tokens((2, T + 1))
    mtp = dict(head__mtp_depth=2, head__mtp_weight=0.5)
    _, loss, metrics = loss_and_metrics(program(**mtp), tokens_BxT1)
    _, striped_loss, striped = loss_and_metrics(program(2, dict(data=1, sequence=2), **mtp),
                                                tokens_BxT1)
    np.testing.assert_allclose(striped_loss, loss, rtol=1e-5)
    for name in ("next_token_loss", "mtp_loss_1", "mtp_loss_2"):
        np.testing.assert_allclose(striped[name], metrics[name], rtol=1e-5)


@pytest.mark.slow
def test_depth_zero_is_the_plain_model_and_the_forward_pass_ignores_the_modules():
    tokens_BxT1 = random_tokens((2, T + 1))
    plain = program()
    state, loss, metrics = loss_and_metrics(plain, tokens_BxT1)
    assert "mtp" not in state["params"] and metrics == {}
    model = nnx.merge(plain.graphdef, state["params"], state["model_state"])
    np.testing.assert_allclose(loss, next_token_loss(model(tokens_BxT1[:, :-1]),
                                                     tokens_BxT1[:, 1:]), rtol=1e-6)
    # The trunk of an MTP model is the plain model's (same seed), parameter for parameter, and
    # its logits and KV-cache decoding are the plain model's: generation uses the ordinary head.
    _, plain_model = tiny_model()
    _, mtp_model = tiny_model(head__mtp_depth=2)
    trunk = nnx.to_pure_dict(nnx.state(mtp_model, nnx.Param))
    assert set(trunk.pop("mtp")) == {0, 1}
    jax.tree.map(np.testing.assert_array_equal, trunk,
                 nnx.to_pure_dict(nnx.state(plain_model, nnx.Param)))
    # Scramble the MTP modules: nothing the forward pass or decoding returns changes.
    mtp_params = nnx.state(mtp_model.mtp, nnx.Param)
    nnx.update(mtp_model.mtp, jax.tree.map(lambda x: x + 1.0, mtp_params))
    tokens_BxT = tokens_BxT1[:, :-1]
    np.testing.assert_array_equal(mtp_model(tokens_BxT), plain_model(tokens_BxT))
    np.testing.assert_allclose(prefill_then_decode(JittedDecoder(mtp_model), tokens_BxT, 8, T),
                               prefill_then_decode(JittedDecoder(plain_model), tokens_BxT, 8, T),
                               atol=1e-6)


def test_mtp_logits_see_no_token_beyond_their_input():
    """Module j at position i reads t_0 … t_{i+j}: changing t_s leaves positions i < s − j."""
    _, model = tiny_model(head__mtp_depth=2)
    tokens_BxT1 = random_tokens((2, T + 1))
    changed = tokens_BxT1.at[:, 10:].set((tokens_BxT1[:, 10:] + 7) % 256)
    positions_BxT = jnp.broadcast_to(jnp.arange(T), (2, T))

    def logits(tokens):
        future, _, _ = multi_token_batch(tokens, 2)
        return model.multi_token_logits(tokens[:, :-1], positions_BxT, future)

    for j, (a, b) in enumerate(zip(logits(tokens_BxT1), logits(changed), strict=True)):
        np.testing.assert_array_equal(a[:, :10 - j], b[:, :10 - j])
        assert not np.allclose(a[:, 10 - j], b[:, 10 - j])


def test_multi_token_batch_shifts_masks_and_stripes():
    tokens_BxT1 = jnp.arange(1, T + 2)[None]          # t_i = i + 1: no token is 0
    future, targets, valid = multi_token_batch(tokens_BxT1, 3)
    for j in (1, 2, 3):
        i = np.arange(T - j)
        np.testing.assert_array_equal(future[j - 1, 0, i], i + j + 1)
        np.testing.assert_array_equal(targets[j - 1, 0, i], i + j + 2)
        np.testing.assert_array_equal(valid[j - 1, 0], np.arange(T) < T - j)
        assert np.all(np.asarray(targets[j - 1, 0, T - j:]) == 0)
    order = stripe_order(T, 2)
    striped = multi_token_batch(tokens_BxT1, 3, shards=2)
    for plain, permuted in zip((future, targets, valid), striped, strict=True):
        np.testing.assert_array_equal(permuted, plain[..., order])


@pytest.mark.slow
def test_books_count_the_modules_apart_and_in_training_flops_only():
    depth = 2
    cfg, _ = tiny_model(head__mtp_depth=depth)
    plain_cfg, _ = tiny_model()
    d, v, f = cfg.d_model, cfg.vocab_size, cfg.ffn.d_ff
    h, k, p = cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.attention.head_dim
    block_kernels = (2 * h * p * d + 2 * d * k * p) + 3 * d * f   # attention + SwiGLU
    module = 2 * d + 2 * d * d + block_kernels + 2 * d             # 2 norms, M_j, block (+2 norms)
    books, plain = parameter_breakdown(cfg), parameter_breakdown(plain_cfg)
    assert books["mtp"] == depth * module and plain["mtp"] == 0
    assert books["total"] == plain["total"] + depth * module
    assert {name: books[name] for name in ("attention", "ffn", "norms", "head")} == {
        name: plain[name] for name in ("attention", "ffn", "norms", "head")}
    assert flops_per_token(cfg, T, training=False) == flops_per_token(plain_cfg, T, False)
    attention = ATTENTION["mha"].score_flops_per_token(cfg, T)
    extra = depth * (2 * (2 * d * d + block_kernels) + 2 * v * d + attention)  # tied head: V·d
    assert flops_per_token(cfg, T) == flops_per_token(plain_cfg, T) + 3 * extra


@pytest.mark.parametrize("fields, message", [
    (dict(head__mtp_depth=-1), "model.head.mtp_depth=-1"),
    (dict(head__mtp_depth=T), f"must be below seq_len={T}"),
    (dict(head__mtp_weight=-0.1), "model.head.mtp_weight=-0.1"),
])
def test_config_errors(fields, message):
    config = tiny_config(**fields)
    with pytest.raises(ConfigError, match=message):
        config = resolve(config, 1)
