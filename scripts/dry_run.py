"""Dry run for a target topology: `python scripts/dry_run.py --config PATH[:ARG] --devices N
[--mesh AXIS=SIZE,...] [--config.FIELD=VALUE ...] [--json] [--no_compile]`, or, with the TPU
compiler, `python scripts/dry_run.py --config PATH[:ARG] --target TYPE [--slices K] [--json]
[--no_decode]`

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

With `--target TYPE` (a Cloud TPU accelerator type: v4-32, v5p-128, v5e-16 or v5litepod-16,
v6e-64; `sharding.tpu` names chips and cores as each generation does), stage 2 compiles instead
with the TPU compiler (libtpu, the `tpu` extra; without it, one line naming the extra and exit
2) for the compile-only devices of that topology, K slices of it with `--slices K` (joined by
DCN: the config's mesh.dcn factors must multiply to K). Nothing is allocated and no TPU is
needed. It compiles the train step and the one-token KV-cache decode step (batch_size
sequences, a cache of seq_len positions; `--no_decode` skips it) and reports per chip, under
the JSON key "tpu": device kind, chips, slices, topology; argument, temporary, output, aliased
and peak bytes against the chip's HBM, and whether it fits; the collectives by kind with their
bytes and ICI / DCN traffic (`sharding.collectives`: async `-start` forms and the TPU's fused
all-reduce-scatter counted, loop bodies times their trip count); the compile time; and a
roofline step estimate: accounting FLOPs (arch/accounting.py) / the chip's bf16 peak, HBM bytes
(the compiled program's cost_analysis(), scaled by accounting FLOPs / compiled FLOPs, as its
loop bodies are counted once) / HBM bandwidth, ICI and DCN traffic / their bandwidths; the step
is the slowest of them, MFU the compute time over it, and chip-hours = step × config.steps ×
chips. The chips' figures are `sharding.tpu.CHIPS`, each citing its public spec. A train step
whose peak exceeds the chip's HBM prints the report, then one line on stderr (peak, capacity,
the knobs: mesh.fsdp, execution.remat, accumulation_steps) and exits 2; so does one the TPU
compiler itself refuses for lack of HBM, with the compiler's figures.

`python scripts/dry_run.py --all [--only NAME,...]` compiles every experiment file's paper scale
for the accelerator type the file declares (`TARGET = "v5p-16"`; the baseline arm at the
largest size of a scaling study, or the file's `TARGET_ARG`; a tokenizer-set vocabulary,
`vocab_size=0`, as `TARGET_VOCAB` or 32768) and writes one row per file into docs/pods.md's
table (target, mesh, remat and accumulation, peak HBM per chip against capacity, compile time,
step estimate, MFU, chip-hours, the command and the commit), keeping the rows of files not
compiled this time; exit 2 if one does not fit.
"""

from __future__ import annotations

import json
import math
import re
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
    return _memory(compiled)


def _memory(compiled) -> dict:
    memory = compiled.memory_analysis()
    result = {"temp_bytes": memory.temp_size_in_bytes,
              "argument_bytes": memory.argument_size_in_bytes,
              "output_bytes": memory.output_size_in_bytes,
              "alias_bytes": memory.alias_size_in_bytes}
    result["peak_bytes"] = (result["argument_bytes"] + result["output_bytes"]
                            - result["alias_bytes"] + result["temp_bytes"])
    return result


def _collective_summary(compiled, mesh) -> dict:
    """`sharding.collectives` of the compiled program, by kind, for one chip; DCN traffic is
    that of groups spanning slices (partition id i is the mesh's i-th device)."""
    from sharding.collectives import collectives

    slice_of = [getattr(device, "slice_index", 0) for device in mesh.devices.flat]
    return collectives(compiled.as_text(), slice_of)


def _roofline(chip, flops: float, compiled_cost: dict, traffic: dict, devices: int,
              steps: int | None = None) -> dict:
    """Step-time estimate for one chip: each resource's time at its peak, the step the
    slowest of them (perfect overlap). `flops`: the project's accounting per chip; the compiled
    program's `cost_analysis()` counts a loop body once, so its HBM bytes are scaled by
    accounting FLOPs / compiled FLOPs (`loop_factor`) to stand for the whole step."""
    compiled_flops = float(compiled_cost.get("flops", 0.0))
    loop_factor = flops / compiled_flops if compiled_flops > 0 else 1.0
    hbm_bytes = float(compiled_cost.get("bytes accessed", 0.0)) * loop_factor
    times = {"compute_s": flops / chip.bf16_flops,
             "hbm_s": hbm_bytes / chip.hbm_bandwidth,
             "ici_s": traffic["ici"] / chip.ici_bandwidth,
             "dcn_s": traffic["dcn"] / chip.dcn_bandwidth}
    step = max(times.values())
    result = {"flops_per_chip": flops, "compiled_flops": compiled_flops,
              "loop_factor": loop_factor, "hbm_bytes_estimate": hbm_bytes, **times,
              "step_s": step, "bound": max(times, key=times.get)[:-2],
              "mfu": times["compute_s"] / step if step > 0 else 0.0}
    if steps is not None:
        result["chip_hours"] = step * steps * devices / 3600
    return result


def _traffic(collective_report: dict) -> dict:
    return {link: sum(entry[f"{link}_traffic_bytes"] for entry in collective_report.values())
            for link in ("ici", "dcn")}


def compile_decode_step(program):
    """(seconds, compiled, per-chip cache bytes) of the one-token KV-cache decode step of
    `program`'s model, for config.batch_size sequences and a cache of config.seq_len positions,
    the cache sharded over the batch axes and donated, in evaluation mode (as in
    `train.generate`); lowered from abstract values (nothing is allocated)."""
    import time

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sharding.rules import named_sharding

    config = program.config
    batch, length = config.batch_size, config.seq_len
    dtype = jnp.dtype(program.model_cfg.dtype)
    state = program.abstract_state()
    stack = len(nnx.eval_shape(lambda: program._model(nnx.Rngs(0))).stack_shape)
    stack += config.model.get("loop_count", 1) > 1

    def merged(params, model_state):
        model = nnx.merge(program.graphdef, params, model_state)
        model.eval()
        return model

    def init_cache(params, model_state):
        return merged(params, model_state).init_cache(batch, length, dtype)

    def place(leaf):
        axis = next((i for i in range(stack, leaf.ndim) if leaf.shape[i] == batch), None)
        logical = [None] * leaf.ndim
        if axis is not None:
            logical[axis] = "act_batch"
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                    sharding=named_sharding(program.mesh, logical, leaf.shape))

    with jax.set_mesh(program.mesh):
        cache = jax.tree.map(place, jax.eval_shape(init_cache, state["params"],
                                                   state["model_state"]))

    def decode(params, model_state, cache, token_Bx1, position):
        logits_Bx1xV, cache = merged(params, model_state).decode(
            token_Bx1, jnp.full(token_Bx1.shape, position, jnp.int32), cache)
        return jnp.argmax(logits_Bx1xV, axis=-1).astype(jnp.int32), cache

    token = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=program.batch_sharding)
    position = jax.ShapeDtypeStruct((), jnp.int32)
    start = time.perf_counter()
    with jax.set_mesh(program.mesh):
        compiled = jax.jit(decode, donate_argnums=2).lower(
            state["params"], state["model_state"], cache, token, position).compile()
    return time.perf_counter() - start, compiled, sum(_bytes(x) for x in jax.tree.leaves(cache))


def tpu_report(config, target, decode: bool = True) -> dict:
    """Stage 2 for a TPU target (`sharding.tpu.Target`): the resolved `config`'s train step
    (and its one-token decode step) compiled by the TPU compiler for the target's compile-only
    devices, and per chip: memory against HBM, collectives by kind, compile time, a roofline
    step estimate, MFU and chip-hours for config.steps."""
    from arch.accounting import flops_per_token
    from sharding.collectives import entry_parameter_bytes
    from sharding.mesh import make_mesh
    from sharding.tpu import target_devices
    from train.step import TrainProgram, compile_train_step

    chip = target.chip
    devices = target_devices(target)
    program = TrainProgram(config, make_mesh(config, devices))
    seconds, compiled = compile_train_step(program)
    memory = _memory(compiled)
    # the arguments' element bytes (stage 1's arithmetic) and as allocated, tile-padded
    memory["argument_bytes_unpadded"], memory["argument_bytes_padded"] = entry_parameter_bytes(
        compiled.as_text())
    collective_report = _collective_summary(compiled, program.mesh)
    cost = compiled.cost_analysis() or {}
    tokens = config.batch_size * config.seq_len
    flops = flops_per_token(config.model, config.seq_len, training=True) * tokens / target.devices
    report = {"target": target.accelerator_type, "device_kind": devices[0].device_kind,
              "chips": target.devices, "chips_per_slice": target.chips,
              "topology": target.topology, "hbm_bytes": chip.hbm_bytes,
              "chip_source": chip.source,
              "train": {**memory, "fits": memory["peak_bytes"] <= chip.hbm_bytes,
                        "compile_seconds": seconds, "collectives": collective_report,
                        "roofline": _roofline(chip, flops, cost, _traffic(collective_report),
                                              target.devices, config.steps)}}
    if decode:
        seconds, compiled, cache_bytes = compile_decode_step(program)
        memory = _memory(compiled)
        collective_report = _collective_summary(compiled, program.mesh)
        flops = (flops_per_token(config.model, config.seq_len, training=False)
                 * config.batch_size / target.devices)
        report["decode"] = {**memory, "fits": memory["peak_bytes"] <= chip.hbm_bytes,
                            "cache_bytes": cache_bytes, "compile_seconds": seconds,
                            "batch": config.batch_size, "cache_positions": config.seq_len,
                            "collectives": collective_report,
                            "roofline": _roofline(chip, flops, compiled.cost_analysis() or {},
                                                  _traffic(collective_report), target.devices)}
    return report


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


def tpu_table(report: dict) -> str:
    """The TPU section of the report as text."""
    lines = [f"TPU target {report['target']}: {report['chips']} × {report['device_kind']} "
             f"({report['topology']} per slice), HBM {human(report['hbm_bytes'])} per chip "
             f"({report['chip_source']})"]
    for step in ("train", "decode"):
        if step not in report:
            continue
        part, roof = report[step], report[step]["roofline"]
        extra = (f", KV cache {human(part['cache_bytes'])} per chip for {part['batch']} × "
                 f"{part['cache_positions']} positions" if step == "decode" else "")
        lines += ["", f"{step} step, per chip (TPU compiler, {part['compile_seconds']:.1f} s to "
                  f"compile){extra}:"]
        lines += [f"  {name:<12}{human(part[key + '_bytes']):>12}" for name, key in
                  (("arguments", "argument"), ("outputs", "output"), ("aliased", "alias"),
                   ("temporaries", "temp"), ("peak", "peak"))]
        lines.append(f"  fits: {'yes' if part['fits'] else 'NO'} "
                     f"({100 * part['peak_bytes'] / report['hbm_bytes']:.0f}% of HBM)")
        lines.append("  collectives (count, bytes, ICI / DCN traffic):")
        for kind, entry in part["collectives"].items():
            if entry["count"]:
                fused = f", {entry['fused']} fused all-reduce-scatter" if entry["fused"] else ""
                lines.append(f"    {kind:<20}{entry['count']:>5}  {human(entry['bytes']):>10}  "
                             f"{human(entry['ici_traffic_bytes']):>10} / "
                             f"{human(entry['dcn_traffic_bytes'])}{fused}")
        lines.append(f"  roofline: compute {roof['compute_s'] * 1e3:.2f} ms, HBM "
                     f"{roof['hbm_s'] * 1e3:.2f} ms, ICI {roof['ici_s'] * 1e3:.2f} ms, DCN "
                     f"{roof['dcn_s'] * 1e3:.2f} ms → step ≈ {roof['step_s'] * 1e3:.2f} ms "
                     f"({roof['bound']}-bound), MFU ≈ {100 * roof['mfu']:.0f}%"
                     + (f", {roof['chip_hours']:.1f} chip-hours for the run's steps"
                        if "chip_hours" in roof else ""))
        lines.append(f"  FLOPs per chip: accounting {roof['flops_per_chip']:.3g}, compiled "
                     f"cost_analysis {roof['compiled_flops']:.3g} (loop bodies counted once)")
    return "\n".join(lines)


KNOBS = ("shard more (a larger config.mesh.fsdp), recompute more (config.execution.remat=full) "
         "or split the batch (config.accumulation_steps)")


def _does_not_fit(config_path: str, report: dict) -> str | None:
    """The one-line refusal when the train step's peak exceeds the chip's HBM, else None."""
    train = report["train"]
    if train["fits"]:
        return None
    return (f"error: {config_path} does not fit {report['target']}: peak "
            f"{human(train['peak_bytes'])} per chip > {human(report['hbm_bytes'])} HBM; {KNOBS}")


def _compiler_out_of_memory(config_path: str, target: str, error: Exception) -> str | None:
    """The one-line refusal when the TPU compiler itself gives up for lack of HBM (it does when
    the temporaries alone exceed it), else None."""
    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message and "out of memory" not in message.lower():
        return None
    found = re.search(r"(?:the )?(total memory required[^\n]*?exceeds available HBM "
                      r"\([^)]*\))", message)
    reason = found[1] if found else message.strip().splitlines()[0][:200]
    return f"error: {config_path} does not fit {target}: the TPU compiler: {reason}; {KNOBS}"


PODS_DOC = "docs/pods.md"
TABLE_BEGIN, TABLE_END = "<!-- dry_run --all: begin -->", "<!-- dry_run --all: end -->"
TABLE_HEAD = ("| experiment | target | mesh | remat, accumulation | HBM per chip (peak / capacity) "
              "| compile | step (est.) | MFU (est.) | chip-hours (est.) | commit |\n"
              "|---|---|---|---|---|---|---|---|---|---|")


def paper_scale(module) -> str | None:
    """The config argument `--all` compiles for an experiment module: its `TARGET_ARG`, or the
    baseline arm at the largest size (`SCALING`'s last), paper scale; None without a paper
    scale."""
    if "paper" not in getattr(module, "SCALES", ()):
        return None
    if hasattr(module, "TARGET_ARG"):
        return module.TARGET_ARG
    sizes = getattr(module, "SCALING", ())
    return f"{module.BASELINE}@{sizes[-1]},paper" if sizes else f"{module.BASELINE},paper"


PAPER_VOCAB = 32_768  # a paper scale's vocabulary when its tokenizer sets it (vocab_size=0)


def experiments_with_targets(only: set[str] | None = None) -> list[tuple[str, str, str, int]]:
    """(experiment file, config argument, TARGET, vocabulary) of every experiment file with a
    paper scale and a declared TARGET (ConfigError naming a paper-scale file that declares
    none). The vocabulary stands in for one its tokenizer gives at run time (`vocab_size=0`):
    the file's TARGET_VOCAB, else PAPER_VOCAB."""
    from pathlib import Path

    from config.cli import load_module

    found = []
    for path in sorted(Path("experiments").glob("*.py")):
        if only is not None and path.stem not in only:
            continue
        module = load_module(str(path))
        arg = paper_scale(module)
        if arg is None:
            continue
        if not hasattr(module, "TARGET"):
            raise ConfigError(f"{path} has a paper scale but no TARGET: declare the accelerator "
                              'type it is meant for, e.g. TARGET = "v5p-64"')
        found.append((str(path), arg, module.TARGET,
                      getattr(module, "TARGET_VOCAB", PAPER_VOCAB)))
    return found


def table_row(path: str, arg: str, report: dict, commit: str) -> str:
    """One row of docs/pods.md's table for a resolved config's TPU report."""
    tpu, train = report["tpu"], report["tpu"]["train"]
    roof = train["roofline"]
    mesh = ", ".join(f"{axis}={size}" for axis, size in report["mesh"].items() if size > 1)
    dcn = ", ".join(f"{axis}={size}" for axis, size in report["dcn"].items() if size > 1)
    command = (f"`python scripts/dry_run.py --config {path}:{arg} --target {tpu['target']}"
               + (f" --slices {report['slices']}" if report["slices"] > 1 else "")
               + (f" --config.model.vocab_size={report['vocab_override']}"
                  if report.get("vocab_override") else "") + "`")
    return (f"| {command} | {tpu['target']} ({tpu['chips']} × {tpu['device_kind']}) | "
            f"{mesh or '1 device'}{f'; DCN {dcn}' if dcn else ''} | {report['remat']}, "
            f"{report['accumulation_steps']} | {human(train['peak_bytes'])} / "
            f"{human(tpu['hbm_bytes'])}{'' if train['fits'] else ' (does NOT fit)'} | "
            f"{train['compile_seconds']:.0f} s | {roof['step_s'] * 1e3:.0f} ms "
            f"({roof['bound']}) | {100 * roof['mfu']:.0f}% | {roof['chip_hours']:.0f} | "
            f"{commit} |")


def write_table(rows: dict[str, str], doc: str = PODS_DOC) -> None:
    """Put `rows` (experiment file → row) into the doc's table between its markers, keeping the
    rows of experiments not compiled this time."""
    from pathlib import Path

    text = Path(doc).read_text()
    begin, end = text.index(TABLE_BEGIN), text.index(TABLE_END)
    kept = {}
    for line in text[begin:end].splitlines():
        found = re.search(r"--config (experiments/[\w.]+\.py)", line)
        if found and line.startswith("| `"):
            kept[found[1]] = line
    kept.update(rows)
    body = "\n".join([TABLE_HEAD, *(kept[key] for key in sorted(kept))])
    Path(doc).write_text(text[:begin] + TABLE_BEGIN + "\n" + body + "\n" + text[end:])


def run_all(only: set[str] | None) -> int:
    """`--all`: every experiment's paper scale compiled for its TARGET; the table into
    docs/pods.md. Exit 2 if one does not fit (each such one also gets its line)."""
    import subprocess

    import jax

    jax.config.update("jax_platforms", "cpu")
    from config.cli import load_experiment
    from sharding.tpu import parse_target

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                      capture_output=True, text=True).stdout.strip():
        commit += " + uncommitted changes"  # the table says what code made each row
    status, rows = 0, {}
    for path, arg, accelerator_type, vocab in experiments_with_targets(only):
        print(f"{path}:{arg} → {accelerator_type}", file=sys.stderr, flush=True)
        config = load_experiment(f"{path}:{arg}")
        report_vocab = None
        if config.model.vocab_size == 0:  # set by the tokenizer at run time
            config.model.vocab_size = report_vocab = vocab
        target = parse_target(accelerator_type)
        config = resolve_for(config, target.devices)
        report = dry_run(config, compile_step=False)
        report["remat"] = config.execution.remat
        report["accumulation_steps"] = config.accumulation_steps
        report["vocab_override"] = report_vocab
        try:
            report["tpu"] = tpu_report(config, target, decode=False)
        except jax.errors.JaxRuntimeError as error:
            refusal = _compiler_out_of_memory(path, accelerator_type, error)
            if refusal is None:
                raise
            print(refusal, file=sys.stderr)
            status = 2
            continue
        refusal = _does_not_fit(path, report["tpu"])
        if refusal:
            print(refusal, file=sys.stderr)
            status = 2
        rows[path] = table_row(path, arg, report, commit)
        print(rows[path], flush=True)
        write_table(rows)  # row by row: a long run keeps what it has
    return status


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/dry_run.py", __doc__)
    parser.add_argument("--devices", type=int, default=None,
                        help="device count of the target topology (simulated CPU devices)")
    parser.add_argument("--target", default=None, metavar="TYPE",
                        help="a Cloud TPU accelerator type (v5e-16, v5p-128, v4-32, v6e-64): "
                             "compile with the TPU compiler (the tpu extra: libtpu)")
    parser.add_argument("--slices", type=int, default=1,
                        help="with --target: slices of that type, joined by DCN")
    parser.add_argument("--no_decode", action="store_true",
                        help="with --target: skip compiling the one-token decode step")
    parser.add_argument("--mesh", metavar="AXIS=SIZE[,...]", default=None,
                        help="config.mesh axes to set")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout instead of a table")
    parser.add_argument("--no_compile", action="store_true", help="skip compiling (no temp_bytes)")
    parser.add_argument("--all", action="store_true",
                        help="every experiment's paper scale compiled for its TARGET; the table "
                             "into docs/pods.md")
    parser.add_argument("--only", default=None, metavar="NAME[,...]",
                        help="with --all: only these experiment files (names without .py)")
    config, args = parse_with_config(parser, argv, required=False)
    if args.all:
        if config is not None or args.target or args.devices:
            parser.error("--all takes no --config, --target or --devices: each experiment "
                         "file declares its TARGET")
        try:
            return run_all(set(args.only.split(",")) if args.only else None)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if config is None:
        parser.error("--config is required, e.g. --config experiments/quickstart.py")
    if (args.devices is None) == (args.target is None):
        parser.error("give one of --devices N (simulated CPU devices) or --target TYPE (a TPU "
                     "accelerator type, e.g. v5e-16)")
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices={args.devices} is invalid: use a positive count")
    target = None
    try:
        if args.target is not None:
            from sharding.tpu import libtpu_available, parse_target

            target = parse_target(args.target, args.slices)
            if not libtpu_available():
                raise ConfigError(f"--target={args.target} needs the TPU compiler, libtpu, which "
                                  "is not installed: pip install -e '.[tpu]'")
        if args.mesh:
            config.mesh.update(parse_mesh(args.mesh))
        config = resolve_for(config, target.devices if target else args.devices)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    absl_logging.set_verbosity(absl_logging.WARNING)
    import jax

    if target is not None:
        jax.config.update("jax_platforms", "cpu")  # libtpu compiles; nothing runs on a TPU
        report = dry_run(config, compile_step=False)
        try:
            report["tpu"] = tpu_report(config, target, decode=not args.no_decode)
        except jax.errors.JaxRuntimeError as error:
            refusal = _compiler_out_of_memory(args.config, target.accelerator_type, error)
            if refusal is None:
                raise
            print(refusal, file=sys.stderr)
            return 2
        print(json.dumps(report) if args.json else table(report) + "\n\n"
              + tpu_table(report["tpu"]))
        refusal = _does_not_fit(args.config, report["tpu"])
        if refusal:
            print(refusal, file=sys.stderr)
            return 2
        return 0
    if not args.no_compile:  # before anything starts JAX's backend (stage 2 needs devices)
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    report = dry_run(config, compile_step=not args.no_compile)
    print(json.dumps(report) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
