"""Logical axis names → mesh axes: the one table that decides how everything is sharded.

Every parameter is created with logical axis names (`embed`, `heads`, `mlp`, ...); activations are
constrained at block boundaries with `constrain(x, ("act_batch", "act_seq", "act_embed"))`. This
module maps both onto the physical mesh axes `data, fsdp, tensor, sequence, stage, expert`.
Parameters and activations use different names for the model width on purpose (MaxText style):
FSDP shards a parameter's `embed` dimension, while activations are sharded by batch instead.
A mesh axis of size 1 costs nothing, so the same rules serve one CPU and a pod.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

# logical name -> mesh axis, tuple of mesh axes, or None (replicated).
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "norm_rank": None,       # GatedNorm's low-rank gate (arch/norms.py)
    "positions": None,
    "layers": "stage",
    "experts": "expert",
    "kv_latent": None,   # MLA key/value latent width d_c
    "q_latent": None,    # MLA query latent width d_c'
    "head_mixture": None,  # K components of the mos/moc heads
    "head_context": "tensor",  # width of the mos/moc component contexts
    "mtp_concat": "tensor",  # the 2d input [norm(h); norm(Emb)] of an MTP projection (arch/mtp)
    # activations
    "act_batch": ("data", "fsdp", "expert"),  # outside MoE layers, expert = data parallelism
    "act_expert_batch": ("data", "fsdp"),  # batch of the dispatched (B, E, C, d) MoE tokens
    "act_experts": "expert",  # their experts axis: the change from act_batch is the all-to-all
    "act_seq": "sequence",
    # The residual stream's tokens (and so its norms and the AttnRes/hyper-connection state) are
    # sharded over tensor too: Megatron-style sequence parallelism (Korthikanti et al. 2022,
    # "Reducing Activation Recomputation in Large Transformer Models", §4.2.2). Entering a
    # tensor-parallel region all-gathers the tokens; leaving it reduce-scatters them.
    "act_stream_seq": ("sequence", "tensor"),
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


# The residual stream's logical axes, constrained at every sublayer boundary.
STREAM = ("act_batch", "act_stream_seq", "act_embed")


def _mesh_axes(name: str | None, rules: dict) -> tuple[str, ...]:
    if name is None:
        return ()
    if name not in rules:
        raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
    target = rules[name]
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def logical_to_spec(
    logical: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh_shape: dict[str, int] | None = None,
    rules: dict = LOGICAL_RULES,
) -> PartitionSpec:
    """Translate logical axis names into a mesh PartitionSpec.

    With `shape` and `mesh_shape`, mesh axes of size 1 are dropped and a dimension that the mesh
    axes do not divide is replicated instead (e.g. 1 KV head under tensor parallelism, MQA), and a
    mesh axis is never used twice in one spec.
    """
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical):
        axes = [a for a in _mesh_axes(name, rules) if a not in used]
        if mesh_shape is not None:
            axes = [a for a in axes if mesh_shape[a] > 1]
            size = 1
            for a in axes:
                size *= mesh_shape[a]
            if shape is not None and shape[dim] % size:
                axes = []
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def named_sharding(mesh: jax.sharding.Mesh, logical, shape=None) -> NamedSharding:
    """NamedSharding on `mesh` for an array of `shape` with the given logical axis names."""
    return NamedSharding(mesh, logical_to_spec(logical, shape, dict(mesh.shape)))


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Constrain an activation's sharding by logical names; a no-op outside a mesh context."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(logical, x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)
