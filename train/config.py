"""Whole-config validation: every cross-field invariant, checked before anything compiles."""

from __future__ import annotations

from arch.config import check, resolve_model
from sharding.mesh import ici_dcn_shapes, mesh_shape
from sharding.pipeline import validate_pipeline

SCHEDULES = ("cosine", "wsd")


def validate(config, device_count: int, slice_count: int = 1) -> dict[str, int]:
    """Check `config` in place (filling derived model fields) for `device_count` devices in
    `slice_count` TPU slices; return the resolved mesh shape (total size of each axis).

    Raises `arch.config.ConfigError`: one line naming the field, the value and what is valid.
    """
    model = config.model
    if model.max_seq_len is None:
        model.max_seq_len = config.seq_len
    resolve_model(model)
    for field in ("steps", "batch_size", "seq_len", "log_every", "eval_every", "checkpoint_every",
                  "eval_batches"):
        check(isinstance(config[field], int) and config[field] > 0, field, config[field],
              "must be a positive integer")
    check(model.max_seq_len >= config.seq_len, "model.max_seq_len", model.max_seq_len,
          f"must be at least seq_len={config.seq_len}")
    opt = config.optimizer
    check(opt.schedule in SCHEDULES, "optimizer.schedule", opt.schedule,
          f"valid schedules: {', '.join(SCHEDULES)}")
    check(0 <= opt.warmup_steps <= config.steps, "optimizer.warmup_steps", opt.warmup_steps,
          f"must be between 0 and steps={config.steps}")
    check(0 < opt.decay_fraction <= 1, "optimizer.decay_fraction", opt.decay_fraction,
          "must be in (0, 1]")

    mesh = mesh_shape(config.mesh, device_count)
    ici_dcn_shapes(config.mesh, mesh, slice_count)
    # Outside the MoE layers the expert axis is extra data parallelism (sharding rule act_batch).
    batch_shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
    check(config.batch_size % batch_shards == 0, "batch_size", config.batch_size,
          f"must be divisible by mesh.data×mesh.fsdp×mesh.expert = {batch_shards}")
    tensor = mesh["tensor"]
    check(model.num_heads % tensor == 0, "model.num_heads", model.num_heads,
          f"must be divisible by mesh.tensor={tensor}")
    check(model.d_ff % tensor == 0, "model.d_ff", model.d_ff,
          f"must be divisible by mesh.tensor={tensor}")
    if model.ffn == "moe":
        check(model.moe_experts % mesh["expert"] == 0, "model.moe_experts", model.moe_experts,
              f"must be divisible by mesh.expert={mesh['expert']}")
        check(model.moe_d_ff % tensor == 0, "model.moe_d_ff", model.moe_d_ff,
              f"must be divisible by mesh.tensor={tensor}")
    for axis in ("sequence",):
        check(mesh[axis] == 1, f"mesh.{axis}", mesh[axis],
              f"{axis} parallelism is not available yet; use mesh.{axis}=1")
    validate_pipeline(config, mesh)  # mesh.stage
    return mesh

