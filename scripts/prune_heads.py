"""Head pruning (Michel et al. 2019): loss against the fraction of heads pruned by iterative
gradient importance, and the train and decode step speedups of the physically pruned model.

    python scripts/prune_heads.py --workdir RUN --out DIR
        [--structures heads,per_group,whole_groups] [--step_fraction 0.1] [--max_fraction 0.9]
        [--calibration_batches 2] [--batch 8] [--eval_batches 4] [--timing_steps 10]
        [--timing_batch B]

For each structure, heads are pruned --step_fraction at a time up to --max_fraction by their
importance on --calibration_batches training batches; the removable rounds are timed over
--timing_steps train steps of --timing_batch sequences (default: the run's batch; 0 steps skip
the timing). Writes heads.md, heads.json and heads.png into --out:
`train.instruments.pruning_report.measure_heads`, whose module docstring says what it measures.

Exit status: 0 done; 2 a bad argument or a run that does not restore; 3 --out cannot be
written (no space, a read-only directory); one line on stderr. The arguments are checked against
the run's config.json before JAX loads.
"""

from __future__ import annotations

import sys

from config import ConfigError
from config.cli import ArgumentParser, positive_int
from train.data.arguments import check_analysis, output_directory
from train.instruments.command_line import checked_run
from train.rundir import saved_run

STRUCTURES = ("heads", "per_group", "whole_groups")  # train.instruments.head_pruning.STRUCTURES


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/prune_heads.py", __doc__)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--structures", default=",".join(STRUCTURES))
    parser.add_argument("--step_fraction", type=float, default=0.1)
    parser.add_argument("--max_fraction", type=float, default=0.9)
    parser.add_argument("--calibration_batches", type=positive_int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--eval_batches", type=positive_int, default=4)
    parser.add_argument("--timing_steps", type=int, default=10, help="0: skip the timing")
    parser.add_argument("--timing_batch", type=positive_int, default=None,
                        help="train-step batch for the timing (default: the run's)")
    args = parser.parse_args(argv)

    def check() -> list[str]:
        check_analysis(saved_run(args.workdir), args.batch)
        structures = [x for x in args.structures.split(",") if x]
        if not structures or any(x not in STRUCTURES for x in structures):
            raise ConfigError(f"--structures={args.structures} is invalid: expected a "
                              f"comma-separated subset of {','.join(STRUCTURES)}")
        for flag, fraction in (("--step_fraction", args.step_fraction),
                               ("--max_fraction", args.max_fraction)):
            if not 0 < fraction <= 1:
                raise ConfigError(f"{flag}={fraction} is invalid: must be in (0, 1]")
        if args.timing_steps < 0:
            raise ConfigError(f"--timing_steps={args.timing_steps} is invalid: must be ≥ 0 "
                              "(0: skip the timing)")
        output_directory(args.out)
        return structures

    def run(structures: list[str]) -> int:
        from train.instruments import pruning_report  # JAX loads here, after the checks

        return pruning_report.measure_and_write(
            lambda: pruning_report.measure_heads(
                args.workdir, structures, args.step_fraction, args.max_fraction,
                args.calibration_batches, args.batch, args.eval_batches, args.timing_steps,
                args.timing_batch),
            pruning_report.write_heads, args.out)

    return checked_run(check, run)


if __name__ == "__main__":
    sys.exit(main())
