"""The named device mesh: axes (data, fsdp, tensor, sequence, stage, expert), built from config."""

from __future__ import annotations

import os

import jax
from jax.sharding import AxisType

from arch.config import ConfigError
from sharding.rules import MESH_AXES


def mesh_shape(mesh_cfg, device_count: int) -> dict[str, int]:
    """Axis sizes from `config.mesh`; at most one axis may be -1 ("all remaining devices")."""
    sizes = {axis: int(mesh_cfg[axis]) for axis in MESH_AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ConfigError(f"mesh.{free[1]}=-1 is invalid: only one mesh axis may be -1 "
                          f"(already mesh.{free[0]}=-1)")
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size} is invalid: use a positive size or -1")
    fixed = 1
    for size in sizes.values():
        fixed *= size if size > 0 else 1
    if free:
        if device_count % fixed:
            raise ConfigError(f"mesh.{free[0]}=-1 is invalid: the other axes multiply to {fixed}, "
                              f"which does not divide the {device_count} devices")
        sizes[free[0]] = device_count // fixed
    elif fixed != device_count:
        shape = "×".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "1"
        raise ConfigError(f"mesh={shape} is invalid: its product {fixed} ≠ the {device_count} "
                          f"devices; make the axes multiply to {device_count} or set one to -1")
    return sizes


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: all) with every axis Auto (GSPMD-style propagation)."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_shape(mesh_cfg, len(devices))
    return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def maybe_initialize_distributed() -> None:
    """Call `jax.distributed.initialize()` when launched as several processes.

    JAX reads the coordinator, process count and id from the environment of SLURM, Open MPI,
    TPU pods and Kubernetes itself; this only decides whether the launch is multi-process.
    """
    markers = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
    multi = any(os.environ.get(name) for name in markers)
    multi |= int(os.environ.get("SLURM_NTASKS", "1")) > 1
    multi |= int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    multi |= "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if multi and not jax.distributed.is_initialized():
        jax.distributed.initialize()
