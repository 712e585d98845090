"""Mixture of experts: routing and capacity, equality with a dense top-k mixture, auxiliary
losses, the train step's objective, expert parallelism, accounting and config errors."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from arch.accounting import active_parameter_count, matmul_parameter_count, parameter_count
from arch.ffn import FFNS
from arch.moe import AuxLoss, DroppedFraction, MixtureOfExperts, balance_loss, z_loss
from config import ConfigError, resolve
from sharding.mesh import make_mesh
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
)
from train.step import TrainProgram

D, T = 32, 16


def moe_layer(seed: int = 0, **overrides) -> MixtureOfExperts:
    config = tiny_config(ffn="moe", **overrides)
    config = resolve(config, 1)
    return MixtureOfExperts(ml_collections.FrozenConfigDict(config.model), rngs=nnx.Rngs(seed))


def inputs(batch: int = 2, seed: int = 3) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (batch, T, D))


def test_dropless_sends_every_token_to_k_distinct_experts():
    layer = moe_layer(moe__experts=4, moe__top_k=2, moe__dropless=True)
    _, probs, _, dispatch_BxTxExC, _ = layer.dispatch(inputs())
    assert dispatch_BxTxExC.shape == (2, T, 4, T)
    np.testing.assert_array_equal(dispatch_BxTxExC.sum((2, 3)), 2.0)       # k slots per token
    per_expert_BxTxE = dispatch_BxTxExC.sum(3)
    assert set(np.unique(per_expert_BxTxE)) <= {0.0, 1.0}                  # ... at k experts
    chosen = np.sort(np.argsort(-np.asarray(probs), -1)[..., :2], -1)      # ... the top-k ones
    np.testing.assert_array_equal(np.sort(np.argsort(-per_expert_BxTxE, -1)[..., :2], -1), chosen)
    assert dispatch_BxTxExC.sum(1).max() == 1.0                            # one token per slot
    layer(inputs())
    assert float(layer.dropped_fraction[...]) == 0.0


def test_capacity_is_first_come_first_served_by_choice_rank_then_position():
    # Even positions rank experts (0, 1, ...), odd positions (1, 0, ...): each expert gets 8 first
    # choices and 8 second choices per sequence, and C = ⌈0.75·2·16/4⌉ = 6 slots.
    layer = moe_layer(moe__experts=4, moe__top_k=2, moe__capacity_factor=0.75)
    assert layer.capacity(T) == 6
    sign_T = np.where(np.arange(T) % 2 == 0, 1.0, -1.0)
    x = np.zeros((2, T, D), np.float32)
    x[..., 0], x[..., 1] = sign_T, 1.0
    router = np.zeros((D, 4), np.float32)
    router[0] = [1.0, -1.0, 0.0, 0.0]
    router[1] = [0.0, 0.0, -5.0, -5.0]
    layer.router.kernel[...] = jnp.asarray(router)
    _, _, _, dispatch_BxTxExC, _ = layer.dispatch(jnp.asarray(x))
    for t in range(T):
        first, second = (0, 1) if t % 2 == 0 else (1, 0)
        kept = t // 2 < 6  # the first 6 first choices of each expert, in position order
        expected = np.zeros((4, 6))
        if kept:
            expected[first, t // 2] = 1.0
        np.testing.assert_array_equal(dispatch_BxTxExC[:, t], np.broadcast_to(expected, (2, 4, 6)))
        assert dispatch_BxTxExC[:, t, second].sum() == 0.0  # every second choice found it full
    np.testing.assert_array_equal(dispatch_BxTxExC.sum((1, 3)), [[6, 6, 0, 0]] * 2)
    layer(jnp.asarray(x))
    assert float(layer.dropped_fraction[...]) == pytest.approx(1 - 2 * 6 / (T * 2))


def _expert_ffn(layer: MixtureOfExperts, e: int, x_NxD: np.ndarray, gated: bool) -> np.ndarray:
    experts = layer.routed_experts
    hidden = x_NxD @ np.asarray(experts.up[...][e])
    if gated:
        hidden = np.asarray(jax.nn.silu(x_NxD @ np.asarray(experts.gate[...][e]))) * hidden
    else:
        hidden = np.asarray(jax.nn.gelu(hidden))
    return hidden @ np.asarray(experts.down[...][e])


@pytest.mark.parametrize("expert_ffn,shared,renormalize",
                         [("swiglu", 1, True), ("mlp", 0, False)])
def test_dropless_output_is_the_top_k_mixture_of_expert_ffns(expert_ffn, shared, renormalize):
    layer = moe_layer(moe__experts=4, moe__top_k=2, moe__dropless=True, moe__expert_ffn=expert_ffn,
                      moe__shared_experts=shared, moe__renormalize=renormalize, moe__d_ff=24)
    x = inputs()
    y = np.asarray(layer(x))
    x_NxD = np.asarray(x).reshape(-1, D)
    probs_NxE = np.asarray(jax.nn.softmax(x_NxD @ np.asarray(layer.router.kernel[...]), -1))
    expected = np.zeros_like(x_NxD)
    for n in range(len(x_NxD)):
        top = np.argsort(-probs_NxE[n])[:2]
        gates = probs_NxE[n, top] / (probs_NxE[n, top].sum() if renormalize else 1.0)
        for e, g in zip(top, gates, strict=True):
            expected[n] += g * _expert_ffn(layer, e, x_NxD[n : n + 1], expert_ffn == "swiglu")[0]
    if shared:
        assert layer.shared_experts.up.kernel.shape == (D, 24 * shared)
        expected += np.asarray(layer.shared_experts(x)).reshape(-1, D)
    np.testing.assert_allclose(y.reshape(-1, D), expected, atol=1e-5, rtol=1e-5)


def test_uniform_routing_gives_unit_balancing_loss_and_skew_raises_it():
    E, N = 4, 16
    uniform_probs = jnp.full((1, N, E), 1 / E)
    uniform_choices = jax.nn.one_hot(jnp.arange(N) % E, E)[None, :, None]  # k = 1, f_e = 1/E
    assert float(balance_loss(uniform_probs, uniform_choices)) == pytest.approx(1.0)
    skewed_probs = jnp.broadcast_to(jnp.array([0.7, 0.1, 0.1, 0.1]), (1, N, E))
    skewed_choices = jax.nn.one_hot(jnp.zeros(N, int), E)[None, :, None]    # all on expert 0
    assert float(balance_loss(skewed_probs, skewed_choices)) == pytest.approx(E * 0.7)
    layer = moe_layer(moe__experts=E, moe__top_k=1, moe__balance_coef=0.5)
    layer.router.kernel[...] = jnp.zeros((D, E))                            # P uniform
    layer(inputs())
    assert float(layer.balance_loss[...]) == pytest.approx(0.5)


def test_z_loss_closed_form():
    logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, -1.0]]])
    lse = [math.log(4.0), math.log(math.e + math.e**2 + math.e**3 + math.e**-1)]
    assert float(z_loss(logits)) == pytest.approx((lse[0] ** 2 + lse[1] ** 2) / 2, rel=1e-6)
    layer = moe_layer(moe__experts=4, moe__z_coef=0.25)
    layer.router.kernel[...] = jnp.zeros((D, 4))
    layer(inputs())
    assert float(layer.z_loss[...]) == pytest.approx(0.25 * math.log(4.0) ** 2, rel=1e-6)


def test_aux_losses_depend_only_on_the_router():
    _, model = tiny_model(ffn="moe", moe__experts=4, num_layers=1)  # no later router
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = random_tokens((2, T))

    def aux(model):
        model(tokens)
        return sum(jnp.sum(leaf) for leaf in jax.tree.leaves(nnx.state(model, AuxLoss)))

    def aux_grads(params, rest):
        return nnx.grad(aux)(nnx.merge(graphdef, params, rest))

    grads = jax.jit(aux_grads)(params, rest)["blocks"]["ffn"]
    assert float(jnp.abs(grads["router"]["kernel"][...]).max()) > 0
    for weights in jax.tree.leaves(grads["routed_experts"]):
        assert float(jnp.abs(weights).max()) == 0.0


@pytest.mark.slow
def test_train_step_adds_the_aux_losses_and_trains_the_router():
    config = tiny_config(ffn="moe", moe__experts=4)
    config.optimizer.weight_decay = 0.0  # a parameter moves only if its gradient is nonzero
    config.optimizer.warmup_steps = 0  # (and the learning rate of step 0 is not 0)
    config = resolve(config, 1)
    program = TrainProgram(config, make_mesh(config, jax.devices()[:1]))
    state = program.init(0)
    batch = program.put_batch(np.asarray(random_tokens((8, T + 1))))
    cross_entropy = float(program.eval_loss(state, batch))  # evaluation: pure cross-entropy
    router_before = np.asarray(state["params"]["blocks"]["ffn"]["router"]["kernel"][...])
    state, metrics = program.train_step(state, batch)
    router_after = np.asarray(state["params"]["blocks"]["ffn"]["router"]["kernel"][...])
    assert (router_after != router_before).all()
    aux = sum(float(jnp.sum(leaf)) for leaf in
              jax.tree.leaves(nnx.state(state["model_state"], AuxLoss)))
    assert aux > 0
    assert float(metrics["aux_loss"]) == pytest.approx(aux, rel=1e-6)
    assert float(metrics["loss"]) - cross_entropy == pytest.approx(aux, rel=1e-4)
    dropped = jax.tree.leaves(nnx.state(state["model_state"], DroppedFraction))[0]
    assert float(metrics["moe_dropped_fraction"]) == pytest.approx(float(dropped.mean()))


def test_dense_models_have_no_aux_metrics():
    config = tiny_config()
    config = resolve(config, 1)
    program = TrainProgram(config, make_mesh(config, jax.devices()[:1]))
    state = jax.eval_shape(program._init_state, 0)
    batch = jax.ShapeDtypeStruct((8, T + 1), jnp.int32)
    metrics = jax.eval_shape(program._step, state, batch)[1]
    assert set(metrics) == {"loss", "grad_norm", "update_norm", "learning_rate", "finite"}


def _moe_program(devices: int, data: int, expert: int) -> TrainProgram:
    config = tiny_config(ffn="moe", moe__experts=4, moe__top_k=2, moe__dropless=True)
    config.mesh.update(data=data, expert=expert)
    config = resolve(config, devices)
    return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))


@pytest.mark.slow
def test_expert_parallel_matches_single_device():
    tokens = np.asarray(random_tokens((8, T + 1)))
    losses = {}
    for devices, data, expert in ((1, 1, 1), (8, 2, 4)):
        program = _moe_program(devices, data, expert)
        state = program.init(0)
        batch = program.put_batch(tokens)
        with jax.set_mesh(program.mesh):
            step = program._train_step.lower(state, batch).compile()
        if expert > 1:
            up = state["params"]["blocks"]["ffn"]["routed_experts"]["up"][...]
            assert up.sharding.spec == P(None, "expert", None, None)  # (layers, E, d, f)
            assert "all-to-all" in step.as_text()  # tokens move to their experts' devices
        losses[devices] = []
        for _ in range(2):
            state, metrics = step(state, program.put_batch(tokens))
            losses[devices].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[8], losses[1], rtol=1e-5)


def _moe_cfg(**overrides):
    config = tiny_config(ffn="moe", moe__experts=4, moe__top_k=2, moe__shared_experts=1,
                         **overrides)
    config = resolve(config, 1)
    return config.model


def test_accounting_counts_routed_experts_at_k_over_e():
    cfg = _moe_cfg()
    dense = tiny_config(ffn="swiglu")
    dense = resolve(dense, 1)
    layers, d, f, experts, k = 2, D, cfg.moe.d_ff, 4, 2
    assert f == cfg.ffn.d_ff == 128
    dense_ffn = 3 * d * f
    router, routed, shared = d * experts, 3 * experts * d * f, 3 * d * f
    total = parameter_count(dense.model) + layers * (router + routed + shared - dense_ffn)
    assert parameter_count(cfg) == total
    assert active_parameter_count(cfg) == total - layers * 3 * d * f * (experts - k)
    assert active_parameter_count(dense.model) == parameter_count(dense.model)
    assert matmul_parameter_count(cfg) == (matmul_parameter_count(dense.model)
                                           + layers * (router + 3 * d * f * k + shared - dense_ffn))


def test_config_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"model.moe.top_k=5 is invalid") as error:
        resolve(tiny_config(ffn="moe", moe__experts=4, moe__top_k=5), 1)
    assert "\n" not in str(error.value)
    config = tiny_config(ffn="moe", moe__experts=6)
    config.mesh.update(data=2, expert=4)
    with pytest.raises(ConfigError, match=r"model.moe.experts=6 .*mesh.expert=4") as error:
        config = resolve(config, 8)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"model.moe.capacity_factor=0"):
        resolve(tiny_config(ffn="moe", moe__capacity_factor=0), 1)
    with pytest.raises(ConfigError, match=r"model.moe.expert_ffn='moe'"):
        resolve(tiny_config(ffn="moe", moe__expert_ffn="moe"), 1)


@pytest.mark.slow
def test_every_kth_block_is_moe_and_decoding_matches_the_full_pass():
    cfg, model = tiny_model(ffn="moe", moe__every=2, num_layers=4, moe__experts=4,
                            moe__dropless=True)
    first, second = model.blocks.block_0, model.blocks.block_1
    assert type(first.ffn) is FFNS["swiglu"] and type(second.ffn) is MixtureOfExperts
    assert first.ffn.up.kernel.shape[0] == second.ffn.router.kernel.shape[0] == 2  # 2 groups
    dense_cfg, _ = tiny_model(ffn="swiglu", num_layers=4)
    all_moe_cfg, _ = tiny_model(ffn="moe", num_layers=4, moe__experts=4)
    dense, all_moe = parameter_count(dense_cfg), parameter_count(all_moe_cfg)
    assert parameter_count(cfg) == (dense + all_moe) // 2  # half the blocks are MoE
    tokens = random_tokens((2, 12))
    full = model(tokens)
    changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 256)
    # Dropless routing is causal up to float reordering: a later token can move an earlier
    # token's second choice to another capacity slot (another row of the expert matmul).
    np.testing.assert_allclose(model(changed)[:, :8], full[:, :8], atol=1e-5, rtol=1e-5)
    assert model.init_cache(2, 12)["key"].shape[:2] == (2, 2)  # groups × blocks per group
    decoded = prefill_then_decode(JittedDecoder(model), tokens, prefill=7, cache_length=12)
    np.testing.assert_allclose(decoded, full, atol=2e-5, rtol=1e-5)


def test_interleaving_must_divide_the_depth():
    config = tiny_config(ffn="moe", moe__every=3)  # 2 layers
    with pytest.raises(ConfigError, match=r"^model.moe.every=3 is invalid: must be a positive "
                                          r"divisor of model.num_layers=2$"):
        config = resolve(config, 1)
