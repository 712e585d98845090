"""Benchmark one train step: `python scripts/bench.py --config PATH[:ARG] [--config.FIELD=VALUE ...]
[--json] [--steps N] [--block K] [--depth_check] [--baseline FIELD=VALUE[,...]]
[--depth_memory A,B]`

Runs on whatever devices exist (one CPU device normally) with random tokens of the config's
batch_size × (seq_len + 1), and reports, in one run:

  step_time_s            median wall time of one framework train step (`TrainProgram.train_step`,
                         each step synced), over --steps timed steps after two warm-up steps
  tokens_per_sec         batch_size · seq_len / step_time_s
  compile_time_s         lower + compile of the jitted train step (the first, cold compile)
  mfu                    tokens_per_sec · flops_per_token / (peak_flops · device count)
  peak_flops             measured matmul FLOP/s of one device (`train.metrics.measure_matmul_peak`)
  temp_bytes             XLA's compiled scratch memory (`memory_analysis().temp_size_in_bytes`);
                         argument_bytes / output_bytes alongside
  reference_step_time_s  median step time of the hand-written pure-JAX step (`arch/reference.py`)
                         for the same model, batch, optimizer and initial parameters
  vs_reference           step_time_s / reference_step_time_s; target ≤ 1.05. Framework and
                         reference steps run in alternating blocks of --block steps (ABBA order),
                         so machine noise hits both alike. null (and not timed) for variants the
                         reference does not implement.
  compile_24_over_4      only with --depth_check (off by default: it compiles four more programs,
                         ~15 s for the quickstart): cold compile time at num_layers=24 over
                         num_layers=4, the rest of the config as given, best of two fresh compiles
                         each; target ≤ 1.5 (the layer scan keeps compile time flat in depth).
  baseline_step_time_s   only with --baseline FIELD=VALUE[,FIELD=VALUE...] (e.g.
                         `--baseline model.reversible=False`): a second config, the benchmarked
                         one with those overrides (applied before validation, so derived fields
                         follow), compiled and timed interleaved with the framework step (same
                         batch, ABBA blocks); its median step time, and
  step_time_vs_baseline  step_time_s / baseline_step_time_s, and
  temp_bytes_vs_baseline temp_bytes / the baseline's temp_bytes. Target for the reversible stack
                         (issue 3) against the ordinary one: step_time_vs_baseline ≤ 1.5.
  temp_bytes_depth_ratio only with --depth_memory A,B (e.g. `2,16`): compiled temp bytes of the
                         train step at num_layers=B over num_layers=A (compile only, never run;
                         each also reported as temp_bytes_layers_A / _B). Target for the
                         reversible stack (issue 3): ≤ 1.3 from 2 to 16 layers.

Targets are reported, never asserted. `--json` prints exactly one JSON object on stdout; progress
goes to stderr. Example: python scripts/bench.py --config experiments/quickstart.py --depth_check
Reversible vs ordinary: python scripts/bench.py --config experiments/quickstart.py
  --config.model.reversible=True --baseline model.reversible=False --depth_memory 2,16
"""

from __future__ import annotations

import ast
import json
import math
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from absl import logging as absl_logging
from flax import nnx
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment file, PATH[:ARG].",
                                          lock_config=False)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object on stdout instead of a table.")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps, each of framework and reference.")
_BLOCK = flags.DEFINE_integer("block", 5, "Steps per interleaved block.")
_DEPTH = flags.DEFINE_bool("depth_check", False, "Also measure compile_24_over_4.")
_BASELINE = flags.DEFINE_string(
    "baseline", None, "FIELD=VALUE[,FIELD=VALUE...]: overrides giving a baseline config to time "
    "against, e.g. model.reversible=False.")
_DEPTH_MEMORY = flags.DEFINE_string(
    "depth_memory", None, "A,B: compiled temp bytes of the train step at num_layers A and B.")
flags.mark_flag_as_required("config")

TARGETS = {"vs_reference": "<= 1.05", "compile_24_over_4": "<= 1.5",
           "step_time_vs_baseline": "<= 1.5 (reversible vs ordinary)",
           "temp_bytes_depth_ratio": "<= 1.3 (reversible, 2 to 16 layers)"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def compile_train_step(program) -> tuple[float, jax.stages.Compiled]:
    """Seconds to lower and compile the program's jitted train step, and the executable."""
    config = program.config
    state = program.abstract_state()
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32,
                                 sharding=program.batch_sharding)
    start = time.perf_counter()
    with jax.set_mesh(program.mesh):
        compiled = program._train_step.lower(state, batch).compile()
    return time.perf_counter() - start, compiled


def framework_runner(program, batch: jax.Array) -> Callable[[], None]:
    """One synced framework train step per call, on its own donated state."""
    carry = {"state": program.init(program.config.seed)}

    def step() -> None:
        carry["state"], metrics = program.train_step(carry["state"], batch)
        jax.block_until_ready((carry["state"], metrics))
    return step


def reference_runner(program, batch: jax.Array) -> Callable[[], None]:
    """One synced reference train step per call, from the same initial parameters."""
    from arch import reference

    train_step = reference.make_train_step(program.config.model, program.optimizer)
    params = nnx.to_pure_dict(program.init(program.config.seed)["params"])
    carry = {"params": params, "opt_state": program.optimizer.init(params)}

    def step() -> None:
        carry["params"], carry["opt_state"], loss = train_step(
            carry["params"], carry["opt_state"], batch)
        jax.block_until_ready((carry["params"], carry["opt_state"], loss))
    return step


def time_interleaved(runners: dict[str, Callable[[], None]], steps: int,
                     block: int) -> dict[str, list[float]]:
    """Per-step seconds of each runner: two warm-up steps each, then alternating blocks."""
    for run in runners.values():
        run(), run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    for i in range(math.ceil(steps / block)):
        for name in names if i % 2 == 0 else names[::-1]:  # ABBA: neither always goes first
            for _ in range(min(block, steps - i * block)):
                start = time.perf_counter()
                runners[name]()
                times[name].append(time.perf_counter() - start)
    return times


def parse_value(text: str, current):
    """A command-line value in the type of the field it replaces."""
    if isinstance(current, bool):
        if text.lower() not in ("true", "false"):
            raise app.UsageError(f"expected True or False, got {text!r}")
        return text.lower() == "true"
    if isinstance(current, int | float):
        return type(current)(text)
    if isinstance(current, str):
        return text
    try:  # a field whose default is None
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def with_overrides(config, overrides: str):
    """A copy of `config` with `FIELD=VALUE[,FIELD=VALUE...]` applied (dotted field paths)."""
    config = config.copy_and_resolve_references()
    for item in filter(None, overrides.split(",")):
        path, sep, text = item.partition("=")
        if not sep:
            raise app.UsageError(f"--baseline: expected FIELD=VALUE, got {item!r}")
        *parents, field = path.strip().split(".")
        node = config
        for name in parents:
            node = node[name]
        if field not in node:
            raise app.UsageError(f"--baseline: no config field {path!r}")
        node[field] = parse_value(text.strip(), node[field])
    return config


def depth_memory(config, depths: tuple[int, int]) -> dict[str, float]:
    """Compiled temp bytes of the train step at each of two depths (compile only), and the
    ratio of the second to the first."""
    from train.loop import build_program

    temp = {}
    for layers in depths:
        deep = config.copy_and_resolve_references()
        deep.model.num_layers = layers
        _, compiled = compile_train_step(build_program(deep))
        temp[layers] = compiled.memory_analysis().temp_size_in_bytes
        log(f"temp bytes at {layers} layers: {temp[layers]:,}")
    a, b = depths
    return {f"temp_bytes_layers_{a}": temp[a], f"temp_bytes_layers_{b}": temp[b],
            "temp_bytes_depth_ratio": temp[b] / temp[a]}


def depth_compile_ratio(config, repeats: int = 2) -> dict[str, float]:
    """Cold compile seconds of the train step at 4 and 24 layers (best of `repeats`, each a
    fresh program, alternating depths), and their ratio."""
    from train.loop import build_program

    seconds: dict[int, float] = {4: math.inf, 24: math.inf}
    for _ in range(repeats):
        for layers in seconds:
            deep = config.copy_and_resolve_references()
            deep.model.num_layers = layers
            took, _ = compile_train_step(build_program(deep))
            seconds[layers] = min(seconds[layers], took)
            log(f"compile at {layers} layers: {took:.2f} s")
    return {"compile_4_layers_s": seconds[4], "compile_24_layers_s": seconds[24],
            "compile_24_over_4": seconds[24] / seconds[4]}


def bench(config, steps: int, block: int, depth_check: bool, baseline: str | None = None,
          depths: tuple[int, int] | None = None) -> dict:
    from arch import reference
    from arch.accounting import flops_per_token
    from train.loop import build_program
    from train.metrics import measure_matmul_peak

    pristine = config.copy_and_resolve_references()  # before derived fields are filled in
    baseline_config = with_overrides(pristine, baseline) if baseline else None
    program = build_program(config)  # validates and resolves config.model in place
    log(f"{jax.device_count()} device(s): {jax.devices()[0].device_kind}; compiling...")
    compile_time, compiled = compile_train_step(program)
    memory = compiled.memory_analysis()
    tokens = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (config.batch_size, config.seq_len + 1), dtype=np.int32)
    batch = program.put_batch(tokens)
    runners = {"framework": framework_runner(program, batch)}
    if baseline_config is not None:
        log(f"compiling the baseline ({baseline})...")
        baseline_program = build_program(baseline_config)
        _, baseline_compiled = compile_train_step(baseline_program)
        baseline_memory = baseline_compiled.memory_analysis()
        runners["baseline"] = framework_runner(baseline_program, baseline_program.put_batch(tokens))
    if reason := reference.unsupported(config.model):
        log(f"no reference comparison: {reason}")
    else:
        runners["reference"] = reference_runner(program, batch)
    log(f"timing {steps} steps each of {' and '.join(runners)}, in blocks of {block}...")
    times = time_interleaved(runners, steps, block)
    step_time = statistics.median(times["framework"])
    reference_time = statistics.median(times["reference"]) if "reference" in times else None
    peak = measure_matmul_peak()
    tokens_per_sec = config.batch_size * config.seq_len / step_time
    flops = flops_per_token(config.model, config.seq_len)
    result = {
        "tokens_per_sec": tokens_per_sec, "step_time_s": step_time,
        "compile_time_s": compile_time,
        "mfu": tokens_per_sec * flops / (peak * jax.device_count()), "peak_flops": peak,
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "output_bytes": getattr(memory, "output_size_in_bytes", None),
        "reference_step_time_s": reference_time,
        "vs_reference": step_time / reference_time if reference_time else None,
        "flops_per_token": flops, "devices": jax.device_count(), "steps": steps,
    }
    if baseline_config is not None:
        baseline_time = statistics.median(times["baseline"])
        result.update(
            baseline_step_time_s=baseline_time, step_time_vs_baseline=step_time / baseline_time,
            baseline_temp_bytes=baseline_memory.temp_size_in_bytes,
            temp_bytes_vs_baseline=(memory.temp_size_in_bytes
                                    / max(baseline_memory.temp_size_in_bytes, 1)))
    if depths is not None:
        result.update(depth_memory(pristine, depths))
    if depth_check:
        result.update(depth_compile_ratio(config))
    return result


def table(result: dict) -> str:
    rows = [f"{'metric':<24}{'value':>16}  target"]
    for name, value in result.items():
        text = (f"{value:,}" if isinstance(value, int) else "n/a" if value is None
                else f"{value:.3%}" if name == "mfu" else f"{value:.4g}")
        rows.append(f"{name:<24}{text:>16}  {TARGETS.get(name, '')}".rstrip())
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax and absl log at INFO
    from arch.config import ConfigError

    try:
        depths = None
        if _DEPTH_MEMORY.value:
            try:
                a, b = (int(n) for n in _DEPTH_MEMORY.value.split(","))
            except ValueError:
                raise app.UsageError(
                    f"--depth_memory: expected A,B (two layer counts), got {_DEPTH_MEMORY.value!r}"
                ) from None
            depths = (a, b)
        result = bench(_CONFIG.value, _STEPS.value, _BLOCK.value, _DEPTH.value, _BASELINE.value,
                       depths)
    except ConfigError as error:
        log(f"error: {error}")
        sys.exit(2)
    print(json.dumps(result) if _JSON.value else table(result))


if __name__ == "__main__":
    app.run(main)
