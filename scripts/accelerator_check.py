"""The accelerator check: `scripts/accelerator_check.sh` runs this and it
prints ONE JSON line on stdout (progress on stderr). Meant for a GPU or TPU host, under 10
minutes; on CPU it runs the portable parts only and names every skipped part with its reason.

Parts (each a key of the JSON object; a skipped part is {"skipped": reason}):

  attention      max |difference| of values and gradients against the explicit `xla` path, per
                 implementation: `blocked` everywhere, `cudnn` on NVIDIA GPUs (bf16), `splash`
                 on TPUs (arch/kernels/attention_implementations.py), relative to the largest
                 |value| of each
                 output. `ok` within 1e-5 in f32 (splash 2e-3), both paths' products at full f32
                 precision (GPUs otherwise multiply f32 in TF32, 10-bit mantissas); 1.6e-2 in
                 bf16 (two units in the last place of the largest value).
  mfu            a ~1B-parameter bf16 model (d 2048, 20 layers, 16 heads of 128) at seq 4096
                 with `auto` attention: the largest batch in 16, 8, 4, 2, 1 whose compiled
                 memory fits in 90% of the device, its train-step time and MFU against the
                 device's published dense bf16 peak (`PEAK_BF16`). Target on H100/H200: ≥ 50%.
  attnres        Block AttnRes (8 blocks of 4 sublayers, 32 sublayers) against Pre-Norm, bf16,
                 d 1024, seq 2048, batch 8: `scripts/bench.py`'s paired train-step and one-token
                 decode ratios. Target: ≤ 1.02 each.
  memory_8k      the ~1B model at seq 8192, batch 1: compiled temp + argument bytes of the
                 train step with `auto`, `blocked` and `xla` attention (compile only).

Usage: scripts/accelerator_check.sh [--quick]   (--quick: the attention part only)
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import numpy as np

from config.cli import ArgumentParser

# Published dense bf16 peak FLOP/s per device, by `device_kind` prefix (vendor datasheets).
PEAK_BF16 = {"NVIDIA H200": 989e12, "NVIDIA H100": 989e12, "NVIDIA A100": 312e12,
             "TPU v6": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12,
             "TPU v4": 275e12}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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


def attnres_part(backend: str) -> dict:
    if backend == "cpu":
        return {"skipped": "CPU: the CPU figures come from scripts/bench.py's C-attnres command "
                           "(docs/performance.md#block-attnres)"}
    from bench import bench

    from config.defaults import base_config

    config = base_config()
    config.seq_len, config.batch_size, config.mesh.data = 2048, 8, 1
    model = config.model
    model.d_model, model.num_layers = 1024, 16
    model.attention.num_heads, model.attention.num_kv_heads = 8, 8
    model.dtype, model.residual.name = "bfloat16", "prenorm"
    result = bench(config, steps=10, block=2, depth_check=False,
                   compare="model.residual.name=block_attnres,model.attnres.block_size=4",
                   decode=True, decode_steps=200)
    entry = next(iter(result["compare"].values()))
    return {"step_time_vs_prenorm": entry["step_time_vs_config"],
            "decode_time_vs_prenorm": entry["decode_time_vs_config"],
            "prenorm_step_time_s": result["step_time_s"], "target": "<= 1.02 each"}


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


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/accelerator_check.py", __doc__)
    parser.add_argument("--quick", action="store_true", help="The attention part only.")
    args = parser.parse_args(argv)
    import jax  # after the arguments: a bad one is one line before JAX loads

    backend = jax.default_backend()
    result = {"backend": backend, "device_kind": jax.devices()[0].device_kind,
              "devices": jax.device_count()}
    parts = {"attention": attention_part}
    if not args.quick:
        parts.update(mfu=mfu_part, attnres=attnres_part, memory_8k=memory_part)
    start = time.perf_counter()
    for name, part in parts.items():
        log(f"{name}...")
        try:
            result[name] = part(backend)
        except Exception as error:  # one failing part must not hide the others' figures
            log(traceback.format_exc())
            result[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        log(f"{name}: {json.dumps(result[name])}")  # the figures so far survive a timeout
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
