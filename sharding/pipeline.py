"""Pipeline parallelism over the `stage` mesh axis: GPipe and circular (interleaved) schedules.

The G stacked layer-scan units (blocks, or `BlockGroup`s with interleaved MoE) are cut into
V·P chunks of K = G/(V·P) consecutive units, for P = mesh.stage devices and V =
`model.pipeline_virtual_stages` chunks per device; chunk c = v·P + p lives on device p
(round-robin), so the units' order is the reshape [G] → [V, P, K]:

    GPipe     (V = 1)  device p holds units p·K … (p+1)·K − 1: exactly the contiguous shards the
                       `layers → stage` rule already gives the stored parameters (no transfer);
    circular  (V > 1)  device p holds chunks p, P + p, 2P + p, …; the reshape moves parameters
                       between devices (GSPMD inserts the transfer, and its transpose for the
                       gradients, in every step).

The batch is split into M = `model.pipeline_microbatches` microbatches; a microbatch's whole
residual state (any pytree: the plain stream, hc/mhc/gated-residual streams, the AttnRes source
buffer with its counters) flows from stage to stage through `jax.lax.ppermute` inside a
`jax.shard_map` that is manual over `stage` only (data, fsdp, tensor, … stay automatic, so the
blocks' own sharding constraints still apply). At iteration t = 0 … V·M + P − 2 device p runs
chunk v = ⌊(t − p)/M⌋ on microbatch (t − p) mod M, valid when 0 ≤ t − p < V·M:

    stage 0 reads the microbatch from a buffer of M states (the embeddings at first); the others
    read what their predecessor sent at t − 1; every device sends its output to p + 1 (mod P).
    Device 0 receives the last stage's output for microbatch (t − P + 1) mod M and writes it back
    into the buffer: the input of that microbatch's next round of chunks (read again M − P ≥ 0
    iterations later, hence M ≥ P) or, after round V, its final state.

Idle slots compute on stale data whose results are never used (zero cotangent), so the bubble
fraction is (P − 1)/(V·M + P − 1) of each device's iterations (`bubble_fraction`). Differentiating
the iteration scan gives GPipe's all-forward-then-all-backward order (the activations of every
microbatch of a device's chunks are kept, or recomputed with `model.remat`). Non-parameter layer
state (the MoE `AuxLoss`/`DroppedFraction`) is the mean over the microbatches. The final states
leave the shard_map through a masked `psum` over `stage` (device 0's buffer), so the head runs as
without pipelining.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

SCHEDULES = ("gpipe", "circular")
AXIS = "stage"


def stage_count() -> int:
    """Size of the `stage` axis of the mesh in context (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(AXIS, 1)


def bubble_fraction(stages: int, virtual_stages: int, microbatches: int) -> float:
    """Idle share of each device's iterations: (P − 1)/(V·M + P − 1); 0 without pipelining."""
    if stages <= 1:
        return 0.0
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def layer_units(model_cfg) -> int:
    """G, the number of layer-scan units: blocks, or block groups with interleaved MoE."""
    from arch.model import interleaves_moe

    return model_cfg.num_layers // (model_cfg.moe_every if interleaves_moe(model_cfg) else 1)


def validate_pipeline(config, mesh: dict[str, int]) -> None:
    """Pipeline fields against the resolved mesh; ConfigError (one line) on the first problem."""
    from arch.config import check

    model = config.model
    check(model.pipeline_schedule in SCHEDULES, "model.pipeline_schedule",
          model.pipeline_schedule, f"valid schedules: {', '.join(SCHEDULES)}")
    for field in ("pipeline_microbatches", "pipeline_virtual_stages"):
        value = model[field]
        check(isinstance(value, int) and not isinstance(value, bool) and value > 0,
              f"model.{field}", value, "must be a positive integer")
    check(model.pipeline_schedule == "circular" or model.pipeline_virtual_stages == 1,
          "model.pipeline_virtual_stages", model.pipeline_virtual_stages,
          "gpipe runs one chunk per device; use 1 or model.pipeline_schedule='circular'")
    stages = mesh[AXIS]
    if stages == 1:
        return
    virtual, microbatches = model.pipeline_virtual_stages, model.pipeline_microbatches
    units, chunks = layer_units(model), stages * model.pipeline_virtual_stages
    what = (f"its {units} layer groups (num_layers / moe_every)" if units != model.num_layers
            else f"its {units} layers")
    check(units % chunks == 0, "model.num_layers", model.num_layers,
          f"{what} must split evenly into mesh.stage × model.pipeline_virtual_stages = "
          f"{stages}×{virtual} = {chunks} pipeline chunks")
    check(microbatches >= stages, "model.pipeline_microbatches", microbatches,
          f"must be at least mesh.stage={stages} (every stage needs a microbatch in flight)")
    batch_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    check(config.batch_size % (batch_shards * microbatches) == 0, "model.pipeline_microbatches",
          microbatches, f"must divide the {config.batch_size // batch_shards} rows of each data "
          f"shard (batch_size={config.batch_size} over mesh.data×mesh.fsdp×mesh.expert = "
          f"{batch_shards})")
    check(not model.reversible, "model.reversible", True,
          f"reversible blocks are not pipelined; use mesh.stage=1 (got mesh.stage={stages})")
    check(model.norm not in ("batchnorm", "causal_batchnorm"), "model.norm", model.norm,
          f"batch statistics of a microbatch differ from the batch's under mesh.stage={stages};"
          " use a per-token norm or mesh.stage=1")


def to_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """B×… → M×(B/M)×…, microbatch m = rows m, m + M, m + 2M, …: each data shard's contiguous
    rows split locally (no transfer) when M divides the rows per shard."""
    return jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1)


def from_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `to_microbatches`: M×(B/M)×… → B×…."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _select(predicate, on_true, on_false):
    return jax.tree.map(lambda a, b: jnp.where(predicate, a, b), on_true, on_false)


def _index(tree, index):
    return jax.tree.map(
        lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=0, keepdims=False), tree)


def pipeline(run_unit: Callable, inputs_M, layer_params, layer_states, *, stages: int,
             virtual_stages: int):
    """Run G stacked layer-scan units over M microbatches as a P = `stages` pipeline.

    `run_unit(carry, (params, states)) -> (carry, new_states)` is one unit (the body of the
    ordinary layer scan, remat already applied); `inputs_M` a pytree whose leaves have a leading
    microbatch axis M (the carries the first unit reads); `layer_params`, `layer_states` pytrees
    whose leaves have a leading unit axis G. Returns (the carries after the last unit, leading
    axis M; the new layer states, leading axis G, averaged over the microbatches). Must run under
    a mesh with a `stage` axis of size `stages` (schedule and indexing: the module docstring).
    """
    microbatches = jax.tree.leaves(inputs_M)[0].shape[0]
    units = jax.tree.leaves(layer_params)[0].shape[0]
    chunk = units // (virtual_stages * stages)
    iterations = virtual_stages * microbatches + stages - 1
    to_chunks = lambda x: x.reshape(virtual_stages, stages, chunk, *x.shape[1:])  # noqa: E731
    chunked = PartitionSpec(None, AXIS)  # [V, P, K, …]: this device's chunks on axis 1

    def run_chunk(carry, params_K, states_K):
        return jax.lax.scan(run_unit, carry, (params_K, states_K))

    def per_device(params_VxPxK, states_VxPxK, inputs_M):
        stage = jax.lax.axis_index(AXIS)
        params_VxK, states_VxK = (jax.tree.map(lambda x: x[:, 0], tree)
                                  for tree in (params_VxPxK, states_VxPxK))
        buffer = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), inputs_M)
        received = _index(buffer, 0)  # a real state for the idle first iterations
        state_sums = jax.tree.map(
            lambda x: jax.lax.pcast(jnp.zeros(x.shape, jnp.float32), AXIS, to="varying"),
            states_VxK)

        def iteration(carry, t):
            buffer, received, state_sums = carry
            offset = t - stage  # rounds·M + microbatch of the work this device does now
            chunk_index = jnp.clip(offset // microbatches, 0, virtual_stages - 1)
            carry_in = _select(stage == 0, _index(buffer, t % microbatches), received)
            carry_out, new_states = run_chunk(carry_in, _index(params_VxK, chunk_index),
                                              _index(states_VxK, chunk_index))
            valid = (offset >= 0) & (offset < virtual_stages * microbatches)
            state_sums = jax.tree.map(
                lambda total, new: total.at[chunk_index].add(jnp.where(valid, new, 0)),
                state_sums, new_states)
            received = jax.lax.ppermute(carry_out, AXIS,
                                        [(p, (p + 1) % stages) for p in range(stages)])
            slot, back = (t - stages + 1) % microbatches, (stage == 0) & (t >= stages - 1)
            buffer = jax.tree.map(
                lambda b, r: b.at[slot].set(jnp.where(back, r, b[slot])), buffer, received)
            return (buffer, received, state_sums), None

        (buffer, _, state_sums), _ = jax.lax.scan(
            iteration, (buffer, received, state_sums), jnp.arange(iterations))
        outputs_M = jax.tree.map(
            lambda x: jax.lax.psum(jnp.where(stage == 0, x, jnp.zeros_like(x)), AXIS), buffer)
        new_states = jax.tree.map(lambda total, old: (total / microbatches).astype(old.dtype),
                                  state_sums, states_VxK)
        return outputs_M, jax.tree.map(lambda x: x[:, None], new_states)

    outputs_M, new_states = jax.shard_map(
        per_device, in_specs=(chunked, chunked, PartitionSpec()),
        out_specs=(PartitionSpec(), chunked), axis_names={AXIS},
    )(jax.tree.map(to_chunks, layer_params), jax.tree.map(to_chunks, layer_states), inputs_M)
    return outputs_M, jax.tree.map(lambda x: x.reshape(units, *x.shape[3:]), new_states)
