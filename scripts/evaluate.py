"""Multiple-choice accuracy of a run, by log-likelihood, on a task in lm-eval-harness's format.

    python scripts/evaluate.py --workdir runs/X --task experiments/tasks/kjv_next_verse.jsonl
        [--ema] [--batch 64] [--out FILE]
    python scripts/evaluate.py --make_task experiments/tasks/kjv_next_verse.jsonl
        [--held_out chapters|books]

Scores the newest checkpoint of the run in --workdir (its parameters' EMA with --ema) on every
item of --task (JSON lines: {"context", "choices", "gold"}; `train.data.tasks`), at the run's
seq_len: `train.instruments.multiple_choice`, whose docstring defines acc and acc_norm. Writes
the result to --out (default WORKDIR/eval_<task>.json, which study reports read) and prints one
line: accuracy, length-normalized accuracy, each with its Wilson 95% interval, and chance.

--make_task writes the next-verse task built from the KJV's held-out chapters
(`data.validation="chapters"`, the studies' default) or books (`"books"`).

Exit status: 0 done; 2 a bad argument, task or run, one line on stderr. The arguments and the
task file are checked before JAX loads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from config import ConfigError
from config.cli import ArgumentParser
from train.data import tasks
from train.data.arguments import output_file
from train.rundir import saved_run


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/evaluate.py", __doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--workdir", help="the run directory")
    mode.add_argument("--make_task", metavar="PATH", help="write the next-verse task here")
    parser.add_argument("--task", help="the task file (JSON lines)")
    parser.add_argument("--ema", action="store_true", help="score the parameters' EMA")
    parser.add_argument("--batch", type=int, default=64, help="choices per forward pass")
    parser.add_argument("--out", default=None, help="default: WORKDIR/eval_<task>.json")
    parser.add_argument("--held_out", default="chapters", choices=("chapters", "books"),
                        help="with --make_task: the KJV validation split to build it from")
    args = parser.parse_args(argv)
    if args.make_task:
        from train.instruments import multiple_choice  # JAX loads here

        items = multiple_choice.next_verse_items(args.held_out)
        tasks.write_task(items, args.make_task)
        print(f"wrote {args.make_task}: {len(items)} items")
        return 0
    if args.task is None:
        parser.error("--workdir needs --task FILE")
    out = Path(args.out) if args.out else Path(args.workdir) / f"eval_{Path(args.task).stem}.json"
    try:
        if args.batch <= 0:
            raise ConfigError(f"--batch={args.batch} is invalid: must be a positive int")
        saved_run(args.workdir)
        tasks.load_task(args.task)
        output_file(out)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.instruments import multiple_choice  # JAX loads here, after the checks

    try:
        result = multiple_choice.evaluate_run(args.workdir, args.task, ema=args.ema,
                                              batch=args.batch)
    except (FileNotFoundError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out.write_text(json.dumps(result, indent=2) + "\n")
    low, high = result["acc_interval"]
    low_norm, high_norm = result["acc_norm_interval"]
    print(f"{result['task']} at step {result['step']}: acc {result['acc']:.4f} [{low:.4f}, "
          f"{high:.4f}], acc_norm {result['acc_norm']:.4f} [{low_norm:.4f}, {high_norm:.4f}] "
          f"over {result['items']} items (chance {result['chance']:.4f}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
