"""Whole-config validation: every cross-field invariant, checked before anything compiles."""

from __future__ import annotations

from arch.config import resolve_execution, resolve_model
from arch.dropout import enabled
from config import check
from config.derived import DELTANET, layer_attentions
from config.validate import check_fields
from sharding.mesh import ici_dcn_shapes, mesh_shape
from sharding.pipeline import validate_pipeline


def validate(config, device_count: int, slice_count: int = 1) -> dict[str, int]:
    """Check `config` in place (filling derived model fields) for `device_count` devices in
    `slice_count` TPU slices; return the resolved mesh shape (total size of each axis). The
    JAX-free field checks (`config.validate.check_fields`) run first, then the model against
    the component registries, then the mesh.

    Raises `arch.config.ConfigError`: one line naming the field, the value and what is valid.
    """
    check_fields(config)  # everything that needs no JAX (also run by the CLI before JAX loads)
    model = config.model
    if model.max_seq_len is None:
        model.max_seq_len = config.seq_len
    resolve_model(model)
    resolve_execution(config.execution)
    check(model.head.mtp_depth < config.seq_len, "model.head.mtp_depth", model.head.mtp_depth,
          f"must be below seq_len={config.seq_len} (MTP depth j has seq_len − j targets)")

    mesh = mesh_shape(config.mesh, device_count)
    ici_dcn_shapes(config.mesh, mesh, slice_count)
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
    if model.ffn.name == "moe":
        check(model.moe.experts % mesh["expert"] == 0, "model.moe.experts", model.moe.experts,
              f"must be divisible by mesh.expert={mesh['expert']}")
        check(model.moe.d_ff % tensor == 0, "model.moe.d_ff", model.moe.d_ff,
              f"must be divisible by mesh.tensor={tensor}")
    _check_hybrid(model, mesh)  # gated_deltanet blocks, model.layer_pattern
    if mesh["sequence"] > 1:
        _check_sequence_parallel(config, mesh["sequence"], mesh["stage"])
    check(mesh["stage"] == 1 or model.loop_count == 1, "model.loop_count", model.loop_count,
          f"looped depth does not run in the pipeline (mesh.stage={mesh['stage']}); use "
          "mesh.stage=1 or model.loop_count=1")
    validate_pipeline(config, mesh)  # mesh.stage
    if enabled(model):
        _check_dropout(config, mesh)
    return mesh


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


def _check_hybrid(model, mesh: dict[str, int]) -> None:
    """Gated DeltaNet runs its recurrence in token order on one device's whole sequence and in
    the ordinary layer scan: no sequence parallelism (which stripes the sequence) and no
    pipeline; its heads shard over `tensor`."""
    if model.layer_pattern:
        check(mesh["stage"] == 1, "model.layer_pattern", model.layer_pattern,
              f"hybrid stacks do not run in the pipeline (mesh.stage={mesh['stage']}); use "
              "mesh.stage=1")
    if DELTANET not in layer_attentions(model):
        return
    heads = model.deltanet.num_heads
    check(heads % mesh["tensor"] == 0, "model.deltanet.num_heads", heads,
          f"must be divisible by mesh.tensor={mesh['tensor']}")
    check(mesh["sequence"] == 1, "mesh.sequence", mesh["sequence"],
          "gated_deltanet blocks do not pass their state between sequence shards; use "
          "mesh.sequence=1")
    check(mesh["stage"] == 1, "mesh.stage", mesh["stage"],
          "gated_deltanet blocks do not run in the pipeline; use mesh.stage=1")


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


def _check_sequence_parallel(config, shards: int, stages: int) -> None:
    """What sequence parallelism (`sharding/sequence.py`) needs: a sequence that stripes into
    2 × shards chunks, and components that do not depend on the tokens' array order."""
    model, execution = config.model, config.execution
    check(config.seq_len % (2 * shards) == 0, "seq_len", config.seq_len,
          f"must be divisible by 2×mesh.sequence = {2 * shards} (causal load balancing gives "
          "each sequence shard two chunks)")
    if execution.sequence_attention == "ring":
        check(model.attention.name == "mha", "execution.sequence_attention", "ring",
              "ring attention supports model.attention.name='mha' (got "
              f"{model.attention.name!r}); use execution.sequence_attention='all_gather'")
        check(stages == 1, "execution.sequence_attention", "ring",
              f"ring attention does not run inside the pipeline (mesh.stage={stages}); use "
              "execution.sequence_attention='all_gather'")
    check(model.norm.name != "causal_batchnorm", "model.norm.name", model.norm.name,
          f"its statistics accumulate in token order, which mesh.sequence={shards} permutes "
          "(striping); use another norm or mesh.sequence=1")
    if model.use_ffn and model.ffn.name == "moe":
        check(model.moe.dropless, "model.moe.dropless", model.moe.dropless,
              f"MoE capacity goes first-come-first-served in token order, which "
              f"mesh.sequence={shards} permutes (striping); set model.moe.dropless=True or "
              "mesh.sequence=1")
