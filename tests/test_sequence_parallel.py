"""Sequence parallelism: the striping permutation, all-gather and ring attention, Megatron-style
sequence parallelism of the stream, and sharded = single-device for several residual mechanisms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from arch.residual import RESIDUALS as RESIDUALS_REGISTRY
from arch.residual import constrain_state
from config import ConfigError, resolve
from sharding.mesh import make_mesh
from sharding.rules import STREAM, logical_to_spec
from sharding.sequence import any_causal_pair, stripe_batch, stripe_order
from tests.helpers import override, random_tokens, tiny_config
from train.step import TrainProgram, next_token_loss

RESIDUALS = {"prenorm": {}, "block_attnres": dict(attnres__block_size=2), "mhc": {},
             "gated_residual": {}}
TOKENS = np.asarray(random_tokens((8, 17)))


def program_on(mesh: dict, residual: str, **model) -> TrainProgram:
    config = tiny_config(residual=residual, **RESIDUALS[residual], **model)
    config.mesh.update({"data": 1, **mesh})
    devices = int(np.prod(list(mesh.values()))) if mesh else 1
    config = resolve(config, devices)
    return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))


def loss_grads_logits(program: TrainProgram, params, model_state, decode: bool = False):
    """Loss, gradients and logits (in position order) on `program`'s mesh, the model run in the
    train step's order (`program.model_inputs`: striped under sequence parallelism); with
    `decode`, also the logits of a KV-cache prefill of the whole sequence in position order.
    Returns the outputs and the compiled HLO text."""
    inverse = np.argsort(stripe_order(TOKENS.shape[1] - 1, program.sequence_shards))

    def outputs(params, tokens_BxT1):
        def loss(params):
            model = nnx.merge(program.graphdef, params, model_state)
            inputs_BxT, targets_BxT, positions_BxT = program.model_inputs(tokens_BxT1)
            logits_BxTxV = model(inputs_BxT, positions_BxT)
            return next_token_loss(logits_BxTxV, targets_BxT), logits_BxTxV

        (value, logits_BxTxV), grads = jax.value_and_grad(loss, has_aux=True)(params)
        result = {"loss": value, "grads": grads, "logits": logits_BxTxV[:, inverse]}
        if decode:
            model = nnx.merge(program.graphdef, params, model_state)
            inputs_BxT = tokens_BxT1[:, :-1]
            positions_BxT = jnp.broadcast_to(jnp.arange(inputs_BxT.shape[1]), inputs_BxT.shape)
            cache = model.init_cache(*inputs_BxT.shape)
            result["decoded"] = model.decode(inputs_BxT, positions_BxT, cache)[0]
        return result

    with jax.set_mesh(program.mesh):
        params = jax.device_put(params, program.state_shardings["params"])
        model_state = jax.device_put(model_state, program.state_shardings["model_state"])
        batch = program.put_batch(TOKENS)
        compiled = jax.jit(outputs).lower(params, batch).compile()
        return jax.device_get(compiled(params, batch)), compiled.as_text()


@pytest.fixture(scope="module")
def single_device():
    """residual -> (initial parameters and model state, single-device outputs), computed once
    per residual."""
    cache = {}

    def reference(residual: str):
        if residual not in cache:
            program = program_on({}, residual)
            with jax.set_mesh(program.mesh):
                state = jax.device_get(jax.jit(program._init_state)(0))
            variables = state["params"], state["model_state"]
            cache[residual] = variables, loss_grads_logits(program, *variables)[0]
        return cache[residual]
    return reference


def test_stripe_order_round_trip_and_equal_causal_work():
    for shards, length in ((1, 16), (2, 16), (4, 16), (4, 32), (8, 48)):
        order = stripe_order(length, shards)
        assert sorted(order) == list(range(length))  # a permutation
        np.testing.assert_array_equal(order[np.argsort(order)], np.arange(length))
        # Causal work of shard i: Σ (t + 1) over its query positions t; equal on every shard.
        work = (order + 1).reshape(shards, -1).sum(1)
        assert (work == work[0]).all(), (shards, length, work)
    np.testing.assert_array_equal(stripe_order(16, 4)[:4], [0, 1, 14, 15])  # chunks 0 and 7
    inputs, targets, positions = stripe_batch(jnp.asarray(TOKENS), 4)
    rows = np.arange(8)[:, None]
    np.testing.assert_array_equal(inputs, TOKENS[rows, positions])
    np.testing.assert_array_equal(targets, TOKENS[rows, positions + 1])  # the token after
    with pytest.raises(ValueError, match="seq_len=12 is not divisible by 2 × 4"):
        stripe_order(12, 4)


def test_ring_attention_skips_the_same_number_of_blocks_on_every_shard():
    """With striping, every shard computes 3 of its 4 stripe pairs on the first ring step (its
    own keys) and 2 of 4 on each later step: equal work per shard and step."""
    for shards in (2, 4, 8):
        stripes = stripe_order(32, shards).reshape(shards, 2, -1)  # shard, stripe, positions
        for shard in range(shards):
            computed = [sum(bool(any_causal_pair(stripes[(shard - step) % shards, key_half],
                                                 stripes[shard, query_half]))
                            for query_half in range(2) for key_half in range(2))
                        for step in range(shards)]
            assert computed == [3] + [2] * (shards - 1), (shards, shard, computed)


# (residual, execution.sequence_attention, mesh): 8 devices each; sequence 2 and 4, both attentions,
# with data, fsdp and tensor (Megatron-style stream), for Pre-Norm, mHC and Block AttnRes.
CASES = [
    ("prenorm", "ring", dict(data=2, sequence=2, tensor=2)),
    ("mhc", "all_gather", dict(fsdp=2, sequence=4)),
    ("block_attnres", "all_gather", dict(data=2, sequence=2, tensor=2)),
    ("gated_residual", "ring", dict(data=2, sequence=4)),
]


@pytest.mark.parametrize("residual,attention,mesh", CASES,
                         ids=[f"{r}-{a}-" + "x".join(f"{k}{v}" for k, v in m.items())
                              for r, a, m in CASES])
@pytest.mark.slow
def test_sequence_parallel_matches_single_device(residual, attention, mesh, single_device):
    variables, expected = single_device(residual)
    decode = residual == "prenorm"
    program = program_on(mesh, residual, execution__sequence_attention=attention)
    got, hlo = loss_grads_logits(program, *variables, decode=decode)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["logits"], expected["logits"], atol=2e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4),
                 got["grads"], expected["grads"])
    if decode:  # KV-cache decoding under a sequence mesh: the cache path all-gathers
        np.testing.assert_allclose(got["decoded"], expected["logits"], atol=2e-5, rtol=1e-5)
    if attention == "ring":  # keys and values really travel around the ring
        assert "collective-permute" in hlo


def test_block_attnres_history_is_sharded_over_sequence():
    config = tiny_config(residual="block_attnres", attnres__block_size=2)
    config.mesh.update(data=2, sequence=2, tensor=2)
    config = resolve(config, 8)
    cfg = config.model
    stream = RESIDUALS_REGISTRY["block_attnres"].stream(cfg, rngs=nnx.Rngs(0))
    x_BxTxD = jax.random.normal(jax.random.key(0), (8, 16, cfg.d_model))
    mesh = make_mesh(config, jax.devices())
    with jax.set_mesh(mesh):
        state = jax.jit(lambda x: constrain_state(stream.begin(x)))(x_BxTxD)
    slots = 3  # the embedding and N = 2 blocks (4 sublayers, S = 2)
    sources = state["sources"]
    assert sources.shape == (8, 16, slots * cfg.d_model)
    # Per device: B/data × T/(sequence·tensor) tokens (Megatron-style stream), all N+1 slots.
    assert sources.sharding.shard_shape(sources.shape) == (4, 4, slots * cfg.d_model)
    inverse = state["inverse_rms"]
    assert inverse.sharding.shard_shape(inverse.shape) == (4, 4, slots)
    assert logical_to_spec(STREAM, (8, 16, 32), dict(mesh.shape)) == P(
        "data", ("sequence", "tensor"), None)


def test_sequence_parallel_config_errors():
    def error(mesh=None, **overrides):
        sizes = {"sequence": 2, **(mesh or {})}
        config = tiny_config()
        config.mesh.update(data=1, **sizes)
        config.seq_len = overrides.pop("seq_len", config.seq_len)
        override(config, **overrides)
        with pytest.raises(ConfigError) as raised:
            config = resolve(config, int(np.prod(list(sizes.values()))))
        return str(raised.value)

    assert error(mesh=dict(sequence=4), seq_len=12) == (
        "seq_len=12 is invalid: must be divisible by 2×mesh.sequence = 8 (causal load balancing "
        "gives each sequence shard two chunks)")
    assert error(execution__sequence_attention="ring", attention="mla").startswith(
        "execution.sequence_attention='ring' is invalid: ring attention supports "
        "model.attention.name='mha' (got 'mla')")
    assert error(mesh=dict(stage=2), execution__sequence_attention="ring") == (
        "execution.sequence_attention='ring' is invalid: ring attention does not run inside the "
        "pipeline (mesh.stage=2); use execution.sequence_attention='all_gather'")
    assert error(execution__sequence_attention="ulysses").startswith(
        "execution.sequence_attention='ulysses' is invalid: valid: all_gather, ring")
    assert error(norm="causal_batchnorm").startswith(
        "model.norm.name='causal_batchnorm' is invalid")
    assert error(ffn="moe").startswith("model.moe.dropless=False is invalid: MoE capacity")
