"""The mesh's shape, arithmetic on the config: each axis's total size from `config.mesh` and the
device count, and its factoring into within-slice (ICI) and across-slice (DCN) sizes on several
TPU slices (`sharding.mesh` builds the mesh from them). No JAX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from config import ConfigError

MESH_AXES = ("data", "fsdp", "tensor", "sequence", "stage", "expert")


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
