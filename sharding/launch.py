"""Whether this process is one of several of one job, from the environment alone (no JAX): the
CLI asks before it imports JAX (the workdir lock is process 0's), `sharding.mesh` before it
initializes `jax.distributed`."""

from __future__ import annotations

from collections.abc import Mapping


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
