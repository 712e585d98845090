"""Benchmark one train step: `python scripts/bench.py --config PATH[:ARG] [--config.FIELD=VALUE ...]
[--json] [--steps N] [--block K] [--depth_check]`

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

Targets are reported, never asserted. `--json` prints exactly one JSON object on stdout; progress
goes to stderr. Example: python scripts/bench.py --config experiments/quickstart.py --depth_check
"""

from __future__ import annotations

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
flags.mark_flag_as_required("config")

TARGETS = {"vs_reference": "<= 1.05", "compile_24_over_4": "<= 1.5"}


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


def bench(config, steps: int, block: int, depth_check: bool) -> dict:
    from arch import reference
    from arch.accounting import flops_per_token
    from train.loop import build_program
    from train.metrics import measure_matmul_peak

    program = build_program(config)  # validates and resolves config.model in place
    log(f"{jax.device_count()} device(s): {jax.devices()[0].device_kind}; compiling...")
    compile_time, compiled = compile_train_step(program)
    memory = compiled.memory_analysis()
    tokens = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (config.batch_size, config.seq_len + 1), dtype=np.int32)
    batch = program.put_batch(tokens)
    runners = {"framework": framework_runner(program, batch)}
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
        result = bench(_CONFIG.value, _STEPS.value, _BLOCK.value, _DEPTH.value)
    except ConfigError as error:
        log(f"error: {error}")
        sys.exit(2)
    print(json.dumps(result) if _JSON.value else table(result))


if __name__ == "__main__":
    app.run(main)
