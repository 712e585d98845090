"""Cloud TPU targets for compiling on a CPU host: accelerator types, their chips, and the
compile-only devices of their topologies (the TPU compiler in `libtpu`, no TPU needed).

An accelerator type is `<generation>-<N>` as Cloud TPU names it. N counts TensorCores on v4
and v5p (2 per chip; the chip's two cores run as one JAX device, "megacore"), so `v5p-128` is
64 chips; it counts chips on v5e (also `v5litepod-N`) and v6e, so `v6e-64` is 64 chips. The
slice shapes are Cloud TPU's: a 3D torus for v4 and v5p (2x2x1 for 4 chips, then the smallest
dimension doubled: 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...), a 2D torus for v5e and v6e (1x1,
2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16). Several slices (multislice) are K copies of the
topology, joined by the data-center network (DCN).

`CHIPS`: one row per generation, every figure from the public spec it cites. Bandwidths are
the spec's per-chip figures in bytes/s (Gbps / 8); the roofline in `scripts/dry_run.py`
divides a chip's collective traffic by them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

from config import ConfigError

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    generation: str        # "v5p"
    device_kind: str       # jax's Device.device_kind on it
    hbm_bytes: int         # HBM capacity per chip
    bf16_flops: float      # peak dense bf16 FLOP/s per chip
    hbm_bandwidth: float   # bytes/s per chip
    ici_bandwidth: float   # bytes/s per chip (the spec's inter-chip interconnect figure)
    dcn_bandwidth: float   # bytes/s per chip (data-center network, across slices)
    counts_cores: bool     # accelerator type's N counts TensorCores (2 per chip), not chips
    torus_dims: int        # 3 (v4, v5p) or 2 (v5e, v6e)
    source: str            # where the figures come from


CHIPS: dict[str, Chip] = {
    # cloud.google.com/tpu/docs/v4: 275 TFLOPs bf16, 32 GiB HBM2 at 1200 GBps, ICI 2400 Gbps
    # (6 links of 50 GB/s, Jouppi et al., ISCA 2023). No per-chip DCN figure is published for
    # v4: v5p's 50 Gbps is assumed.
    "v4": Chip("v4", "TPU v4", 32 * GiB, 275e12, 1200e9, 2400e9 / 8, 50e9 / 8, True, 3,
               "cloud.google.com/tpu/docs/v4; DCN assumed as v5p's"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16, 95 GiB HBM2e at 2765 GBps, ICI 4800 Gbps,
    # DCN 50 Gbps per chip.
    "v5p": Chip("v5p", "TPU v5", 95 * GiB, 459e12, 2765e9, 4800e9 / 8, 50e9 / 8, True, 3,
                "cloud.google.com/tpu/docs/v5p"),
    # cloud.google.com/tpu/docs/v5e and docs/v6e (the v5e column): 197 TFLOPs bf16, 16 GiB HBM2
    # at 819 GBps, ICI 1600 Gbps; DCN 2 × 100 Gbps NICs per 8-chip host = 25 Gbps per chip.
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GiB, 197e12, 819e9, 1600e9 / 8, 25e9 / 8, False, 2,
                "cloud.google.com/tpu/docs/v5e"),
    # cloud.google.com/tpu/docs/v6e: 918 TFLOPs bf16, 32 GiB HBM at 1640 GBps, ICI 3584 Gbps;
    # DCN 4 × 200 Gbps NICs per 8-chip host = 100 Gbps per chip.
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GiB, 918e12, 1640e9, 3584e9 / 8, 100e9 / 8, False, 2,
                "cloud.google.com/tpu/docs/v6e"),
}
ALIASES = {"v5litepod": "v5e"}


@dataclasses.dataclass(frozen=True)
class Target:
    accelerator_type: str  # as given, e.g. "v5p-128"
    chip: Chip
    chips: int             # per slice
    topology: str          # per slice, e.g. "4x4x4"
    slices: int = 1

    @property
    def devices(self) -> int:
        return self.chips * self.slices


def _shape(chips: int, dims: int) -> list[int]:
    """Cloud TPU's slice shape of `chips` chips (a power of two, ≥ 4 for a 3D torus)."""
    if dims == 2:
        shape = [1, 1]
        while math.prod(shape) < chips:
            shape[shape.index(min(shape))] *= 2  # 1x1 → 2x1 → 2x2 → 4x2 → 4x4 ...
        return sorted(shape)
    shape = [2, 2, 1]
    while math.prod(shape) < chips:
        smallest = min(shape)
        last = max(i for i, size in enumerate(shape) if size == smallest)
        shape[last] *= 2  # 2x2x1 → 2x2x2 → 2x2x4 → 2x4x4 → 4x4x4 → 4x4x8 ...
    return shape


def parse_target(accelerator_type: str, slices: int = 1) -> Target:
    """`v5p-128` → 64 v5p chips in a 4x4x4 torus; ConfigError naming the value and the fix."""
    match = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", accelerator_type.strip())
    if not match:
        raise ConfigError(f"--target={accelerator_type!r} is not a Cloud TPU accelerator type; "
                          "use <generation>-<N> with generation v4, v5p, v5e (v5litepod) or v6e, "
                          "e.g. v5e-16 or v5p-128")
    generation = ALIASES.get(match[1], match[1])
    chip, count = CHIPS[generation], int(match[2])
    chips = count // 2 if chip.counts_cores else count
    smallest = 4 if chip.torus_dims == 3 else 1
    if (chip.counts_cores and count % 2) or chips < smallest or chips & (chips - 1):
        unit = "TensorCores (2 per chip)" if chip.counts_cores else "chips"
        raise ConfigError(f"--target={accelerator_type!r}: {generation}-N counts {unit}; N must "
                          f"give a power-of-two chip count of at least {smallest}, e.g. "
                          f"{generation}-{2 * smallest if chip.counts_cores else 4 * smallest}")
    if slices < 1:
        raise ConfigError(f"--slices={slices} is invalid: use a positive slice count")
    return Target(accelerator_type, chip, chips,
                  "x".join(map(str, _shape(chips, chip.torus_dims))), slices)


def libtpu_available() -> bool:
    """Whether the TPU compiler is installed (the `tpu` extra: `pip install -e '.[tpu]'`)."""
    return importlib.util.find_spec("libtpu") is not None


def target_devices(target: Target) -> list:
    """Compile-only devices of the target's topology (all its slices), from libtpu on this host:
    a program jitted on a mesh of them lowers and compiles for TPU; nothing runs or allocates.
    v4 and v5p chips are one device each (megacore).

    libtpu's initialization looks for a TPU VM's metadata (accelerator type, worker hostnames)
    and prints warnings without them, and takes a lock that keeps any other process from
    loading libtpu (/tmp/libtpu_lockfile: two test workers, or a test and the dry run it
    starts); for compiling only, they are given here unless already set, and the lock is not
    taken (ALLOW_MULTIPLE_LIBTPU_LOAD), so it stays quiet and any number of processes compile.
    They are set only while libtpu starts (it reads them then), and restored after, so the
    processes this one starts later (a training run under test) do not inherit them."""
    from jax.experimental import topologies

    name = target.chip.generation.replace("v5e", "v5litepod")
    compile_only = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1",
                    "TPU_WORKER_HOSTNAMES": "localhost",
                    "TPU_ACCELERATOR_TYPE":
                        f"{name}-{target.chips * (2 if target.chip.counts_cores else 1)}"}
    added = [key for key in compile_only if key not in os.environ]
    options = {"chip_config_name": "megacore"} if target.chip.generation == "v4" else {}
    if target.chips < 4:  # under a host's 2x2 chips (v5e-1, v6e-1): the slice is the host
        options["chips_per_host_bounds"] = (*map(int, target.topology.split("x")), 1)
    try:
        os.environ.update({key: compile_only[key] for key in added})
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{target.chip.generation}:{target.topology}",
            num_slices=target.slices, **options)
    finally:
        for key in added:
            del os.environ[key]
    return list(topology.devices)
