"""The one owner of the config's rules: `resolve(config, device_count, slice_count)` checks a
config against every rule, fills its derived fields and returns it frozen, with the mesh it runs
on. Everything that builds, trains, restores or measures a model takes a resolved config and
checks nothing again. No JAX: every error, mesh arithmetic included, is one line in a fraction
of a second.

The order: the training, optimizer and data fields (`config.validate.check_fields`), the
model's component names (`config.catalogue`), its rules and derived fields and the execution's
rules (`config.model_rules`), then the mesh: its shape for the devices, the batch over
its batch axes, gradient accumulation, tensor parallelism, hybrid stacks, sequence parallelism,
the pipeline and dropout.

A resolved config is an `ml_collections.FrozenConfigDict` with a `resolved` section: the device
and slice counts, each mesh axis's total size (`mesh`), its within-slice and across-slice
factors (`ici`, `dcn`), the batch shards (data × fsdp × expert) and the microbatch size
(batch_size / accumulation_steps). To change a field, change the unresolved config and resolve
it again.
"""

from __future__ import annotations

import ml_collections

from config import check, is_int
from config.catalogue import (
    PIPELINE,
    RING_ATTENTION,
    SEQUENCE_PARALLEL,
    has,
    limit,
    record,
    with_capability,
)
from config.derived import components_in_use, dropout_enabled, layer_attentions, layer_units
from config.mesh_shape import ici_dcn_shapes, mesh_shape
from config.model_rules import check_execution, resolve_model
from config.validate import check_fields

RESOLVED = "resolved"  # the section a resolved config adds


def is_resolved(config) -> bool:
    """Whether `config` is a config that `resolve` returned."""
    return isinstance(config, ml_collections.FrozenConfigDict) and RESOLVED in config


def require_resolved(config, taker: str) -> None:
    """TypeError unless `config` is resolved: `taker` checks nothing itself."""
    if not is_resolved(config):
        raise TypeError(f"{taker} takes a resolved config: pass config.resolve(config, "
                        "device_count) (its rules run once, there)")


def unresolved(config) -> ml_collections.ConfigDict:
    """A mutable copy of `config` without its `resolved` section (derived fields stay filled)."""
    if isinstance(config, ml_collections.FrozenConfigDict):
        config = config.as_configdict()
    copy = config.copy_and_resolve_references()
    if RESOLVED in copy:
        del copy[RESOLVED]
    return copy


def resolve(config, device_count: int, slice_count: int = 1) -> ml_collections.FrozenConfigDict:
    """`config` (a `base_config()`-shaped ConfigDict, or a resolved one) checked for
    `device_count` devices in `slice_count` TPU slices, with its derived fields filled and its
    `resolved` section added, frozen. `model.vocab_size` must be filled (0, "the tokenizer's
    size", is `train.data.tokenizer.check_vocab`'s to fill first).

    Raises `ConfigError`: one line naming the field, the value and what is valid.
    """
    check(is_int(device_count) and device_count > 0, "device_count", device_count,
          "must be a positive integer")
    check(is_int(slice_count) and slice_count > 0, "slice_count", slice_count,
          "must be a positive integer")
    config = unresolved(config)
    check_fields(config)
    model = config.model
    if model.max_seq_len is None:
        model.max_seq_len = config.seq_len
    resolve_model(model)
    check_execution(config.execution)
    check(model.head.mtp_depth < config.seq_len, "model.head.mtp_depth", model.head.mtp_depth,
          f"must be below seq_len={config.seq_len} (MTP depth j has seq_len − j targets)")

    mesh = mesh_shape(config.mesh, device_count)
    ici, dcn = ici_dcn_shapes(config.mesh, mesh, slice_count)
    # Outside the MoE layers the expert axis is extra data parallelism (sharding rule act_batch).
    batch_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    check(config.batch_size % batch_shards == 0, "batch_size", config.batch_size,
          f"must be divisible by mesh.data×mesh.fsdp×mesh.expert = {batch_shards}")
    _check_accumulation(config, batch_shards, mesh["stage"])
    tensor = mesh["tensor"]
    heads = model.attention.num_heads
    check(heads % tensor == 0, "model.attention.num_heads", heads,
          f"must be divisible by mesh.tensor={tensor}")
    check(model.ffn.d_ff % tensor == 0, "model.ffn.d_ff", model.ffn.d_ff,
          f"must be divisible by mesh.tensor={tensor}")
    for family, name in components_in_use(model):  # each component's rules on the mesh
        mesh_rules = record(family, name).mesh_rules
        if mesh_rules is not None:
            mesh_rules(model, mesh)
    _check_components_on_mesh(model, mesh)
    if mesh["sequence"] > 1:
        _check_sequence_parallel(config, mesh["sequence"], mesh["stage"])
    check(mesh["stage"] == 1 or model.loop_count == 1, "model.loop_count", model.loop_count,
          f"looped depth does not run in the pipeline (mesh.stage={mesh['stage']}); use "
          "mesh.stage=1 or model.loop_count=1")
    _check_pipeline(config, mesh, batch_shards)
    if dropout_enabled(model):
        _check_dropout(config, mesh)
    config[RESOLVED] = dict(
        device_count=device_count, slice_count=slice_count, mesh=mesh, ici=ici, dcn=dcn,
        batch_shards=batch_shards, microbatch_size=config.batch_size // config.accumulation_steps)
    return ml_collections.FrozenConfigDict(config)


def _check_accumulation(config, batch_shards: int, stages: int) -> None:
    """Gradient accumulation (`train.step`): each microbatch keeps the batch sharding, and the
    pipeline, which microbatches by itself, does not accumulate on top."""
    steps = config.accumulation_steps
    if steps == 1:
        return
    check(stages == 1, "accumulation_steps", steps,
          f"does not compose with the pipeline (mesh.stage={stages}), which already "
          "microbatches; use execution.pipeline.microbatches or accumulation_steps=1")
    micro = config.batch_size // steps
    check(micro % batch_shards == 0, "accumulation_steps", steps,
          f"leaves microbatches of batch_size/accumulation_steps = {micro} sequences, not "
          f"divisible by mesh.data×mesh.fsdp×mesh.expert = {batch_shards}; lower "
          "accumulation_steps or raise batch_size")


def _check_components_on_mesh(model, mesh: dict[str, int]) -> None:
    """Hybrid stacks run in the ordinary layer scan, not the pipeline; and each component in use
    must declare the capability of each parallelism the mesh uses (`config.catalogue`):
    `sequence_parallel` for mesh.sequence > 1, `pipeline` for mesh.stage > 1."""
    if model.layer_pattern:
        check(mesh["stage"] == 1, "model.layer_pattern", model.layer_pattern,
              f"hybrid stacks do not run in the pipeline (mesh.stage={mesh['stage']}); use "
              "mesh.stage=1")
    for axis, capability in (("sequence", SEQUENCE_PARALLEL), ("stage", PIPELINE)):
        if mesh[axis] == 1:
            continue
        for name in dict.fromkeys(layer_attentions(model)):
            check(has("attention", name, capability), f"mesh.{axis}", mesh[axis],
                  f"{name} blocks {limit('attention', name, capability)}; use mesh.{axis}=1")
    norm = model.norm.name
    if mesh["sequence"] > 1:
        check(has("norm", norm, SEQUENCE_PARALLEL), "model.norm.name", norm,
              f"{limit('norm', norm, SEQUENCE_PARALLEL)}, which mesh.sequence="
              f"{mesh['sequence']} permutes (striping); use another norm or mesh.sequence=1")
    if mesh["stage"] > 1:
        check(has("norm", norm, PIPELINE), "model.norm.name", norm,
              f"{limit('norm', norm, PIPELINE)} under mesh.stage={mesh['stage']}; use a "
              "per-token norm or mesh.stage=1")


def _check_sequence_parallel(config, shards: int, stages: int) -> None:
    """What sequence parallelism (`sharding/sequence.py`) needs: a sequence that stripes into
    2 × shards chunks, and components that do not depend on the tokens' array order."""
    model, execution = config.model, config.execution
    check(config.seq_len % (2 * shards) == 0, "seq_len", config.seq_len,
          f"must be divisible by 2×mesh.sequence = {2 * shards} (causal load balancing gives "
          "each sequence shard two chunks)")
    if execution.sequence_attention == "ring":
        for name in dict.fromkeys(layer_attentions(model)):
            check(has("attention", name, RING_ATTENTION), "execution.sequence_attention", "ring",
                  f"ring attention supports {' and '.join(_ring_mixers())} (got "
                  f"{name!r}); use execution.sequence_attention='all_gather'")
        check(stages == 1, "execution.sequence_attention", "ring",
              f"ring attention does not run inside the pipeline (mesh.stage={stages}); use "
              "execution.sequence_attention='all_gather'")


def _check_pipeline(config, mesh: dict[str, int], batch_shards: int) -> None:
    """The pipeline (`sharding/pipeline.py`) on mesh.stage = P devices: the layer-scan units
    split evenly into P × V chunks, at least P microbatches that divide each data shard's rows,
    and per-token, stateless-in-the-batch blocks."""
    stages, model, pipeline = mesh["stage"], config.model, config.execution.pipeline
    if stages == 1:
        return
    virtual, microbatches = pipeline.virtual_stages, pipeline.microbatches
    units, chunks = layer_units(model), stages * virtual
    what = (f"its {units} layer groups (num_layers / moe.every)" if units != model.num_layers
            else f"its {units} layers")
    check(units % chunks == 0, "model.num_layers", model.num_layers,
          f"{what} must split evenly into mesh.stage × execution.pipeline.virtual_stages = "
          f"{stages}×{virtual} = {chunks} pipeline chunks")
    check(microbatches >= stages, "execution.pipeline.microbatches", microbatches,
          f"must be at least mesh.stage={stages} (every stage needs a microbatch in flight)")
    check(config.batch_size % (batch_shards * microbatches) == 0, "execution.pipeline.microbatches",
          microbatches, f"must divide the {config.batch_size // batch_shards} rows of each data "
          f"shard (batch_size={config.batch_size} over mesh.data×mesh.fsdp×mesh.expert = "
          f"{batch_shards})")
    check(not model.reversible, "model.reversible", True,
          f"reversible blocks are not pipelined; use mesh.stage=1 (got mesh.stage={stages})")


def _ring_mixers() -> list[str]:
    return [f"model.attention.name={name!r}" for name in with_capability("attention",
                                                                          RING_ATTENTION)]


def _check_dropout(config, mesh: dict[str, int]) -> None:
    """Dropout (`arch/dropout.py`) draws its masks over whole arrays in the tokens' array order,
    so it runs neither in the pipeline's microbatches nor on sequence parallelism's striped
    order, and attention-probability dropout needs the explicit-scores kernel."""
    for axis, what in (("stage", "the pipeline's microbatches"),
                       ("sequence", "sequence parallelism's striped token order")):
        check(mesh[axis] == 1, f"mesh.{axis}", mesh[axis],
              f"model.dropout draws masks in the unsplit array order, not {what}; set "
              f"mesh.{axis}=1 or every model.dropout rate to 0")
    implementation = config.execution.attention_implementation
    check(config.model.dropout.attention_probs == 0 or implementation in ("auto", "xla"),
          "execution.attention_implementation", implementation,
          "model.dropout.attention_probs > 0 needs the explicit probabilities: use 'xla' or "
          "'auto' (which then runs xla)")

