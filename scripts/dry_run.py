"""Dry run for a target topology: `python scripts/dry_run.py --config PATH[:ARG] --devices N
[--mesh AXIS=SIZE,...] [--config.FIELD=VALUE ...] [--json] [--no_compile]`

Prints, without the target hardware, what training the experiment on N devices would place
where: the mesh (and its ICI × DCN factoring across TPU slices), every parameter's logical axes,
PartitionSpec, global shape and per-device shape and bytes, and per-device bytes of parameters,
optimizer state, non-parameter model state, the batch, and the compiled train step's
temporaries. The config is resolved first, before JAX loads (`config.resolve`, as `python -m
train` does); a bad one is one line on stderr and exit status 2, e.g. a mesh whose axes do not
multiply to N.

`--mesh data=2,fsdp=4` sets those `config.mesh` axes (the others keep the config's values,
`-1` included); it is the same as `--config.mesh.data=2 --config.mesh.fsdp=4`. DCN factors go
through `--config.mesh.dcn.AXIS=K`; the target then has ∏ K slices.

How it works, in two stages:
  1. Shardings and parameter/optimizer bytes need no devices: `TrainProgram` is built on a
     `jax.sharding.AbstractMesh` of the target axis sizes, and `abstract_state()` gives every
     state leaf as a `jax.ShapeDtypeStruct` carrying its NamedSharding; per-device shapes are the
     shardings' `shard_shape`. Any N works, instantly.
  2. XLA's memory analysis needs a compiled program, and compiling needs concrete devices: the
     script simulates N CPU devices (`jax_num_cpu_devices=N` and `jax_platforms=cpu`, set before
     JAX's backend starts: the in-process form of XLA_FLAGS=--xla_force_host_platform_device_count
     =N), builds the same program on a concrete mesh of those devices, and lowers and compiles
     the train step from the ShapeDtypeStructs (`jit(...).lower(...).compile()`; no parameter is
     allocated). The device order ignores DCN (CPU devices have no slices); it changes no
     sharding or size. `--no_compile` skips this stage (for very large N).

Temporaries come from the CPU compiler's SPMD-partitioned program: the per-device argument bytes
it reports equal stage 1's sums, while TPU and GPU compilers fuse and schedule differently, so
read `temp_bytes` as an estimate of the target's. `peak_bytes` = arguments + outputs − aliased
(the donated train state) + temporaries.

`--json` prints one JSON object on stdout with keys: devices, slices, mesh, ici, dcn,
parameters (list of {path, logical, shape, spec, device_shape, device_bytes}),
parameter_bytes / optimizer_bytes / model_state_bytes / batch_bytes (per device) with
parameter_bytes_total / optimizer_bytes_total (global), and, when compiled, temp_bytes,
argument_bytes, output_bytes, alias_bytes, peak_bytes.

Example: python scripts/dry_run.py --config experiments/quickstart.py --devices 8
    --mesh data=1,fsdp=4,tensor=2
"""

from __future__ import annotations

import json
import math
import sys

from absl import logging as absl_logging

from config import ConfigError, resolve
from config.cli import ArgumentParser, parse_with_config
from config.mesh_shape import MESH_AXES


def parse_mesh(text: str) -> dict[str, int]:
    """`data=2,fsdp=4` → {"data": 2, "fsdp": 4}; ConfigError naming the bad item."""
    sizes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        axis, _, size = item.partition("=")
        if axis not in MESH_AXES:
            raise ConfigError(f"--mesh {item!r}: {axis!r} is not a mesh axis; the axes are "
                              f"{', '.join(MESH_AXES)}")
        try:
            sizes[axis] = int(size)
        except ValueError:
            raise ConfigError(f"--mesh {item!r}: expected {axis}=SIZE with an integer SIZE "
                              "(-1: the remaining devices)") from None
    return sizes


def _bytes(struct) -> int:
    """Bytes of one device's shard of a ShapeDtypeStruct with a sharding."""
    return math.prod(struct.sharding.shard_shape(struct.shape)) * struct.dtype.itemsize


def _spec(sharding) -> list:
    return [list(entry) if isinstance(entry, tuple) else entry for entry in sharding.spec]


def sharding_report(config) -> dict:
    """Stage 1 (no devices): per-parameter shardings and per-device state bytes of the resolved
    `config`'s train state on an AbstractMesh of its mesh's axis sizes."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sharding.mesh import AUTO_AXES
    from train.step import TrainProgram

    sizes = config.resolved.mesh
    mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                                     axis_types=AUTO_AXES)
    program = TrainProgram(config, mesh)
    state = program.abstract_state()
    logical = dict(nnx.to_flat_state(nnx.get_partition_spec(state["params"])))
    parameters = []
    for path, variable in nnx.to_flat_state(state["params"]):
        struct = variable.get_value()
        names = logical[path].get_value()
        parameters.append({
            "path": "/".join(map(str, path)), "logical": list(names), "shape": list(struct.shape),
            "spec": _spec(struct.sharding),
            "device_shape": list(struct.sharding.shard_shape(struct.shape)),
            "device_bytes": _bytes(struct)})
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32,
                                 sharding=program.batch_sharding)

    def total(tree, per_device=True):
        leaves = jax.tree.leaves(tree)
        return sum(_bytes(x) if per_device else x.size * x.dtype.itemsize for x in leaves)

    return {"parameters": parameters,
            "parameter_bytes": total(state["params"]),
            "parameter_bytes_total": total(state["params"], per_device=False),
            "optimizer_bytes": total(state["opt_state"]),
            "optimizer_bytes_total": total(state["opt_state"], per_device=False),
            "model_state_bytes": total(state["model_state"]),
            "batch_bytes": _bytes(batch)}


def compiled_memory(config) -> dict:
    """Stage 2: XLA's per-device memory analysis of the resolved `config`'s train step compiled
    for its device count of local devices (simulated CPU devices when run as a script), laid out
    without DCN (CPU devices have no slices)."""
    import jax

    from sharding.mesh import AUTO_AXES
    from train.step import TrainProgram, compile_train_step

    sizes = config.resolved.mesh
    devices = jax.devices()[:config.resolved.device_count]
    mesh = jax.make_mesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=AUTO_AXES,
                         devices=devices)
    _, compiled = compile_train_step(TrainProgram(config, mesh))
    memory = compiled.memory_analysis()
    result = {"temp_bytes": memory.temp_size_in_bytes,
              "argument_bytes": memory.argument_size_in_bytes,
              "output_bytes": memory.output_size_in_bytes,
              "alias_bytes": memory.alias_size_in_bytes}
    result["peak_bytes"] = (result["argument_bytes"] + result["output_bytes"]
                            - result["alias_bytes"] + result["temp_bytes"])
    return result


def resolve_for(config, device_count: int):
    """`config` resolved for `device_count` devices in ∏ mesh.dcn slices (ConfigError on a bad
    config; no JAX)."""
    dcn_cfg = config.mesh.get("dcn") or {}
    return resolve(config, device_count, math.prod(dcn_cfg.get(axis, 1) for axis in MESH_AXES))


def dry_run(config, compile_step: bool = True) -> dict:
    """The whole report for the resolved `config` (`resolve_for`). Compiling needs its device
    count of local devices."""
    resolved = config.resolved
    def in_axis_order(sizes) -> dict[str, int]:
        return {axis: sizes[axis] for axis in MESH_AXES}

    report = {"devices": resolved.device_count, "slices": resolved.slice_count,
              "mesh": in_axis_order(resolved.mesh), "ici": in_axis_order(resolved.ici),
              "dcn": in_axis_order(resolved.dcn), **sharding_report(config)}
    if compile_step:
        report.update(compiled_memory(config))
    return report


def human(count: int) -> str:
    """Bytes in binary units: 1536 → '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _spec_text(spec: list) -> str:
    return "P(" + ", ".join("None" if e is None else e if isinstance(e, str)
                            else "(" + ", ".join(e) + ")" for e in spec) + ")"


def table(report: dict) -> str:
    """The report as a readable text table."""
    def axes(sizes):
        return " ".join(f"{axis}={size}" for axis, size in sizes.items())

    lines = [f"mesh: {axes(report['mesh'])}  ({report['devices']} devices, "
             f"{report['slices']} slice{'s' if report['slices'] > 1 else ''})"]
    if report["slices"] > 1:
        lines += [f"  within a slice (ICI): {axes(report['ici'])}",
                  f"  across slices (DCN):  {axes(report['dcn'])}"]
    rows = [("parameter", "logical axes", "global shape", "spec", "per-device shape", "bytes")]
    rows += [(p["path"], ", ".join(str(n) for n in p["logical"]), str(tuple(p["shape"])),
              _spec_text(p["spec"]), str(tuple(p["device_shape"])), human(p["device_bytes"]))
             for p in report["parameters"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines += ["", *("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
                    for row in rows), "", "per device:"]
    figures = [("parameters", report["parameter_bytes"],
                f"of {human(report['parameter_bytes_total'])} in all"),
               ("optimizer state", report["optimizer_bytes"],
                f"of {human(report['optimizer_bytes_total'])} in all"),
               ("model state", report["model_state_bytes"], "non-parameter, e.g. BatchNorm"),
               ("batch", report["batch_bytes"], "int32 tokens")]
    if "temp_bytes" in report:
        figures += [("train-step temporaries", report["temp_bytes"],
                     "XLA memory analysis, CPU compiler: an estimate for TPU/GPU"),
                    ("peak", report["peak_bytes"],
                     "arguments + outputs - donated + temporaries")]
    lines += [f"  {name:<24}{human(count):>12}   {note}" for name, count, note in figures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/dry_run.py", __doc__)
    parser.add_argument("--devices", type=int, required=True,
                        help="device count of the target topology")
    parser.add_argument("--mesh", metavar="AXIS=SIZE[,...]", default=None,
                        help="config.mesh axes to set")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout instead of a table")
    parser.add_argument("--no_compile", action="store_true", help="skip compiling (no temp_bytes)")
    config, args = parse_with_config(parser, argv)
    if args.devices < 1:
        parser.error(f"--devices={args.devices} is invalid: use a positive count")
    try:
        if args.mesh:
            config.mesh.update(parse_mesh(args.mesh))
        config = resolve_for(config, args.devices)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    absl_logging.set_verbosity(absl_logging.WARNING)
    import jax

    if not args.no_compile:  # before anything starts JAX's backend (stage 2 needs devices)
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    report = dry_run(config, compile_step=not args.no_compile)
    print(json.dumps(report) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
