"""What the environment alone says of a launch (no JAX): whether this process is one of several of
one job (the CLI asks before it imports JAX: the workdir lock is process 0's; `sharding.mesh`
before it initializes `jax.distributed`), and, for a CPU-only JAX, how many devices it will see
(the CLI resolves the config before JAX loads)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pkgutil
import re
from collections.abc import Mapping

from config import ConfigError


def multiprocess_launch(environ: Mapping[str, str]) -> bool:
    """Whether the environment says this process is one of several of one job.

    - `BLOCKBENCH_MULTIPROCESS=1` (set by scripts/launch_tpu_pod.sh: a TPU VM's worker list lives
      in its metadata server, not in the environment), or `JAX_COORDINATOR_ADDRESS` set;
    - SLURM: inside an `srun` step of more than one task, i.e. JAX's own SLURM detection
      variables present (`SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_PROCID, SLURM_LOCALID`) and
      `SLURM_NTASKS` > 1. An `sbatch` script or `salloc` shell has SLURM_NTASKS but no step node
      list: a plain `python -m train` there is one process;
    - Open MPI: `OMPI_COMM_WORLD_SIZE` > 1; GKE TPU pods: several `TPU_WORKER_HOSTNAMES`.
    """
    if environ.get("BLOCKBENCH_MULTIPROCESS") == "1" or environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    slurm_step = all(name in environ for name in (
        "SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID"))
    if slurm_step and int(environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    if int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return True
    return "," in environ.get("TPU_WORKER_HOSTNAMES", "")


HEARTBEAT_SECONDS = 30


def heartbeat_seconds(environ: Mapping[str, str]) -> int:
    """How long the coordination service waits for a process's heartbeat before it declares the
    process dead and fails the job: `BLOCKBENCH_HEARTBEAT_SECONDS`, default 30 (JAX's is 100).
    A survivor of a dead peer ends within about this long (docs/pods.md)."""
    value = environ.get("BLOCKBENCH_HEARTBEAT_SECONDS", "").strip()
    if not value:
        return HEARTBEAT_SECONDS
    if not value.isdigit() or int(value) < 2:
        raise ConfigError(f"BLOCKBENCH_HEARTBEAT_SECONDS={value} is invalid: a whole number "
                          f"of seconds ≥ 2 (default {HEARTBEAT_SECONDS}); set it or unset it")
    return int(value)


_HOST_DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def device_count_from_environment(environ: Mapping[str, str]) -> int | None:
    """The number of devices JAX will see in this process, when the environment alone says so
    (no JAX): a single-process job whose JAX runs on the CPU, because `JAX_PLATFORMS` is "cpu" or
    no accelerator plugin is installed (none in the `jax_plugins` entry points or namespace, no
    libtpu). Then it is the host platform's device count: `JAX_NUM_CPU_DEVICES`, else XLA's
    `--xla_force_host_platform_device_count` flag, else 1. None otherwise: JAX must count them."""
    if multiprocess_launch(environ):
        return None
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms.split(",")[0].strip() != "cpu" and (platforms or _accelerator_plugin()):
        return None
    if environ.get("JAX_NUM_CPU_DEVICES", "").strip().lstrip("-").isdigit():
        count = int(environ["JAX_NUM_CPU_DEVICES"])
        if count > 0:
            return count
    flags = _HOST_DEVICES.findall(environ.get("XLA_FLAGS", ""))
    return int(flags[-1]) if flags else 1


def _accelerator_plugin() -> bool:
    """Whether a JAX accelerator plugin (CUDA, ROCm, TPU, ...) is installed."""
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    if importlib.util.find_spec("libtpu") is not None:
        return True
    namespace = importlib.util.find_spec("jax_plugins")
    return namespace is not None and any(
        True for _ in pkgutil.iter_modules(namespace.submodule_search_locations))
