"""Pipeline parallelism over the `stage` mesh axis: GPipe and circular (interleaved) schedules.

The G stacked layer-scan units (blocks, or `BlockGroup`s with interleaved MoE) are cut into
V·P chunks of K = G/(V·P) consecutive units, for P = mesh.stage devices and V =
`execution.pipeline.virtual_stages` chunks per device; chunk c = v·P + p lives on device p
(round-robin), so the units' order is the reshape [G] → [V, P, K]:

    GPipe     (V = 1)  device p holds units p·K … (p+1)·K − 1: exactly the contiguous shards the
                       `layers → stage` rule already gives the stored parameters (no transfer);
    circular  (V > 1)  device p holds chunks p, P + p, 2P + p, …; the reshape moves parameters
                       between devices (GSPMD inserts the transfer, and its transpose for the
                       gradients, in every step).

The batch is split into M = `execution.pipeline.microbatches` microbatches; a microbatch's
residual state (any pytree: the plain stream, several streams, a buffer of depth sources with its
counters) flows from stage to stage through `jax.lax.ppermute` inside a
`jax.shard_map` that is manual over `stage` only (data, fsdp, tensor, … stay automatic, so the
blocks' own sharding constraints still apply). At iteration t = 0 … V·M + P − 2 device p runs
chunk v = ⌊(t − p)/M⌋ on microbatch (t − p) mod M, valid when 0 ≤ t − p < V·M:

    every device keeps its own copy of the M carries (the inputs at first), reads the
    microbatch's carry from it, writes its output back, and sends a message to p + 1 (mod P),
    which merges it into its copy: the carry it reads at t + 1 (device 0: the input of that
    microbatch's next round of chunks, read M − P ≥ 0 iterations later, hence M ≥ P, or after
    round V its final state).

The message is the whole residual state by default (positions never cross: each copy has them).
`execution.pipeline.transfer="cached"` (the default) lets a mechanism whose state is a growing
history send less (`stage_message`/`stage_merge` of its `arch.residual.ResidualStream`; the cached
transfer of the Attention Residuals report, Kimi Team 2026): a receiver last held the microbatch
P − 1 chunks ago, a lag of (P − 1)·2L/(V·P) sublayers, so it needs only what was written since:
O(P) chunks' worth instead of O(V·P) at the last transitions (`stage_transfer_bytes` counts it in
the compiled program). `"full"` sends the whole state (the naive schedule).

Idle slots compute on stale data whose results are never used (zero cotangent), so the bubble
fraction is (P − 1)/(V·M + P − 1) of each device's iterations (`bubble_fraction`). Differentiating
the iteration scan gives GPipe's all-forward-then-all-backward order (the activations of every
microbatch of a device's chunks are kept, or recomputed under `execution.remat`). Non-parameter
layer state (the MoE `AuxLoss`/`DroppedFraction`) is the mean over the microbatches. The final
states leave the shard_map through a masked `psum` over `stage` (device 0's copies), so the head
runs as without pipelining.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

TRANSFER_SCOPE = "stage_transfer"  # names the stage-to-stage ppermutes in the compiled program
AXIS = "stage"


def stage_count() -> int:
    """Size of the `stage` axis of the mesh in context (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(AXIS, 1)


def iterations(stages: int, virtual_stages: int, microbatches: int) -> int:
    """Iterations of each device in one pass through the pipeline: V·M + P − 1."""
    return virtual_stages * microbatches + stages - 1


def bubble_fraction(stages: int, virtual_stages: int, microbatches: int) -> float:
    """Idle share of each device's iterations: (P − 1)/(V·M + P − 1); 0 without pipelining."""
    if stages <= 1:
        return 0.0
    return (stages - 1) / iterations(stages, virtual_stages, microbatches)


def stage_transfer_bytes(hlo_text: str) -> int:
    """Bytes each device sends to the next stage per pipeline iteration, forward and backward
    (the cotangents flow back the same way), read off a compiled HLO module's text: the result
    sizes of the collective-permutes issued by `pipeline` (scope `stage_transfer`; of an async
    `collective-permute-start`, its first tuple element). Times V·M + P − 1 iterations: a
    step's."""
    total = 0
    for line in hlo_text.splitlines():
        match = re.search(r"= (.*?) collective-permute(-start)?\(", line)
        if not match or f"{TRANSFER_SCOPE}/ppermute" not in line:
            continue
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
        for dtype, dims in shapes[:1] if match.group(2) else shapes:
            bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
            total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def to_microbatches(x: jax.Array, microbatches: int) -> jax.Array:
    """B×… → M×(B/M)×…, microbatch m = rows m, m + M, m + 2M, …: each data shard's contiguous
    rows split locally (no transfer) when M divides the rows per shard."""
    return jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1)


def from_microbatches(x: jax.Array) -> jax.Array:
    """The inverse of `to_microbatches`: M×(B/M)×… → B×…."""
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _index(tree, index):
    return jax.tree.map(
        lambda x: jax.lax.dynamic_index_in_dim(x, index, axis=0, keepdims=False), tree)


def _write(tree, index, value, predicate):
    """`tree` with entry `index` of its leading axis replaced by `value` where `predicate`."""
    return jax.tree.map(lambda b, v: b.at[index].set(jnp.where(predicate, v, b[index])),
                        tree, value)


def pipeline(run_unit: Callable, inputs_M, layer_params, layer_states, *, stages: int,
             virtual_stages: int, message: Callable, merge: Callable):
    """Run G stacked layer-scan units over M microbatches as a P = `stages` pipeline.

    `run_unit(carry, (params, states)) -> (carry, new_states)` is one unit (the body of the
    ordinary layer scan, remat already applied); `inputs_M` a pytree whose leaves have a leading
    microbatch axis M (the carries the first unit reads); `layer_params`, `layer_states` pytrees
    whose leaves have a leading unit axis G. Returns (the carries after the last unit, leading
    axis M; the new layer states, leading axis G, averaged over the microbatches). Must run under
    a mesh with a `stage` axis of size `stages` (schedule and indexing: the module docstring).

    What crosses a stage boundary is `message(carry)`, and the receiving stage rebuilds the carry
    as `merge(cached, message)` from its own copy of that microbatch's carry (as it last held it:
    its own output P − 1 chunks earlier, or the input before its first chunk): e.g. the whole
    residual state, or for a history that only grows what was added in the last P − 1 chunks.
    """
    microbatches = jax.tree.leaves(inputs_M)[0].shape[0]
    units = jax.tree.leaves(layer_params)[0].shape[0]
    chunk = units // (virtual_stages * stages)
    rounds = virtual_stages * microbatches  # valid (chunk, microbatch) work items per device
    to_chunks = lambda x: x.reshape(virtual_stages, stages, chunk, *x.shape[1:])
    chunked = PartitionSpec(None, AXIS)  # [V, P, K, …]: this device's chunks on axis 1

    def run_chunk(carry, params_K, states_K):
        return jax.lax.scan(run_unit, carry, (params_K, states_K))

    def per_device(params_VxPxK, states_VxPxK, inputs_M):
        stage = jax.lax.axis_index(AXIS)
        sender = (stage - 1) % stages
        params_VxK, states_VxK = (jax.tree.map(lambda x: x[:, 0], tree)
                                  for tree in (params_VxPxK, states_VxPxK))
        # this device's copy of every microbatch's carry: the inputs, then what it computed
        # itself or received from its predecessor
        cached_M = jax.tree.map(lambda x: jax.lax.pcast(x, AXIS, to="varying"), inputs_M)
        state_sums = jax.tree.map(
            lambda x: jax.lax.pcast(jnp.zeros(x.shape, jnp.float32), AXIS, to="varying"),
            states_VxK)

        def iteration(carry, t):
            cached_M, state_sums = carry
            offset = t - stage  # rounds·M + microbatch of the work this device does now
            microbatch, valid = offset % microbatches, (offset >= 0) & (offset < rounds)
            chunk_index = jnp.clip(offset // microbatches, 0, virtual_stages - 1)
            carry_out, new_states = run_chunk(_index(cached_M, microbatch),
                                              _index(params_VxK, chunk_index),
                                              _index(states_VxK, chunk_index))
            state_sums = jax.tree.map(
                lambda total, new: total.at[chunk_index].add(jnp.where(valid, new, 0)),
                state_sums, new_states)
            cached_M = _write(cached_M, microbatch, carry_out, valid)
            with jax.named_scope(TRANSFER_SCOPE):
                received = jax.lax.ppermute(message(carry_out), AXIS,
                                            [(p, (p + 1) % stages) for p in range(stages)])
            # the predecessor's microbatch: the next one here (stage 0: read M − P ≥ 0
            # iterations later, the input of its next round of chunks or its final state)
            sent = t - sender
            slot = sent % microbatches
            cached_M = _write(cached_M, slot, merge(_index(cached_M, slot), received),
                              (sent >= 0) & (sent < rounds))
            return (cached_M, state_sums), None

        (cached_M, state_sums), _ = jax.lax.scan(
            iteration, (cached_M, state_sums),
            jnp.arange(iterations(stages, virtual_stages, microbatches)))
        outputs_M = jax.tree.map(
            lambda x: jax.lax.psum(jnp.where(stage == 0, x, jnp.zeros_like(x)), AXIS), cached_M)
        new_states = jax.tree.map(lambda total, old: (total / microbatches).astype(old.dtype),
                                  state_sums, states_VxK)
        return outputs_M, jax.tree.map(lambda x: x[:, None], new_states)

    outputs_M, new_states = jax.shard_map(
        per_device, in_specs=(chunked, chunked, PartitionSpec()),
        out_specs=(PartitionSpec(), chunked), axis_names={AXIS},
    )(jax.tree.map(to_chunks, layer_params), jax.tree.map(to_chunks, layer_states), inputs_M)
    return outputs_M, jax.tree.map(lambda x: x.reshape(units, *x.shape[3:]), new_states)
