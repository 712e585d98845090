"""The accelerator check: `scripts/accelerator_check.sh` runs this and it
prints ONE JSON line on stdout (progress on stderr). Meant for a GPU or TPU host, under 10
minutes; on CPU it runs the portable parts, the study and profile parts at tiny shapes (their
plumbing, not their figures), and names every skipped part with its reason.

Parts (each a key of the JSON object, with `part_s`, its wall seconds; a skipped part is
{"skipped": reason}, a failed one {"error": message}, and one failing part does not stop the
others), run in this order unless --parts names others, the most wanted accelerator figures
first:

  attention      max |difference| of values and gradients against the explicit `xla` path, per
                 implementation: `blocked` everywhere, `cudnn` on NVIDIA GPUs (bf16), `splash`
                 on TPUs (arch/kernels/attention_implementations.py), relative to the largest
                 |value| of each output. `ok` within 1e-5 in f32 (splash 2e-3), both paths'
                 products at full f32 precision (GPUs otherwise multiply f32 in TF32, 10-bit
                 mantissas); 1.6e-2 in bf16 (two units in the last place of the largest value).
  attnres        Block AttnRes (8 blocks of 4 sublayers, 32 sublayers) against Pre-Norm, bf16,
                 d 1024, seq 2048, batch 8: `scripts/bench.py`'s paired train-step and one-token
                 decode ratios. Target: ≤ 1.02 each.
  study_mode     the AttnRes ablation's baseline, block and full arms (experiments/
                 attnres_ablation.py, cpu scale: the bundled corpus, nothing downloaded), 4 seeds
                 × 800 steps each, as a study runs them: one `python -m train.seeds` process per
                 arm, one after the other, with JAX's persistent compilation cache on (every
                 program cached). Per arm its wall seconds (start-up and compiles included), exit
                 status and each seed's final eval_loss (its metrics.jsonl); the total against
                 the target, 180 s. Preparing the corpus, once per machine, is timed apart;
                 the arms get 300 s together (an arm still running then is stopped and the
                 rest not run). On CPU: the baseline arm, 2 seeds × 4 steps of a d 32, 2-layer
                 model, compiled
                 with XLA:CPU's cheapest code generation. Skipped on TPUs, whose chips this
                 process holds.
  profile        (only with --profile or when --parts names it) jax.profiler per-op tables
                 (train/instruments/op_profile.py) of the Pre-Norm and the Block AttnRes train
                 step and one-token decode at the attnres part's shape (on CPU: d 64, 2 blocks
                 of 4 sublayers, seq 128, batch 2, float32): each program's op seconds per step
                 beside its wall seconds per step (a sum over threads or streams can exceed
                 it). DIR/profile.md: per program its costliest 25 instructions (time per step,
                 opcode, JAX primitive, source line) and its time by primitive and by opcode;
                 DIR/profile.json: every row.
  mfu            a ~1B-parameter bf16 model (d 2048, 20 layers, 16 heads of 128) at seq 4096
                 with `auto` attention: the largest batch in 16, 8, 4, 2, 1 whose compiled
                 memory fits in 90% of the device, its train-step time and MFU against the
                 device's published dense bf16 peak (`PEAK_BF16`). Target on H100/H200: ≥ 50%.
  memory_8k      the ~1B model at seq 8192, batch 1: compiled temp + argument bytes of the
                 train step with `auto`, `blocked` and `xla` attention (compile only).

Files: with --out DIR, DIR/check.json holds the JSON object as it stands, rewritten before
each part (the part marked {"running": true}) and after it, so a run cut short keeps the parts
it finished; DIR/check.log holds the progress lines; DIR/profile.md and DIR/profile.json the
profile part's tables. The study's run directories and the compilation cache go to --scratch
(default: a temporary directory, removed at the end), so DIR holds these four files only; a
--scratch kept from an earlier run keeps its compilation cache (the runs start afresh).

Usage: scripts/accelerator_check.sh [--out DIR] [--profile] [--parts NAME,...] [--scratch DIR]
       [--quick]   (--quick: the attention part only; --parts: these parts, in this order)
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from config.cli import ArgumentParser

ROOT = Path(__file__).resolve().parents[1]
# Every part, in the order a run takes them: the most wanted accelerator figures first.
PARTS = ("attention", "attnres", "study_mode", "profile", "mfu", "memory_8k")
OPTIONAL = ("profile",)  # run only when asked for (--profile, --parts)
# Published dense bf16 peak FLOP/s per device, by `device_kind` prefix (vendor datasheets).
PEAK_BF16 = {"NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12,
             "TPU v6": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12,
             "TPU v4": 275e12}
BLOCK_ATTNRES = "model.residual.name=block_attnres,model.attnres.block_size=4"
STUDY = "experiments/attnres_ablation.py"
STUDY_ARMS = ("baseline", "block", "full")
STUDY_ARMS_CPU = ("baseline",)  # on CPU the plumbing only: one arm shows it
STUDY_TARGET_S = 180.0
STUDY_BUDGET_S = 300  # the arms together; one still running then ends the part (not timed)
# On CPU: the plumbing only (the cpu scale's 800 steps take tens of minutes per arm here).
STUDY_CPU = ("--config.steps=4", "--config.eval_every=4", "--config.optimizer.warmup_steps=1",
             "--config.model.d_model=32", "--config.model.num_layers=2",
             "--config.model.attention.num_heads=2", "--config.model.attention.num_kv_heads=2",
             "--config.batch_size=4", "--config.seq_len=32", "--config.eval_batches=1")
# ...compiled with XLA:CPU's cheapest code generation (as the tests compile): about 3x faster.
STUDY_CPU_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
PROFILE_TOP = 25  # instructions per program in profile.md
_log_file = None  # DIR/check.log with --out


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    if _log_file is not None:
        print(message, file=_log_file, flush=True)


def _max_diff(got, want) -> tuple[float, float]:
    """Max |got − want| over the outputs, absolute and relative to each output's max |want|."""
    import jax.numpy as jnp

    absolute = [float(jnp.max(jnp.abs(jnp.float32(a) - jnp.float32(b))))
                for a, b in zip(got, want, strict=True)]
    scale = [float(jnp.max(jnp.abs(jnp.float32(b)))) for b in want]
    return max(absolute), max(a / s for a, s in zip(absolute, scale, strict=True))


def attention_part(backend: str) -> dict:
    import jax
    import jax.numpy as jnp

    from arch.attention import dot_product_attention
    from arch.kernels.attention_implementations import (
        allowed_mask,
        blocked_attention,
        cudnn_attention,
        splash_attention,
    )

    def explicit(q, k, v, positions):
        mask = jnp.where(allowed_mask(positions, positions), 0.0, -jnp.inf)
        return dot_product_attention(q, k, v, mask)

    def compare(fn, dtype, tolerance, b=2, t=512, h=8, k=2, p=128):
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (b, t, h, p), dtype)
        key = jax.random.normal(keys[1], (b, t, k, p), dtype)
        value = jax.random.normal(keys[2], (b, t, k, p), dtype)
        cotangent = jax.random.normal(keys[3], (b, t, h, p), dtype)
        positions = jnp.broadcast_to(jnp.arange(t), (b, t))

        def value_and_grads(f):
            out, pullback = jax.vjp(lambda *a: f(*a, positions), q, key, value)
            return (out, *pullback(cotangent))

        precision = "highest" if dtype == jnp.float32 else None
        with jax.default_matmul_precision(precision):
            got = jax.jit(lambda: value_and_grads(fn))()
            want = jax.jit(lambda: value_and_grads(explicit))()
        absolute, relative = _max_diff(got, want)
        return {"max_abs_diff": absolute, "max_rel_diff": relative, "tolerance": tolerance,
                "ok": relative <= tolerance}

    small = dict(b=1, t=256, h=4, k=2, p=32) if backend == "cpu" else {}  # CI: seconds
    result = {"blocked": compare(lambda q, k, v, pos: blocked_attention(q, k, v, pos, pos),
                                 jnp.float32, 1e-5, **small)}
    if backend == "gpu":
        result["cudnn"] = compare(
            lambda q, k, v, pos: cudnn_attention(q, k, v, pos, pos, in_order=True),
            jnp.bfloat16, 1.6e-2)
    else:
        result["cudnn"] = {"skipped": f"needs an NVIDIA GPU (backend {backend})"}
    if backend == "tpu":
        result["splash"] = compare(lambda q, k, v, pos: splash_attention(q, k, v),
                                   jnp.float32, 2e-3)
    else:
        result["splash"] = {"skipped": f"needs a TPU (backend {backend}); its values are "
                                       "checked in the Pallas interpreter by the tests"}
    return result


def _billion_config(seq_len: int, batch: int, implementation: str = "auto"):
    from config.defaults import base_config

    config = base_config()
    config.seq_len, config.batch_size = seq_len, batch
    config.mesh.data = 1
    model = config.model
    model.d_model, model.num_layers = 2048, 20
    model.attention.num_heads, model.attention.num_kv_heads = 16, 16
    model.dtype, config.execution.attention_implementation = "bfloat16", implementation
    return config


def _compiled(config):
    from train.step import build_program, compile_train_step, resolve_for_job

    program = build_program(resolve_for_job(config))
    _, compiled = compile_train_step(program)
    return program, compiled


def _fits(compiled, limit: float) -> tuple[bool, int]:
    memory = compiled.memory_analysis()
    used = memory.temp_size_in_bytes + memory.argument_size_in_bytes
    return used <= limit, used


def mfu_part(backend: str) -> dict:
    import jax

    from arch.accounting import flops_per_token, parameter_count

    kind = jax.devices()[0].device_kind
    peak = next((value for prefix, value in PEAK_BF16.items() if kind.startswith(prefix)), None)
    if backend == "cpu":
        return {"skipped": "CPU: MFU against a published accelerator peak is meaningless; "
                           "scripts/bench.py reports MFU against a measured matmul peak"}
    limit = 0.9 * (jax.devices()[0].memory_stats() or {}).get("bytes_limit", float("inf"))
    for batch in (16, 8, 4, 2, 1):
        config = _billion_config(4096, batch)
        program, compiled = _compiled(config)
        fits, used = _fits(compiled, limit)
        log(f"mfu: batch {batch} needs {used / 2**30:.1f} GiB ({'fits' if fits else 'too big'})")
        if fits:
            break
    else:
        return {"skipped": "the ~1B model does not fit at batch 1", "device_kind": kind}
    tokens = np.random.default_rng(0).integers(0, 256, (batch, 4097), dtype=np.int32)
    state, batch_array = program.init(0), program.put_batch(tokens)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        state, metrics = program.train_step(state, batch_array)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    step = float(np.median(times[2:]))
    tokens_per_sec = batch * 4096 / step
    flops = flops_per_token(config.model, 4096)
    return {"device_kind": kind, "parameters": parameter_count(config.model), "batch": batch,
            "step_time_s": step, "tokens_per_sec": tokens_per_sec, "peak_flops": peak,
            "mfu": tokens_per_sec * flops / peak if peak else None, "target": ">= 0.5"}


def _attnres_config(backend: str):
    """Pre-Norm at the attnres part's shape (on CPU a tiny one); Block AttnRes is it with
    `BLOCK_ATTNRES`."""
    from config.defaults import base_config

    config = base_config()
    config.mesh.data = 1
    model = config.model
    model.residual.name = "prenorm"
    if backend == "cpu":  # seconds: 2 blocks of 4 sublayers
        config.seq_len, config.batch_size = 128, 2
        model.d_model, model.num_layers = 64, 4
        model.attention.num_heads, model.attention.num_kv_heads = 2, 2
    else:
        config.seq_len, config.batch_size = 2048, 8
        model.d_model, model.num_layers = 1024, 16
        model.attention.num_heads, model.attention.num_kv_heads = 8, 8
        model.dtype = "bfloat16"
    return config


def attnres_part(backend: str) -> dict:
    if backend == "cpu":
        return {"skipped": "CPU: the CPU figures come from scripts/bench.py's C-attnres command "
                           "(docs/performance.md#block-attnres)"}
    from bench import bench

    result = bench(_attnres_config(backend), steps=10, block=2, depth_check=False,
                   compare=BLOCK_ATTNRES, decode=True, decode_steps=200)
    entry = next(iter(result["compare"].values()))
    return {"step_time_vs_prenorm": entry["step_time_vs_config"],
            "decode_time_vs_prenorm": entry["decode_time_vs_config"],
            "prenorm_step_time_s": result["step_time_s"], "target": "<= 1.02 each"}


def _final_eval_losses(workdir: Path) -> dict[str, float]:
    """seed<k> → the last eval_loss in that seed's metrics.jsonl (NaN where there is none)."""
    losses = {}
    for metrics in sorted(workdir.glob("seed*/metrics.jsonl")):
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        evals = [record["eval_loss"] for record in records if "eval_loss" in record]
        losses[metrics.parent.name] = float(evals[-1]) if evals else math.nan
    return losses


def study_mode_part(backend: str, scratch: Path) -> dict:
    if backend == "tpu":
        return {"skipped": "TPU: this process holds the chips, so no `python -m train.seeds` "
                           "process can use them; time the arms by hand (docs/studies.md)"}
    from experiments.attnres_ablation import get_config
    from train.loop import load_splits

    start = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # tfds reports preparing on stdout
        load_splits(get_config("baseline").data)  # the bundled corpus, prepared once
    prepare_s = time.perf_counter() - start
    log(f"study_mode: corpus ready in {prepare_s:.1f} s")
    cpu = backend == "cpu"
    seeds = "0,1" if cpu else "0,1,2,3"
    cache = scratch / "compilation_cache"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
               # this process holds its preallocated share of the device: grow on demand
               XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if cpu:
        flags = env.get("XLA_FLAGS", "").split()
        named = {flag.split("=")[0] for flag in flags}  # a flag already set is kept as it is
        env["XLA_FLAGS"] = " ".join(flags + [flag for flag in STUDY_CPU_XLA_FLAGS
                                             if flag.split("=")[0] not in named])
    arms, deadline = {}, time.perf_counter() + STUDY_BUDGET_S
    study_arms = STUDY_ARMS_CPU if cpu else STUDY_ARMS
    for arm in study_arms:
        workdir = scratch / "study_mode" / arm
        shutil.rmtree(workdir, ignore_errors=True)  # an earlier run's, with --scratch
        command = [sys.executable, "-m", "train.seeds", "--config", f"{STUDY}:{arm}",
                   "--workdir", str(workdir), "--seeds", seeds, *(STUDY_CPU if cpu else ())]
        log(f"study_mode: {arm}: {' '.join(command[1:])}")
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=max(1.0, deadline - start))
        except subprocess.TimeoutExpired:
            arms[arm] = {"error": f"stopped after {time.perf_counter() - start:.0f} s: the arms "
                                  f"had {STUDY_BUDGET_S} s together"}
            log(f"study_mode: {arm} stopped at the part's budget; the remaining arms are not run")
            break
        seconds = time.perf_counter() - start
        arms[arm] = {"seconds": seconds, "returncode": done.returncode,
                     "eval_loss": _final_eval_losses(workdir)}
        if done.returncode:
            arms[arm]["stderr_tail"] = done.stderr[-1500:]
            log(done.stderr[-3000:])
        log(f"study_mode: {arm}: {seconds:.1f} s, exit {done.returncode}, final eval_loss "
            f"{arms[arm]['eval_loss']}")
    total = sum(entry.get("seconds", math.nan) for entry in arms.values())
    finished = len(arms) == len(study_arms) and all(
        entry.get("returncode") == 0 for entry in arms.values())
    return {"arms": arms, "seeds": len(seeds.split(",")),
            "steps": 4 if cpu else get_config("baseline").steps,
            "total_s": total, "target_s": STUDY_TARGET_S,
            # on CPU the figures are the plumbing's, not the target's
            "within_target": None if cpu else bool(finished and total <= STUDY_TARGET_S),
            "corpus_prepare_s": prepare_s,
            "cache_entries": len(list(cache.iterdir())) if cache.is_dir() else 0,
            "scale": "cpu: the plumbing only (the baseline arm, 2 seeds x 4 steps, d 32, 2 "
                     "layers, XLA optimization level 0)" if cpu else
                     "experiments/attnres_ablation.py cpu scale (d 128, 8 layers, batch 32 x 128)"}


def _profile_rows(run, steps: int) -> dict:
    """One program's per-op rows (op_profile.table) over `steps` steps after two warm-up
    steps, with its wall seconds per step (timed apart from the profiled steps)."""
    from train.instruments import op_profile

    run()
    run()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    wall = (time.perf_counter() - start) / steps
    rows = op_profile.table(op_profile.profile(run, steps), op_profile.describe(run.hlo()))
    return {"wall_s": wall, "op_s": sum(row["seconds"] for row in rows), "steps": steps,
            "rows": rows}


def _by_opcode(rows: list[dict]) -> dict[str, float]:
    """Seconds per step per opcode, most costly first."""
    sums: dict[str, float] = {}
    for row in rows:
        sums[row["opcode"]] = sums.get(row["opcode"], 0.0) + row["seconds"]
    return dict(sorted(sums.items(), key=lambda item: -item[1]))


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|") or " "


def profile_markdown(header: str, programs: dict[str, dict]) -> str:
    """profile.md: a summary row per program, then per program its costliest `PROFILE_TOP`
    instructions and its time by JAX primitive and by opcode (times in ms per step)."""
    from train.instruments import op_profile

    lines = ["# Per-op profiles (scripts/accelerator_check.py --profile)", "", header, "",
             "| program | ms of ops per step | wall ms per step | instructions |",
             "|---|---:|---:|---:|"]
    lines += [f"| {name} | {entry['op_s'] * 1e3:.3f} | {entry['wall_s'] * 1e3:.3f} | "
              f"{len(entry['rows'])} |" for name, entry in programs.items()]
    for name, entry in programs.items():
        total = entry["op_s"] or math.inf
        lines += ["", f"## {name}", "",
                  f"Costliest {PROFILE_TOP} of {len(entry['rows'])} instructions, "
                  f"{entry['steps']} steps profiled:", "",
                  "| # | instruction | ms per step | % | opcode | primitive | source |",
                  "|---:|---|---:|---:|---|---|---|"]
        lines += [f"| {i} | {_cell(row['op'])} | {row['seconds'] * 1e3:.4f} | "
                  f"{row['seconds'] / total:.1%} | {_cell(row['opcode'])} | "
                  f"{_cell(row['primitive'])} | {_cell(row['source'])} |"
                  for i, row in enumerate(entry["rows"][:PROFILE_TOP], 1)]
        for title, sums in (
                ("JAX primitive (the opcode where an instruction has none)",
                 op_profile.by_primitive(entry["rows"])),
                ("opcode", _by_opcode(entry["rows"]))):
            lines += ["", f"By {title}:", "", "| group | ms per step | % |", "|---|---:|---:|"]
            lines += [f"| {_cell(group)} | {seconds * 1e3:.4f} | {seconds / total:.1%} |"
                      for group, seconds in sums.items()]
    return "\n".join(lines) + "\n"


def profile_part(backend: str, files: Path | None) -> dict:
    import jax
    import jax.numpy as jnp
    from bench import decode_runner, prepare, with_overrides

    from train.instruments import op_profile

    config = _attnres_config(backend)
    cpu = backend == "cpu"
    steps, decode_steps = (2, 4) if cpu else (5, 20)
    tokens = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (config.batch_size, config.seq_len + 1), dtype=np.int32)
    model = config.model
    header = (f"{jax.devices()[0].device_kind} ({backend}); d {model.d_model}, {model.num_layers} "
              f"layers, {model.attention.num_heads} heads, seq {config.seq_len}, batch "
              f"{config.batch_size}, {model.dtype}; Block AttnRes: blocks of 4 sublayers. "
              f"Decode: one token at a time, batch 1, a cache of {config.seq_len} positions. "
              "Op times are exclusive and summed over threads or streams (op_profile).")
    programs = {}

    def add(name: str, run, steps: int) -> None:
        """Profile one program and rewrite the files with it (a run cut short keeps those
        done)."""
        programs[name] = entry = _profile_rows(run, steps)
        log(f"profile: {name}: {entry['op_s'] * 1e3:.2f} ms of ops, "
            f"{entry['wall_s'] * 1e3:.2f} ms wall per step")
        if files is not None:
            (files / "profile.md").write_text(profile_markdown(header, programs))
            (files / "profile.json").write_text(json.dumps({"header": header,
                                                            "programs": programs}))

    for label, overrides in (("prenorm", ""), ("block_attnres", BLOCK_ATTNRES)):
        log(f"profile: compiling {label}...")
        variant = prepare(with_overrides(config, overrides, "profile"), tokens)
        add(f"{label} train step", variant["runner"], steps)
        decoder = decode_runner(variant["program"],
                                jnp.asarray(tokens[:1, :config.seq_len // 2]), config.seq_len)
        add(f"{label} decode", decoder, decode_steps)
        del variant, decoder
    summary = {name: {"op_s": entry["op_s"], "wall_s": entry["wall_s"],
                      "instructions": len(entry["rows"]), "top_primitives": dict(
                          list(op_profile.by_primitive(entry["rows"]).items())[:5])}
               for name, entry in programs.items()}
    return {"programs": summary,
            "files": ["profile.md", "profile.json"] if files is not None else "none: no --out"}


def memory_part(backend: str) -> dict:
    if backend == "cpu":
        return {"skipped": "CPU: compiling the ~1B model at 8K takes minutes here; "
                           "scripts/attention_bench.py --memory measures the growth on CPU"}
    result = {}
    for implementation in ("auto", "blocked", "xla"):
        _, compiled = _compiled(_billion_config(8192, 1, implementation))
        memory = compiled.memory_analysis()
        result[implementation] = {"temp_bytes": memory.temp_size_in_bytes,
                                  "argument_bytes": memory.argument_size_in_bytes}
        log(f"memory_8k: {implementation} temp {memory.temp_size_in_bytes / 2**30:.2f} GiB")
    return result


def chosen_parts(parser, args) -> list[str]:
    """The parts to run, in order: --parts as given, else every part not in `OPTIONAL`
    (--quick: the attention part only); --profile adds the profile part (in its place)."""
    if args.quick and args.parts is not None:
        parser.error("--quick and --parts: give one of them")
    if args.parts is not None:
        names = [name.strip() for name in args.parts.split(",") if name.strip()]
        if unknown := [name for name in names if name not in PARTS]:
            parser.error(f"--parts={args.parts} is invalid: unknown part(s) "
                         f"{', '.join(unknown)}; the parts: {','.join(PARTS)}")
        if not names or len(set(names)) != len(names):
            parser.error(f"--parts={args.parts} is invalid: name each part once, e.g. "
                         f"{','.join(PARTS)}")
        return names + ["profile"] * (args.profile and "profile" not in names)
    names = ["attention"] if args.quick else [name for name in PARTS if name not in OPTIONAL]
    return [name for name in PARTS if name in names or (name == "profile" and args.profile)]


def _write(out: Path | None, result: dict) -> None:
    """DIR/check.json as the result stands (replaced whole: a reader never sees half)."""
    if out is not None:
        partial = out / "check.json.partial"
        partial.write_text(json.dumps(result, indent=1) + "\n")
        partial.replace(out / "check.json")


def main(argv: list[str] | None = None) -> int:
    global _log_file
    parser = ArgumentParser("python scripts/accelerator_check.py", __doc__)
    parser.add_argument("--quick", action="store_true", help="The attention part only.")
    parser.add_argument("--parts", metavar="NAME,...", default=None,
                        help=f"the parts to run, in this order (of {','.join(PARTS)})")
    parser.add_argument("--profile", action="store_true",
                        help="also run the profile part (per-op tables, DIR/profile.md)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="write check.json, check.log (and profile.md, profile.json) here")
    parser.add_argument("--scratch", metavar="DIR", default=None,
                        help="the study's runs and compilation cache (default: a temporary "
                             "directory, removed at the end)")
    args = parser.parse_args(argv)
    names = chosen_parts(parser, args)
    out = Path(args.out) if args.out else None
    for flag, path in (("--out", out), ("--scratch", args.scratch and Path(args.scratch))):
        if path is not None and path.exists() and not path.is_dir():
            parser.error(f"{flag}={path} is a file, not a directory")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        _log_file = (out / "check.log").open("w")
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="accelerator_check_"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        return _run(names, out, scratch)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
        if _log_file is not None:
            _log_file.close()
            _log_file = None


def _run(names: list[str], out: Path | None, scratch: Path) -> int:
    import jax  # after the arguments: a bad one is one line before JAX loads

    backend = jax.default_backend()
    result = {"backend": backend, "device_kind": jax.devices()[0].device_kind,
              "devices": jax.device_count(), "parts": names}
    parts = {"attention": attention_part, "attnres": attnres_part,
             "study_mode": lambda backend: study_mode_part(backend, scratch),
             "profile": lambda backend: profile_part(backend, out),
             "mfu": mfu_part, "memory_8k": memory_part}
    start = time.perf_counter()
    for name in names:
        log(f"{name}...")
        result[name] = {"running": True}
        _write(out, result)
        part_start = time.perf_counter()
        try:
            result[name] = parts[name](backend)
        except Exception as error:  # one failing part must not hide the others' figures
            log(traceback.format_exc())
            result[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        result[name]["part_s"] = time.perf_counter() - part_start
        gc.collect()  # the part's programs and buffers, before the next part sizes its own
        log(f"{name}: {json.dumps(result[name])}")  # the figures so far survive a timeout
        result["seconds"] = time.perf_counter() - start
        _write(out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
