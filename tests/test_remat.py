"""Remat policies by name (`execution.remat`, arch/remat.py): every policy gives `none`'s loss
and gradients, the compiled train step's temp memory is ordered as the policies save, and the
config names the valid policies."""

from __future__ import annotations

import chex
import jax
import pytest

from arch.remat import REMAT_POLICIES, host_offload_supported
from config import ConfigError, resolve
from sharding.mesh import make_mesh
from tests.helpers import random_tokens, tiny_config
from train.step import TrainProgram, compile_train_step

POLICIES = [name for name in REMAT_POLICIES if name != "offload" or host_offload_supported()]
RESIDUALS = {"prenorm": dict(), "block_attnres": dict(residual="block_attnres",
                                                      attnres__block_size=2)}


def _program(**model) -> TrainProgram:
    config = tiny_config(**model)
    config = resolve(config, 1)
    return TrainProgram(config, make_mesh(config, jax.devices()[:1]))


def _loss_and_grads(**model):
    program = _program(**model)
    state = program.init(0)
    return jax.jit(lambda *args: program._loss_and_grads(*args))(
        state["params"], state["model_state"], random_tokens((8, 17)))


@pytest.mark.parametrize("residual", RESIDUALS.values(), ids=RESIDUALS.keys())
@pytest.mark.slow
def test_every_policy_gives_the_loss_and_gradients_of_none(residual):
    reference = _loss_and_grads(execution__remat="none", **residual)
    for policy in POLICIES[1:]:
        chex.assert_trees_all_close(_loss_and_grads(execution__remat=policy, **residual), reference,
                                    atol=1e-6, rtol=1e-5, custom_message=policy)


def _temp_bytes(policy: str) -> int:
    program = _program(execution__remat=policy, num_layers=8, d_model=64, attention__num_heads=4,
                       attention__num_kv_heads=4)
    return compile_train_step(program)[1].memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_temp_memory_is_ordered_as_the_policies_save():
    """`none` keeps every residual of every block, `full` only each block's input and
    `save_attention_and_ffn_outputs` adds two B×T×D per block: both stay below `none` at 8
    layers. `full` ≤ `save_attention_and_ffn_outputs` is not asserted: XLA:CPU does not separate
    them structurally (at the quickstart's shape the saved outputs spare the recompute's own
    scratch and come out below `full`; docs/performance.md#remat-policies)."""
    temp = {policy: _temp_bytes(policy) for policy in ("full", "save_attention_and_ffn_outputs",
                                                      "none")}
    assert max(temp["full"], temp["save_attention_and_ffn_outputs"]) < temp["none"], temp


def test_unknown_policy_is_one_clear_line():
    with pytest.raises(ConfigError, match="execution.remat='nope' is invalid: valid: none, "):
        resolve(tiny_config(execution__remat="nope"), 1)
