"""Whether a run's train state can fit at all, before anything compiles: `check_state_fits`, the
last check of `python -m train` (`train.__main__.check_run`), refuses in one line a config whose
parameters and optimizer state cannot fit in the memory they would live in.

The bound is from the config alone, a lower bound of what `arch.accounting.parameter_count` and
the optimizer hold: the float32 parameters (they are float32 whatever `model.dtype`) of the token
embedding (vocab_size × d_model), of an untied output head (d_model × vocab_size) and of each
block's dense FFN (n × d_model × d_ff for an FFN of n matrices; a MoE FFN counts nothing), each
with the optimizer's moments (AdamW two; one under Muon, whose hidden matrices keep one) and the
parameters' EMA with `optimizer.ema_decay > 0`. Attention, norms, gradients and activations are
left out, so a config it refuses is clearly impossible; one it passes may still not fit: the
trainer then reports the runtime's out-of-memory error in one line (`out_of_memory_line`,
exit status 5).

The memory: before JAX loads, `python -m train` runs this only for a CPU-only JAX in one process
(`sharding.environment.device_count_from_environment`), whose devices all share the host's RAM: the
whole state against the host's physical memory. After JAX has loaded (it had to count the
devices), the devices JAX reports: on CPU, the shares of the state of every process of the job
on this host (`processes_on_host`) against the host's memory; on an accelerator, the state
spread evenly over every device against one device's `bytes_limit` (skipped where the device
does not report it). This module imports no JAX; it asks the loaded one.
"""

from __future__ import annotations

import os
import sys

from config import ConfigError
from config.catalogue import EXPERTS, OUTPUT_TABLE, has, record

FLOAT32_BYTES = 4


def state_lower_bound(config) -> tuple[int, int]:
    """(embedding and head parameters, FFN parameters) that a resolved `config`'s model surely
    holds (see the module docstring)."""
    model = config.model
    tables = 2 if has("head", model.head.name, OUTPUT_TABLE) else 1
    embedding = tables * model.vocab_size * model.d_model
    ffn = 0
    if model.use_ffn and not has("ffn", model.ffn.name, EXPERTS):
        projections = record("ffn", model.ffn.name).projections
        ffn = model.num_layers * projections * model.d_model * model.ffn.d_ff
    return embedding, ffn


def copies_per_parameter(config) -> int:
    """Float32 values the train state keeps per parameter, at least: the parameter, the
    optimizer's moments (AdamW 2, Muon 1) and the EMA's copy when there is one."""
    moments = 1 if config.optimizer.name == "muon" else 2
    return 1 + moments + (1 if config.optimizer.ema_decay > 0 else 0)


def host_memory() -> int:
    """This host's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_for_state(device_count: int,
                     processes_on_host: int = 1) -> tuple[float, int, str] | None:
    """(the share of the state one memory holds at best, that memory's bytes, its name), or None
    where the device does not say how much it has (see the module docstring). On the CPU the
    host's memory holds the shares of all `processes_on_host` processes of the job there."""
    jax = sys.modules.get("jax")  # loaded only where JAX had to count the devices
    if jax is None:  # a CPU-only JAX in one process: its devices share this host's memory
        return 1.0, host_memory(), "this host's memory"
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        share = min(1.0, jax.local_device_count() * processes_on_host / device_count)
        return share, host_memory(), "this host's memory"
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if not limit:
        return None
    return 1 / device_count, limit, f"the memory of one {device.platform} device"


def check_state_fits(config, processes_on_host: int = 1) -> None:
    """Raise `ConfigError` in one line when the resolved `config`'s train state cannot fit (see
    the module docstring), naming the field that contributes the most. `processes_on_host`: the
    processes of the job on this host, whose shares its memory holds together (CPU)."""
    memory = memory_for_state(config.resolved.device_count, processes_on_host)
    if memory is None:
        return
    share, available, where = memory
    embedding, ffn = state_lower_bound(config)
    need = (embedding + ffn) * copies_per_parameter(config) * FLOAT32_BYTES * share
    if need <= available:
        return
    field = "vocab_size" if embedding >= ffn else "d_model"
    spread = (f" (the share of {config.resolved.device_count} devices that this host's "
              f"{processes_on_host} processes hold)" if processes_on_host > 1 else
              "" if share == 1 else f" (its share of {config.resolved.device_count} devices)")
    raise ConfigError(
        f"model.{field}={config.model[field]!r} is invalid: the parameters and optimizer state "
        f"need at least {need / 1e9:.1f} GB{spread} (float32: {embedding:,} embedding and head "
        f"parameters, {ffn:,} FFN parameters, {copies_per_parameter(config)} values each), more "
        f"than {where} ({available / 1e9:.1f} GB); lower model.{field} (or another size of the "
        "model), or run where there is more memory")


def out_of_memory_line(config, error_line: str) -> str:
    """The one line of a run that ran out of memory although `check_state_fits` passed (that
    check is a lower bound: attention, gradients and activations come on top): the first line
    of the runtime's error, the state's lower bound per memory, the memory's limit where known,
    and the knobs that lower what a device holds."""
    memory = memory_for_state(config.resolved.device_count)
    share, available, where = memory if memory is not None else (
        1 / config.resolved.device_count, None, "one device's memory")
    embedding, ffn = state_lower_bound(config)
    need = (embedding + ffn) * copies_per_parameter(config) * FLOAT32_BYTES * share
    limit = f"{available / 1e9:.1f} GB" if available else "not reported"
    return (f"out of memory ({error_line[:160]}): the parameters and optimizer state alone need "
            f"at least {need / 1e9:.2f} GB of {where} ({limit}), and gradients and activations "
            "come on top; lower what each device holds: shard the state (mesh.fsdp), recompute "
            "activations (execution.remat=full), lower batch_size or raise accumulation_steps, "
            "or a smaller model")
