"""Attention implementations against each other (arch/kernels/attention_implementations.py), in
one run:

  python scripts/attention_bench.py --config experiments/quickstart.py
      [--memory 1024,4096,16384] [--speed 256,512,1024,2048,4096] [--tokens 8192]
      [--implementations xla,blocked] [--steps 10] [--block 2] [--json]

--memory LENGTHS  compiled temp bytes (`memory_analysis().temp_size_in_bytes`; compile only,
                  nothing runs) of the framework's train step at each sequence length T, batch 1,
                  per implementation (`execution.attention_implementation`), the rest of the config
                  as given. Reports temp_bytes[impl][T], growth[impl] = temp at the largest T
                  over temp at the smallest, and vs_xla[impl][T] = temp / xla's temp.
                  Target: blocked growth ≤ 20 from 1K to 16K (explicit scores: ~256).
--speed LENGTHS   seconds of one jitted forward + backward pass of attention alone (`attend`,
                  the config's heads, head width and chunk) at each T with batch
                  max(1, tokens / T), the implementations timed interleaved (ABBA blocks, as
                  scripts/bench.py does) and reported as paired ratios to xla. This is what
                  `auto`'s CPU threshold (`CPU_BLOCKED_FROM_KEYS`) was chosen from.

Use a small model for --memory so that the compiles are quick on CPU, e.g.
  --config.model.d_model=64 --config.model.num_layers=2 --config.model.attention.num_heads=2
  --config.model.attention.num_kv_heads=2. Figures: docs/performance.md, "Attention
  implementations".
"""

from __future__ import annotations

import json
import statistics
import sys

from absl import logging as absl_logging

from config import ConfigError
from config.cli import ArgumentParser, add_timing_arguments, parse_with_config, positive_int
from config.resolution import unresolved
from train.data.arguments import check_config
from train.instruments.timing import paired_ratio, time_interleaved


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def lengths_of(text: str | None, flag: str) -> list[int]:
    """The sequence lengths of `--memory 1024,4096` (None: none); one-line ConfigError unless
    positive ints."""
    if text is None:
        return []
    try:
        lengths = [int(n) for n in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ConfigError(f"{flag}={text} is invalid: pass comma-separated positive sequence "
                          "lengths, e.g. 1024,4096")
    return lengths


def check_implementations(config, names: list[str]) -> None:
    """Each of --implementations is an `execution.attention_implementation` the config takes
    (resolved without JAX: `train.data.arguments.check_config`)."""
    for name in names:
        variant = unresolved(config)
        variant.execution.attention_implementation = name
        try:
            check_config(variant)
        except ConfigError as error:
            raise ConfigError(f"--implementations={','.join(names)}: {error}") from None


def memory(config, lengths: list[int], implementations: list[str]) -> dict:
    from train.step import build_program, compile_train_step, resolve_for_job

    temp = {name: {} for name in implementations}
    for name in implementations:
        for length in lengths:
            variant = config.copy_and_resolve_references()
            variant.seq_len, variant.batch_size = length, 1
            variant.execution.attention_implementation = name
            _, compiled = compile_train_step(build_program(resolve_for_job(variant)))
            temp[name][length] = compiled.memory_analysis().temp_size_in_bytes
            log(f"{name} T={length}: temp {temp[name][length]:,} bytes")
    low, high = min(lengths), max(lengths)
    return {"temp_bytes": temp,
            "growth": {name: temp[name][high] / temp[name][low] for name in implementations},
            "vs_xla": {name: {t: temp[name][t] / temp["xla"][t] for t in lengths}
                       for name in implementations} if "xla" in temp else None,
            "lengths": lengths}


def _runner(name: str, q, k, v, positions, chunk: int):
    """One synced, jitted forward + backward pass of `attend` per call."""
    import jax
    import jax.numpy as jnp

    from arch.attention import attend

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v, positions, positions, implementation=name,
                              chunk=chunk) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return lambda: jax.block_until_ready(step(q, k, v))


def speed(config, lengths: list[int], implementations: list[str], tokens: int, steps: int,
          block: int) -> dict:
    import jax
    import jax.numpy as jnp

    model = config.model
    heads, kv_heads = model.attention.num_heads, model.attention.num_kv_heads
    width = model.attention.head_dim or model.d_model // heads
    result = {}
    for length in lengths:
        batch = max(1, tokens // length)
        keys = jax.random.split(jax.random.key(0), 3)
        q = jax.random.normal(keys[0], (batch, length, heads, width))
        k = jax.random.normal(keys[1], (batch, length, kv_heads, width))
        v = jax.random.normal(keys[2], (batch, length, kv_heads, width))
        positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
        runners = {name: _runner(name, q, k, v, positions, config.execution.attention_chunk)
                   for name in implementations}
        times = time_interleaved(runners, steps, block)
        result[length] = {name: {"seconds": statistics.median(times[name]),
                                 "vs_xla": paired_ratio(times, name, implementations[0], block)}
                          for name in implementations}
        log(f"T={length} batch {batch}: " + ", ".join(
            f"{name} {entry['seconds'] * 1e3:.1f} ms ({entry['vs_xla']:.2f}× xla)"
            for name, entry in result[length].items()))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/attention_bench.py", __doc__)
    parser.add_argument("--memory", default=None,
                        help="sequence lengths for the temp-memory compiles, e.g. 1024,4096")
    parser.add_argument("--speed", default=None,
                        help="sequence lengths for the attention timings, e.g. 256,512")
    parser.add_argument("--tokens", type=positive_int, default=8192,
                        help="--speed: batch · T per timed call")
    parser.add_argument("--implementations", default="xla,blocked",
                        help="implementations to compare (xla first: the baseline)")
    add_timing_arguments(parser, steps=10, block=2,
                         steps_help="--speed: timed calls per implementation and T",
                         block_help="--speed: calls per interleaved block")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    config, args = parse_with_config(parser, argv)
    implementations = args.implementations.split(",")
    try:
        memory_lengths = lengths_of(args.memory, "--memory")
        speed_lengths = lengths_of(args.speed, "--speed")
        check_config(config)
        check_implementations(config, implementations)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    absl_logging.set_verbosity(absl_logging.WARNING)
    import jax  # after the checks: a bad argument is one line before JAX loads

    result = {"backend": jax.default_backend(), "chunk": config.execution.attention_chunk}
    if memory_lengths:
        result["memory"] = memory(config, memory_lengths, implementations)
    if speed_lengths:
        result["speed"] = speed(config, speed_lengths, implementations, args.tokens,
                                args.steps, args.block)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
