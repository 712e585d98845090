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
from jax.experimental import mesh_utils, multihost_utils
from jax.sharding import AxisType

from config import ConfigError
from config.mesh_shape import MESH_AXES
from config.resolution import require_resolved
from sharding.environment import heartbeat_seconds, multiprocess_launch

AUTO_AXES = (AxisType.Auto,) * len(MESH_AXES)


def slice_count(devices: Sequence) -> int:
    """Number of TPU slices `devices` span (their distinct `slice_index`; 1 without one)."""
    return len({getattr(device, "slice_index", 0) for device in devices})


def hybrid_device_grid(ici: Mapping[str, int], dcn: Mapping[str, int],
                       devices: Sequence) -> np.ndarray:
    """Devices (each with a `slice_index`) as an array of shape ici × dcn over MESH_AXES: along
    every axis, DCN blocks of ICI size, each block within one slice."""
    return mesh_utils.create_hybrid_device_mesh(
        [ici[axis] for axis in MESH_AXES], [dcn[axis] for axis in MESH_AXES], devices,
        allow_split_physical_axes=True)


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
    """The mesh of a resolved `config` (`config.resolve`) over `devices` (default: all, which
    must number `config.resolved.device_count`), every axis Auto (GSPMD-style propagation);
    across several slices, the hybrid ICI × DCN layout of `config.mesh.dcn`."""
    require_resolved(config, "make_mesh")
    devices = list(devices if devices is not None else jax.devices())
    resolved = config.resolved
    if len(devices) != resolved.device_count:
        raise ConfigError(f"the config was resolved for {resolved.device_count} devices, not the "
                          f"{len(devices)} here; resolve it for these devices")
    if math.prod(resolved.dcn.values()) == 1:
        return jax.make_mesh(tuple(resolved.mesh[a] for a in MESH_AXES), MESH_AXES,
                             axis_types=AUTO_AXES, devices=devices)
    return jax.sharding.Mesh(hybrid_device_grid(resolved.ici, resolved.dcn, devices), MESH_AXES,
                             axis_types=AUTO_AXES)


def maybe_initialize_distributed() -> None:
    """Call `jax.distributed.initialize()` when launched as several processes.

    JAX reads the coordinator, process count and id from the environment of SLURM, Open MPI,
    TPU pods and Kubernetes itself; `python -m train.launch` gives the count and id in
    `BLOCKBENCH_NUM_PROCESSES` and `BLOCKBENCH_PROCESS_ID` (and the coordinator in
    `JAX_COORDINATOR_ADDRESS`). This decides whether the launch is multi-process
    (`multiprocess_launch`), and has CPU devices' collectives across processes go over gloo.
    The coordination service's heartbeat timeout is `heartbeat_seconds` (30 s by default).
    """
    if not multiprocess_launch(os.environ) or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    given = {name: int(os.environ[variable]) for name, variable in (
        ("num_processes", "BLOCKBENCH_NUM_PROCESSES"), ("process_id", "BLOCKBENCH_PROCESS_ID"))
        if variable in os.environ}
    jax.distributed.initialize(**given, heartbeat_timeout_seconds=heartbeat_seconds(os.environ))



def any_process(flag: bool) -> bool:
    """Whether `flag` is set on any process of the job: the same answer on every process, so a
    decision that one process sees first (a signal, a failed read) is taken by all. A collective
    of one int per process (none with one process)."""
    if jax.process_count() == 1:
        return flag
    return bool(np.any(multihost_utils.process_allgather(np.int32(flag))))


def any_process_flags(flags: int) -> int:
    """The bitwise OR of `flags` (small non-negative ints) over every process of the job: as
    `any_process`, several decisions in one collective."""
    if jax.process_count() == 1:
        return flags
    return int(np.bitwise_or.reduce(multihost_utils.process_allgather(np.int32(flags))))


def gather_text(key: str, text: str, timeout_s: int = 300) -> list[str]:
    """Every process's `text` under `key`, by process index, through the coordination
    service's key-value store (no collective runs: a process that disagrees is found before
    the first one). `[text]` with one process."""
    if jax.process_count() == 1:
        return [text]
    from jax._src import distributed

    client = distributed.global_state.client
    client.key_value_set(f"blockbench/{key}/{jax.process_index()}", text)
    return [client.blocking_key_value_get(f"blockbench/{key}/{index}", timeout_s * 1000)
            for index in range(jax.process_count())]
