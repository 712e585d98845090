"""The named device mesh: axes (data, fsdp, tensor, sequence, stage, expert), built from config.

`config.mesh.<axis>` is an axis's total size. On several TPU slices (multi-slice), each axis is
factored into a within-slice (ICI) size and an across-slice (DCN) size, `config.mesh.dcn.<axis>`:

    mesh.<axis> = ici_<axis> × mesh.dcn.<axis>,      ∏_axes mesh.dcn.<axis> = number of slices.

Collectives over an axis with a DCN factor > 1 cross the data-center network between slices, so
put the DCN factor on an axis that communicates little, usually `data` (one gradient all-reduce
per step). The device array is then `mesh_utils.create_hybrid_device_mesh(ici, dcn)`: slice `s`
is the block at DCN coordinate `s` (row-major over the DCN sizes), laid out within the slice by
the ICI sizes. With every DCN size 1 (the default) the mesh is `jax.make_mesh` as on one slice.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType

from config import ConfigError
from sharding.launch import multiprocess_launch
from sharding.rules import MESH_AXES

AUTO_AXES = (AxisType.Auto,) * len(MESH_AXES)


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


def slice_count(devices: Sequence) -> int:
    """Number of TPU slices `devices` span (their distinct `slice_index`; 1 without one)."""
    return len({getattr(device, "slice_index", 0) for device in devices})


def ici_dcn_shapes(mesh_cfg, sizes: Mapping[str, int],
                   slices: int) -> tuple[dict[str, int], dict[str, int]]:
    """(within-slice ICI sizes, across-slice DCN sizes) of the resolved axis `sizes`.

    The DCN sizes come from `config.mesh.dcn` (absent or missing axes: 1). Each must be a positive
    integer dividing its axis size, and together they must multiply to `slices`. Raises
    ConfigError naming the field, the value and the fix.
    """
    dcn_cfg = mesh_cfg.get("dcn") or {}
    unknown = sorted(set(dcn_cfg) - set(MESH_AXES))
    if unknown:
        raise ConfigError(f"mesh.dcn.{unknown[0]} is not a mesh axis; the axes are "
                          f"{', '.join(MESH_AXES)}")
    dcn = {axis: dcn_cfg.get(axis, 1) for axis in MESH_AXES}
    for axis, size in dcn.items():
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"mesh.dcn.{axis}={size} is invalid: use a positive number of "
                              "slices (1: the axis stays within a slice)")
        if sizes[axis] % size:
            raise ConfigError(f"mesh.dcn.{axis}={size} is invalid: it does not divide "
                              f"mesh.{axis}={sizes[axis]} (mesh.{axis} is the axis's total size, "
                              f"ICI × DCN); make mesh.{axis} a multiple of {size}")
    product = math.prod(dcn.values())
    if product != slices:
        shape = "×".join(f"{a}={s}" for a, s in dcn.items() if s > 1) or "1"
        hint = f" (usually mesh.dcn.data={slices})" if slices > 1 else ""
        raise ConfigError(f"mesh.dcn={shape} is invalid: its product {product} ≠ the {slices} "
                          f"slice{'s' if slices > 1 else ''} the devices span; make the mesh.dcn "
                          f"sizes multiply to {slices}{hint}")
    return {axis: sizes[axis] // dcn[axis] for axis in MESH_AXES}, dcn


def hybrid_device_grid(ici: Mapping[str, int], dcn: Mapping[str, int],
                       devices: Sequence) -> np.ndarray:
    """Devices (each with a `slice_index`) as an array of shape ici × dcn over MESH_AXES: along
    every axis, DCN blocks of ICI size, each block within one slice."""
    return mesh_utils.create_hybrid_device_mesh(
        [ici[axis] for axis in MESH_AXES], [dcn[axis] for axis in MESH_AXES], devices,
        allow_split_physical_axes=True)


def make_mesh(mesh_cfg, devices=None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: all) with every axis Auto (GSPMD-style propagation);
    across several slices, the hybrid ICI × DCN layout of `config.mesh.dcn`."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = mesh_shape(mesh_cfg, len(devices))
    ici, dcn = ici_dcn_shapes(mesh_cfg, sizes, slice_count(devices))
    if math.prod(dcn.values()) == 1:
        return jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                             axis_types=AUTO_AXES, devices=devices)
    return jax.sharding.Mesh(hybrid_device_grid(ici, dcn, devices), MESH_AXES,
                             axis_types=AUTO_AXES)


def maybe_initialize_distributed() -> None:
    """Call `jax.distributed.initialize()` when launched as several processes.

    JAX reads the coordinator, process count and id from the environment of SLURM, Open MPI,
    TPU pods and Kubernetes itself; this only decides whether the launch is multi-process
    (`multiprocess_launch`).
    """
    if multiprocess_launch(os.environ) and not jax.distributed.is_initialized():
        jax.distributed.initialize()
