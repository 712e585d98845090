"""Post-training quantization of a run (int8, LLM.int8(), GPTQ 4/3-bit).

    python scripts/quantize.py --workdir RUN --method int8|llm_int8|gptq4|gptq3|int4|int3 \
        --out RUN_Q [--group_size G] [--calibration_batches N] [--threshold 6.0] [--measure]

Quantizes the attention and FFN projections of RUN's layer stack and writes the run directory
RUN_Q (RUN's config.json with a `quantization` section and a checkpoint of the quantized
parameters) and RUN_Q/quantization.json: `train.interop.quantize`, whose module docstring says
what each method computes. --group_size: input rows per scale (int8, gptq; 0: one per output
channel); --calibration_batches: training batches the calibration reads (llm_int8, gptq);
--threshold: llm_int8's outlier threshold; --measure: also the loss delta, weight bytes and the
decode-time ratio.

Exit status: 0 done; 2 a bad argument or a run that does not restore; 3 OUT cannot be written
(no space, a read-only directory); one line on stderr. The arguments are checked against RUN's
config.json before JAX loads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from config import ConfigError
from config.cli import ArgumentParser
from train.data.arguments import output_directory
from train.rundir import saved_run

METHODS = ("int8", "int4", "int3", "llm_int8", "gptq4", "gptq3")  # train.interop.quantize's
CALIBRATED = ("llm_int8", "gptq4", "gptq3")


def check_arguments(workdir: str, out: str, method: str, group_size: int,
                    calibration_batches: int) -> None:
    """The run to quantize (a float32 run), the new run directory and the counts: one-line
    ConfigError."""
    for flag, value in (("--group_size", group_size),
                        ("--calibration_batches", calibration_batches)):
        if value < 0:
            raise ConfigError(f"{flag}={value} is invalid: must be ≥ 0")
    if method in CALIBRATED and calibration_batches < 1:
        raise ConfigError(f"--calibration_batches={calibration_batches} is invalid: {method} "
                          "needs ≥ 1 batch of calibration data")
    quantized = saved_run(workdir)["quantization"]["method"]
    if quantized != "none":
        raise ConfigError(f"--workdir={workdir} is already quantized ({quantized}); quantize a "
                          "float32 run")
    path = output_directory(out)
    if (path / "config.json").exists() or (path / "checkpoints").exists():
        raise ConfigError(f"--out={out} already holds a run; quantize into a new directory")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/quantize.py", __doc__)
    parser.add_argument("--workdir", required=True, help="the float32 run to quantize")
    parser.add_argument("--method", required=True, choices=METHODS, help=" | ".join(METHODS))
    parser.add_argument("--out", required=True, help="the quantized run directory to create")
    parser.add_argument("--group_size", type=int, default=0,
                        help="int8/gptq: input rows per scale; 0 (default): one per channel")
    parser.add_argument("--calibration_batches", type=int, default=8,
                        help="llm_int8/gptq: training batches the calibration reads")
    parser.add_argument("--threshold", type=float, default=6.0,
                        help="llm_int8: outlier threshold on calibration max |activation|")
    parser.add_argument("--measure", action="store_true",
                        help="also measure loss delta, weight bytes and decode time ratio; "
                             "writes OUT/quantization.json")
    args = parser.parse_args(argv)
    try:
        check_arguments(args.workdir, args.out, args.method, args.group_size,
                        args.calibration_batches)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.checkpoint import WriteError, failure_reason  # JAX loads here, after the checks
    from train.interop import quantize

    try:
        report = quantize.quantize_run(args.workdir, args.out, args.method,
                                       group_size=args.group_size,
                                       calibration_batches=args.calibration_batches,
                                       threshold=args.threshold)
        if args.measure:
            report.update(quantize.measure(args.workdir, args.out))
        (Path(args.out) / "quantization.json").write_text(json.dumps(report, indent=2) + "\n")
    except (FileNotFoundError, ValueError) as error:  # ConfigError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (WriteError, OSError) as error:
        print(f"error: cannot write into --out={args.out}: {failure_reason(error)}; remove it "
              "and rerun once the directory is writable and has space", file=sys.stderr)
        return 3
    print(json.dumps({k: v for k, v in report.items() if k != "outlier_features"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
