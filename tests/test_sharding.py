"""Sharded equals single-device: data, FSDP and tensor parallelism alone and combined."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from config import resolve
from sharding.mesh import make_mesh
from sharding.rules import logical_to_spec
from tests.helpers import random_tokens, tiny_config
from train.step import TrainProgram


def program_on(devices: int, data: int, fsdp: int, tensor: int, **model) -> TrainProgram:
    config = tiny_config(**model)
    config.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
    config = resolve(config, devices)
    return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))


def logits_and_grads(program: TrainProgram, state, tokens):
    def logits(params, tokens):
        return nnx.merge(program.graphdef, params, state["model_state"])(tokens[:, :-1])

    def grads(params, tokens):
        return program._loss_and_grads(params, state["model_state"], tokens)[1]

    with jax.set_mesh(program.mesh):
        batch = program.put_batch(tokens)
        return (jax.device_get(jax.jit(logits)(state["params"], batch)),
                jax.device_get(jax.jit(grads)(state["params"], batch)))


@pytest.fixture(scope="module")
def single_device():
    program = program_on(1, 1, 1, 1)
    tokens = np.asarray(random_tokens((8, 17)))
    state = program.init(0)
    logits, grads = logits_and_grads(program, state, tokens)
    losses = []
    for _ in range(5):
        state, metrics = program.train_step(state, program.put_batch(tokens))
        losses.append(float(metrics["loss"]))
    return tokens, jax.device_get(program.init(0)["params"]), logits, grads, losses


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 4, 1), (2, 2, 2)], ids=str)
@pytest.mark.slow
def test_sharded_matches_single_device(mesh, single_device):
    tokens, params_1, logits_1, grads_1, losses_1 = single_device
    program = program_on(8, *mesh)
    state = program.init(0)
    query_spec = state["params"]["blocks"]["attention"]["query"]["kernel"][...].sharding.spec
    expected = P(None, "fsdp" if mesh[1] > 1 else None, "tensor" if mesh[2] > 1 else None)
    assert tuple(query_spec)[:3] == tuple(expected)  # the parameters really are sharded
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 jax.device_get(state["params"]), params_1)

    logits, grads = logits_and_grads(program, state, tokens)
    np.testing.assert_allclose(logits, logits_1, atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4),
                 grads, grads_1)
    losses = []
    for _ in range(5):
        state, metrics = program.train_step(state, program.put_batch(tokens))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, losses_1, rtol=1e-5)
    assert program._train_step._cache_size() == 1  # every state leaf keeps its dtype: no recompile


def test_rules_replicate_what_the_mesh_cannot_divide():
    mesh = dict(data=2, fsdp=2, tensor=4, sequence=1, stage=1, expert=1)
    assert logical_to_spec(("embed", "heads"), (64, 8), mesh) == P("fsdp", "tensor")
    assert logical_to_spec(("embed", "kv_heads"), (64, 1), mesh) == P("fsdp", None)  # MQA
    assert logical_to_spec(("act_batch", "act_seq"), (8, 16), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("layers", "embed"), (4, 64), mesh) == P(None, "fsdp")  # stage = 1
