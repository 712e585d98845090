"""Compiled memory of a train step: XLA's memory analysis per device, by what holds the bytes.

Compiled against abstract state: nothing is allocated or run, so a config too large for the
machine is measured all the same.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from arch.accounting import parameter_count
from train.step import build_program, compile_train_step


def _per_device_bytes(tree) -> int:
    """Bytes of one device's shards of ShapeDtypeStructs that carry shardings."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree))


def train_step_memory(config) -> dict:
    """XLA's memory analysis of the compiled train step of a resolved training config (compiled
    against abstract state: nothing is allocated or run), per device.

    Returns a dict of ints:
      parameter_bytes        one device's shards of the parameters (float32: 4 × parameter_count
                             on one device);
      optimizer_state_bytes  one device's shards of the whole optax state: AdamW's first and
                             second moments (each the parameters' shape and dtype, so 2 ×
                             parameter_bytes) plus its int32 step counters (4 bytes each);
                             gradient clipping keeps no state;
      model_state_bytes      non-parameter model state (BatchNorm statistics, MoE loss/metric
                             variables);  step_bytes, the int32 step counter;
      batch_bytes            the token batch, B×(T+1) int32;
      argument_bytes, output_bytes, alias_bytes, temp_bytes, generated_code_bytes
                             XLA's `memory_analysis()` (arguments = state + batch; the state is
                             donated, so outputs alias it; temp: activations, gradients and
                             other scratch);
      parameter_count        `arch.accounting.parameter_count`;  devices, the mesh size.
    """
    program = build_program(config)
    _, compiled = compile_train_step(program)
    memory = compiled.memory_analysis()
    state = program.abstract_state()
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32,
                                 sharding=program.batch_sharding)
    return {
        "parameter_bytes": _per_device_bytes(state["params"]),
        "optimizer_state_bytes": _per_device_bytes(state["opt_state"]),
        "model_state_bytes": _per_device_bytes(state["model_state"]),
        "step_bytes": _per_device_bytes(state["step"]),
        "batch_bytes": _per_device_bytes(batch),
        "argument_bytes": int(memory.argument_size_in_bytes),
        "output_bytes": int(memory.output_size_in_bytes),
        "alias_bytes": int(memory.alias_size_in_bytes),
        "temp_bytes": int(memory.temp_size_in_bytes),
        "generated_code_bytes": int(memory.generated_code_size_in_bytes),
        "parameter_count": parameter_count(config.model),
        "devices": program.mesh.size,
    }
