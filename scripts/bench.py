"""Benchmark one train step: `python scripts/bench.py --config PATH[:ARG] [--config.FIELD=VALUE ...]
[--json] [--steps N] [--block K] [--depth_check] [--baseline FIELD=VALUE[,...]]
[--depth_memory A,B] [--compare FIELD=VALUE[,...][;FIELD=VALUE[,...]...]] [--decode]
[--decode_batch B] [--decode_steps N] [--data [--data_batches N]] [--remat_policies A,B,...]
[--vs_torch] [--vs_unrolled] [--profile N]`

Runs on whatever devices exist (one CPU device normally) with random tokens of the config's
batch_size × (seq_len + 1) and reports, in one run, the framework's step time, tokens/s, compile
time, MFU and compiled memory, and paired ratios (ABBA blocks) to the hand-written reference
step and to the other programs the flags ask for. Every ratio `A_vs_B` is A / B of the named
quantity, the measured program over the one it is compared with: for times, < 1 means A is
faster. Every output, with the example commands: docs/instruments.md#benchmark-outputs;
measurements: docs/performance.md. Targets are reported, never asserted; `--json` prints exactly
one JSON object on stdout, progress goes to stderr.

The arguments, the config and every --baseline and --compare variant are checked (resolved by
`config.resolve`) before JAX loads: a bad one is one line on stderr and exit status 2.
"""

from __future__ import annotations

from train import hugepages

if __name__ == "__main__":  # first, as `python -m train` does: re-executing repeats the imports
    hugepages.reexec()

import contextlib
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from absl import logging as absl_logging

from config import ConfigError
from config.cli import (
    ArgumentParser,
    UsageError,
    add_timing_arguments,
    apply_override,
    parse_with_config,
    positive_int,
)
from config.resolution import unresolved
from train.data.arguments import check_config
from train.data.tokenizer import check_vocab, tokenizer_of
from train.instruments.timing import paired_ratio, time_interleaved

if TYPE_CHECKING:
    import jax

TARGETS = {"vs_reference": "<= 1.05", "compile_24_over_4": "<= 1.5",
           "step_time_vs_baseline": "<= 1.5 (reversible vs ordinary)",
           "temp_bytes_depth_ratio": "<= 1.3 (reversible, 2 to 16 layers)",
           "step_time_vs_config": "<= 1.05 (block_attnres, 8 blocks, vs the plain sum)",
           "decode_time_vs_config": "<= 1.05 (two-phase inference vs the plain sum)",
           "loader_vs_step": ">= 5 (data loading never limits the step)"}
DECODE_BLOCK = 20  # decode steps per interleaved block: a step is ~1 ms, noise comes in bursts


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def framework_runner(program, batch: jax.Array) -> Callable[[], None]:
    """One synced framework train step per call, on its own donated state."""
    import jax

    carry = {"state": program.init(program.config.seed)}

    def step() -> None:
        carry["state"], metrics = program.train_step(carry["state"], batch)
        jax.block_until_ready((carry["state"], metrics))
    return step


def reference_runner(program, batch: jax.Array, unrolled: bool = False) -> Callable[[], None]:
    """One synced reference train step per call, from the same initial parameters; `unrolled`:
    its layers in a Python loop rather than a scan."""
    import jax
    from flax import nnx

    from arch import reference
    from train.optim import decay_mask, make_optimizer

    config = program.config
    state = program.init(config.seed)["params"]
    # The framework's optimizer over the reference's plain dict: its decay mask read from the
    # framework's parameter types, once.
    optimizer = make_optimizer(config.optimizer, config.steps,
                               mask=nnx.to_pure_dict(decay_mask(config.optimizer, state)))
    train_step = reference.make_train_step(config.model, optimizer, unrolled)
    params = nnx.to_pure_dict(state)
    carry = {"params": params, "opt_state": optimizer.init(params)}

    def step() -> None:
        carry["params"], carry["opt_state"], loss = train_step(
            carry["params"], carry["opt_state"], batch)
        jax.block_until_ready((carry["params"], carry["opt_state"], loss))
    step.hlo = lambda: train_step.lower(carry["params"], carry["opt_state"], batch).compile(
        ).as_text()  # for --profile
    return step


def torch_runner(program, tokens: np.ndarray) -> Callable[[], None] | None:
    """One eager PyTorch train step per call (`train.interop.torch_model`) of the same model
    from the same initial parameters, on the same tokens; None, with one line on stderr, when
    torch is not importable or the config is not one the PyTorch model implements."""
    from flax import nnx

    from train.optim import decay_mask

    try:
        from train.interop import torch_model
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        log("no PyTorch comparison: torch is not importable (pip install torch)")
        return None
    if reason := torch_model.unsupported(program.config):
        log(f"no PyTorch comparison: {reason}")
        return None
    params = program.init(program.config.seed)["params"]
    trainer = torch_model.TorchTrainer(
        program.config, nnx.to_pure_dict(params),
        nnx.to_pure_dict(decay_mask(program.config.optimizer, params)))
    return functools.partial(trainer.step, np.asarray(tokens, np.int64))


def decode_runner(program, prompt_BxP: jax.Array, length: int) -> Callable[[], None]:
    """One synced single-token KV-cache decode per call (jitted, cache donated), in evaluation
    mode as in `train.generate`: the prompt is prefilled once into a cache of `length`
    positions, then each call decodes the greedy next token at the next position, wrapping
    back to the first position after the prompt when the cache is full (the cost of a decode
    step does not depend on its position: attention reads the whole masked cache). The
    callable's `cache_bytes` and `cache_positions` are the cache's size in bytes and in
    positions held (min(length, W) with a sliding window W); its `hlo()` the compiled decode
    program's text."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from arch.attention import cache_slots

    graphdef, dtype = program.graphdef, jnp.dtype(program.model_cfg.dtype)
    batch, prompt_len = prompt_BxP.shape
    state = program.init(program.config.seed)

    def merged(params, model_state):
        model = nnx.merge(graphdef, params, model_state)
        model.eval()
        return model

    @jax.jit
    def prefill(params, model_state, prompt_BxP):
        model = merged(params, model_state)
        cache = model.init_cache(batch, length, dtype)
        positions_BxP = jnp.broadcast_to(jnp.arange(prompt_len), prompt_BxP.shape)
        logits_BxPxV, cache = model.decode(prompt_BxP, positions_BxP, cache)
        return jnp.argmax(logits_BxPxV[:, -1:], axis=-1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnums=2)
    def decode(params, model_state, cache, token_Bx1, position):
        logits_Bx1xV, cache = merged(params, model_state).decode(
            token_Bx1, jnp.full(token_Bx1.shape, position, jnp.int32), cache)
        return jnp.argmax(logits_Bx1xV, axis=-1).astype(jnp.int32), cache

    with jax.set_mesh(program.mesh):
        token, cache = prefill(state["params"], state["model_state"], prompt_BxP)
    carry = {"token": token, "cache": cache, "count": 0}
    cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(cache))

    def step() -> None:
        position = jnp.int32(prompt_len + carry["count"] % (length - prompt_len))
        with jax.set_mesh(program.mesh):
            carry["token"], carry["cache"] = decode(state["params"], state["model_state"],
                                                    carry["cache"], carry["token"], position)
        carry["count"] += 1
        jax.block_until_ready(carry["token"])
    def hlo() -> str:  # the compiled decode program's text, for --profile's op names
        with jax.set_mesh(program.mesh):
            return decode.lower(state["params"], state["model_state"], carry["cache"],
                                carry["token"], jnp.int32(0)).compile().as_text()

    step.cache_bytes = cache_bytes
    step.cache_positions = cache_slots(program.model_cfg, length)
    step.hlo = hlo
    return step


def with_overrides(config, overrides: str, flag: str = "--baseline"):
    """A copy of `config` with `FIELD=VALUE[,FIELD=VALUE...]` applied (dotted field paths, each
    VALUE read as its field's type, as `--config.FIELD=VALUE` is: `config.cli.apply_override`)."""
    config = config.copy_and_resolve_references()
    for item in filter(None, overrides.split(",")):
        path, sep, text = item.partition("=")
        if not sep:
            raise UsageError(f"{flag}: expected FIELD=VALUE, got {item!r}")
        apply_override(config, path.strip(), text.strip(), flag)
    return config


def parse_label(overrides: str) -> str:
    """A --compare variant's label: its overrides with each field's leading "model." dropped."""
    return ",".join(item.strip().removeprefix("model.")
                    for item in overrides.split(",") if item.strip())


def parse_compare(text: str | None) -> dict[str, str]:
    """--compare's variants: label → overrides, one per `;`-separated item. The label is the
    overrides with each field's leading "model." dropped."""
    variants = {}
    for overrides in filter(None, (item.strip() for item in (text or "").split(";"))):
        label = parse_label(overrides)
        if label in variants:
            raise UsageError(f"--compare: variant {label!r} is given twice")
        variants[label] = overrides
    return variants


def prepare(config, tokens: np.ndarray) -> dict:
    """A variant ready to time: its program (of `config`, resolved for the devices here),
    compiled memory and a train-step runner on `tokens` placed with its batch sharding."""
    from sharding.pipeline import iterations, stage_transfer_bytes
    from train.step import build_program, compile_train_step, resolve_for_job

    program = build_program(resolve_for_job(config))
    compile_time, compiled = compile_train_step(program)
    runner = framework_runner(program, program.put_batch(tokens))
    runner.hlo = compiled.as_text  # for --profile
    variant = {"program": program, "memory": compiled.memory_analysis(),
               "compile_time": compile_time,
               "runner": runner}
    if (stages := program.mesh.shape["stage"]) > 1:  # per device: V·M + P − 1 iterations
        per_step = iterations(stages, config.execution.pipeline.virtual_stages,
                              config.execution.pipeline.microbatches)
        variant["stage_transfer_bytes"] = stage_transfer_bytes(compiled.as_text()) * per_step
    return variant


def depth_memory(config, depths: tuple[int, int]) -> dict[str, float]:
    """Compiled temp bytes of the train step at each of two depths (compile only), and the
    ratio of the second to the first."""
    from train.step import build_program, compile_train_step, resolve_for_job

    temp = {}
    for layers in depths:
        deep = unresolved(config)
        deep.model.num_layers = layers
        _, compiled = compile_train_step(build_program(resolve_for_job(deep)))
        temp[layers] = compiled.memory_analysis().temp_size_in_bytes
        log(f"temp bytes at {layers} layers: {temp[layers]:,}")
    a, b = depths
    return {f"temp_bytes_layers_{a}": temp[a], f"temp_bytes_layers_{b}": temp[b],
            "temp_bytes_depth_ratio": temp[b] / temp[a]}


def depth_compile_ratio(config, repeats: int = 2) -> dict[str, float]:
    """Cold compile seconds of the train step at 4 and 24 layers (best of `repeats`, each a
    fresh program, alternating depths), and their ratio."""
    from train.step import build_program, compile_train_step, resolve_for_job

    seconds: dict[int, float] = {4: math.inf, 24: math.inf}
    for _ in range(repeats):
        for layers in seconds:
            deep = unresolved(config)
            deep.model.num_layers = layers
            took, _ = compile_train_step(build_program(resolve_for_job(deep)))
            seconds[layers] = min(seconds[layers], took)
            log(f"compile at {layers} layers: {took:.2f} s")
    return {"compile_4_layers_s": seconds[4], "compile_24_layers_s": seconds[24],
            "compile_24_over_4": seconds[24] / seconds[4]}


def bench(config, steps: int, block: int, depth_check: bool, baseline: str | None = None,
          depths: tuple[int, int] | None = None, compare: str | None = None,
          decode: bool = False, decode_batch: int = 1, decode_steps: int = 400,
          data_batches: int = 0, vs_torch: bool = False, vs_unrolled: bool = False,
          profile_steps: int = 0) -> dict:
    import jax
    import jax.numpy as jnp

    from arch import reference
    from arch.accounting import flops_per_token
    from sharding.pipeline import bubble_fraction
    from train.data.shards import loader_throughput
    from train.metrics import measure_matmul_peak

    check_vocab(config.model, tokenizer_of(config.data))  # model.vocab_size=0: the tokenizer's
    pristine = config.copy_and_resolve_references()  # before derived fields are filled in
    others = {label: with_overrides(pristine, overrides, "--compare")
              for label, overrides in parse_compare(compare).items()}
    if baseline:
        others = {"baseline": with_overrides(pristine, baseline), **others}
    tokens = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (config.batch_size, config.seq_len + 1), dtype=np.int32)
    log(f"{jax.device_count()} device(s): {jax.devices()[0].device_kind}; compiling...")
    main = prepare(config, tokens)  # validates and resolves config.model in place
    program, memory, compile_time = main["program"], main["memory"], main["compile_time"]
    variants = {"framework": main}
    for label, variant_config in others.items():
        log(f"compiling {label}...")
        variants[label] = prepare(variant_config, tokens)
    runners = {label: variant["runner"] for label, variant in variants.items()}
    if reason := reference.unsupported(config.model):
        log(f"no reference comparison: {reason}")
    else:
        runners["reference"] = reference_runner(program, program.put_batch(tokens))
        if vs_unrolled:
            runners["unrolled"] = reference_runner(program, program.put_batch(tokens), True)
    if vs_torch and (run_torch := torch_runner(program, tokens)):
        runners["torch"] = run_torch
    log(f"timing {steps} steps each of {', '.join(runners)}, in blocks of {block}...")
    times = time_interleaved(runners, steps, block)
    medians = {label: statistics.median(seconds) for label, seconds in times.items()}
    decode_samples, decode_block, decoders = {}, 1, {}
    if decode:
        prompt = tokens[:decode_batch, :config.seq_len // 2]
        decode_block = max(1, min(DECODE_BLOCK, decode_steps // 2))
        log(f"timing {decode_steps} one-token decode steps each of {', '.join(variants)}, in "
            f"blocks of {decode_block}...")
        decoders = {label: decode_runner(variant["program"], jnp.asarray(prompt), config.seq_len)
                    for label, variant in variants.items()}
        decode_samples = time_interleaved(decoders, decode_steps, decode_block)
    decode_times = {label: statistics.median(seconds) for label, seconds in decode_samples.items()}
    ratio = functools.partial(paired_ratio, times, block=block)
    decode_ratio = functools.partial(paired_ratio, decode_samples, block=decode_block)
    step_time = medians["framework"]
    reference_time = medians.get("reference")
    peak = measure_matmul_peak()
    tokens_per_sec = config.batch_size * config.seq_len / step_time
    flops = flops_per_token(program.config.model, config.seq_len)  # resolved: head_dim filled
    result = {
        "tokens_per_sec": tokens_per_sec, "step_time_s": step_time,
        "compile_time_s": compile_time,
        "mfu": tokens_per_sec * flops / (peak * jax.device_count()), "peak_flops": peak,
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "output_bytes": getattr(memory, "output_size_in_bytes", None),
        "reference_step_time_s": reference_time,
        "vs_reference": ratio("framework", "reference") if reference_time else None,
        "flops_per_token": flops, "devices": jax.device_count(), "steps": steps,
    }
    if vs_torch:
        result.update(torch_step_time_s=medians.get("torch"),
                      vs_torch=ratio("framework", "torch") if "torch" in times else None)
    if vs_unrolled:
        result.update(unrolled_step_time_s=medians.get("unrolled"),
                      vs_unrolled=ratio("framework", "unrolled") if "unrolled" in times else None)
    if decode:
        result.update(decode_time_s=decode_times["framework"],
                      decode_cache_bytes=decoders["framework"].cache_bytes,
                      decode_cache_positions=decoders["framework"].cache_positions)
    if (stages := program.mesh.shape["stage"]) > 1:
        schedule = config.execution.pipeline
        result["bubble_fraction"] = bubble_fraction(stages, schedule.virtual_stages,
                                                    schedule.microbatches)
        result["stage_transfer_bytes"] = main["stage_transfer_bytes"]
    temp = {label: variant["memory"].temp_size_in_bytes for label, variant in variants.items()}
    if baseline:
        result.update(
            baseline_step_time_s=medians["baseline"],
            step_time_vs_baseline=ratio("framework", "baseline"),
            baseline_temp_bytes=temp["baseline"],
            temp_bytes_vs_baseline=temp["framework"] / max(temp["baseline"], 1))
        if decode:
            result.update(baseline_decode_time_s=decode_times["baseline"],
                          decode_time_vs_baseline=decode_ratio("framework", "baseline"),
                          baseline_decode_cache_bytes=decoders["baseline"].cache_bytes)
    if compare:
        result["compare"] = {}
        for label in parse_compare(compare):
            entry = {"step_time_s": medians[label],
                     "step_time_vs_config": ratio(label, "framework"), "temp_bytes": temp[label],
                     "temp_bytes_vs_config": temp[label] / max(temp["framework"], 1)}
            if (sent := variants[label].get("stage_transfer_bytes")) is not None:
                entry.update(stage_transfer_bytes=sent, stage_transfer_bytes_vs_config=sent
                             / main.get("stage_transfer_bytes", math.nan))
            if decode:
                entry.update(decode_time_s=decode_times[label],
                             decode_time_vs_config=decode_ratio(label, "framework"),
                             decode_cache_bytes=decoders[label].cache_bytes,
                             decode_cache_positions=decoders[label].cache_positions)
            result["compare"][label] = entry
    if profile_steps:
        log(f"profiling {profile_steps} steps each of "
            f"{', '.join(label for label, run in runners.items() if hasattr(run, 'hlo'))}...")
        result["profile"] = {label: profiled(run, profile_steps)
                             for label, run in runners.items() if hasattr(run, "hlo")}
        if "torch" in runners:
            log(f"profiling {profile_steps} steps of torch...")
            result["profile"]["torch"] = torch_profiled(runners["torch"], profile_steps)
    if data_batches:
        log(f"reading {data_batches} batches of the training data...")
        with contextlib.redirect_stdout(sys.stderr):  # tfds reports preparing on stdout
            result.update(loader_throughput(config.data, config.batch_size, config.seq_len,
                                            data_batches, config.seed))
        result["loader_vs_step"] = result["loader_tokens_per_sec"] / tokens_per_sec
    if depths is not None:
        result.update(depth_memory(pristine, depths))
    if depth_check:
        result.update(depth_compile_ratio(config))
    return result


def profiled(run: Callable[[], None], steps: int, top: int = 12) -> dict:
    """--profile's entry for one runner: its op seconds per step, the largest primitives and
    the costliest instructions."""
    from train.instruments import op_profile

    rows = op_profile.table(op_profile.profile(run, steps), op_profile.describe(run.hlo()))
    return {"op_s": sum(row["seconds"] for row in rows),
            "by_primitive": dict(list(op_profile.by_primitive(rows).items())[:top]),
            "ops": rows[:top]}


def torch_profiled(run: Callable[[], None], steps: int, top: int = 12) -> dict:
    """--profile's entry for PyTorch's step (with --vs_torch), in `profiled`'s form: the seconds
    per step of its operators' own CPU time (`torch.profiler`, self time, so nothing counts
    twice), the largest by operator name (aten::mm, ...); no instruction rows."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as trace:
        for _ in range(steps):
            run()
    seconds = sorted(((event.key, event.self_cpu_time_total / 1e6 / steps)
                      for event in trace.key_averages()), key=lambda item: -item[1])
    return {"op_s": sum(second for _, second in seconds), "by_primitive": dict(seconds[:top]),
            "ops": []}


REMAT_VARIANT = "execution.remat={}"  # one --remat_policies variant


def remat_policies(text: str | None) -> list[str]:
    """--remat_policies' names, in order, each once (validated with the config)."""
    policies = [name.strip() for name in (text or "").split(",") if name.strip()]
    if len(set(policies)) != len(policies):
        raise UsageError(f"--remat_policies: a policy is given twice in {text!r}")
    return policies


def depth_pair(text: str | None) -> tuple[int, int] | None:
    """--depth_memory's two layer counts A,B (None: not asked for)."""
    if text is None:
        return None
    try:
        a, b = (int(n) for n in text.split(","))
    except ValueError:
        a = b = 0
    if min(a, b) < 1:
        raise UsageError(f"--depth_memory: expected A,B (two positive layer counts), got "
                         f"{text!r}")
    return a, b


def check_variants(config, baseline: str | None, compare: str | None) -> None:
    """The config and each variant of --baseline and --compare, resolved without JAX
    (`train.data.arguments.check_config`; `config.model.vocab_size` 0 filled in place): a
    one-line ConfigError names the first that is invalid."""
    check_config(config)
    pristine = config.copy_and_resolve_references()
    variants = {"--compare": parse_compare(compare)}
    if baseline:
        variants["--baseline"] = {"baseline": baseline}
    for flag, overrides in variants.items():
        for label, fields in overrides.items():
            try:
                check_config(with_overrides(pristine, fields, flag))
            except UsageError:
                raise
            except ConfigError as error:
                raise ConfigError(f"{flag} {label}: {error}") from None


def remat_policy_ratios(result: dict, policies: list[str]) -> dict[str, dict[str, float]]:
    """policy → temp bytes and step time, each also as a ratio to the first policy (the
    benchmarked config; the others are its --compare variants, timed interleaved with it)."""
    first = {"temp_bytes": result["temp_bytes"], "step_time_s": result["step_time_s"],
             "temp_bytes_vs_first": 1.0, "step_time_vs_first": 1.0}
    ratios = {policies[0]: first}
    for policy in policies[1:]:
        entry = result["compare"][parse_label(REMAT_VARIANT.format(policy))]
        ratios[policy] = {"temp_bytes": entry["temp_bytes"], "step_time_s": entry["step_time_s"],
                          "temp_bytes_vs_first": entry["temp_bytes_vs_config"],
                          "step_time_vs_first": entry["step_time_vs_config"]}
    return ratios


def table(result: dict) -> str:
    rows = [f"{'metric':<24}{'value':>16}  target"]
    for name, value in result.items():
        if name in ("compare", "remat_policies", "profile"):
            continue
        text = (f"{value:,}" if isinstance(value, int) else "n/a" if value is None
                else f"{value:.3%}" if name == "mfu" else f"{value:.4g}")
        rows.append(f"{name:<24}{text:>16}  {TARGETS.get(name, '')}".rstrip())
    for label, entry in result.get("compare", {}).items():  # the targets are Block AttnRes's
        targeted = "residual=block_attnres" in label
        rows.append(f"vs {label}:")
        rows.extend(f"  {name:<22}{value:>16.4g}  {TARGETS.get(name, '') * targeted}".rstrip()
                    for name, value in entry.items())
    for policy, entry in result.get("remat_policies", {}).items():
        rows.append(f"remat_policy={policy}:")
        rows.extend(f"  {name:<22}{value:>16.4g}" for name, value in entry.items())
    for label, entry in result.get("profile", {}).items():
        rows.append(f"profile of {label}: {entry['op_s'] * 1e3:.1f} ms of ops per step")
        rows.extend(f"  {name:<22}{seconds * 1e3:>13.1f} ms" for name, seconds
                    in entry["by_primitive"].items())
        rows.extend(f"  {op['op'][:40]:<40} {op['seconds'] * 1e3:>8.1f} ms  {op['primitive']:<20}"
                    f" {op['source']}".rstrip() for op in entry["ops"])
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/bench.py", __doc__)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout instead of a table")
    add_timing_arguments(parser, steps=20, block=5,
                         steps_help="timed steps, each of framework and reference",
                         block_help="steps per interleaved block")
    parser.add_argument("--depth_check", action="store_true",
                        help="also measure compile_24_over_4")
    parser.add_argument("--baseline", metavar="FIELD=VALUE[,...]", default=None,
                        help="overrides giving a baseline config to time against, e.g. "
                             "model.reversible=False")
    parser.add_argument("--depth_memory", metavar="A,B", default=None,
                        help="compiled temp bytes of the train step at num_layers A and B")
    parser.add_argument("--compare", metavar="FIELD=VALUE[,...][;...]", default=None,
                        help="variants of the config, each timed interleaved with it and "
                             "reported as ratios to it")
    parser.add_argument("--decode", action="store_true",
                        help="also time one-token KV-cache decoding")
    parser.add_argument("--decode_batch", type=positive_int, default=1,
                        help="sequences decoded at once (--decode)")
    parser.add_argument("--decode_steps", type=positive_int, default=400,
                        help="timed decode steps per variant")
    parser.add_argument("--data", action="store_true",
                        help="also measure the data loader's tokens/s")
    parser.add_argument("--data_batches", type=positive_int, default=200,
                        help="batches read for --data")
    parser.add_argument("--vs_torch", action="store_true",
                        help="also time an eager PyTorch train step of the same model")
    parser.add_argument("--vs_unrolled", action="store_true",
                        help="also time the reference step with its layers unrolled")
    parser.add_argument("--profile", type=positive_int, default=0, metavar="N",
                        help="profile N more steps of each JAX program, per XLA op (and of "
                        "PyTorch's with --vs_torch, per operator)")
    parser.add_argument("--remat_policies", metavar="A,B,...", default=None,
                        help="execution.remat values to compare, as ratios to the first")
    config, args = parse_with_config(parser, argv)
    try:
        depths = depth_pair(args.depth_memory)
        compare, policies = args.compare, remat_policies(args.remat_policies)
        if policies:
            config.execution.remat = policies[0]
            compare = ";".join(filter(None, [compare, *(REMAT_VARIANT.format(policy)
                                                       for policy in policies[1:])]))
        check_variants(config, args.baseline, compare)
    except ConfigError as error:
        log(f"error: {error}")
        return 2
    absl_logging.set_verbosity(absl_logging.WARNING)  # Orbax and absl log at INFO
    try:
        result = bench(config, args.steps, args.block, args.depth_check, args.baseline, depths,
                       compare, args.decode, args.decode_batch, args.decode_steps,
                       args.data_batches if args.data else 0, args.vs_torch, args.vs_unrolled,
                       args.profile)
    except ConfigError as error:
        log(f"error: {error}")
        return 2
    if policies:
        result["remat_policies"] = remat_policy_ratios(result, policies)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
