"""Block pruning with healing: loss after pruning and after LoRA healing against the fraction of
blocks removed, for Block Influence and angular-distance selection.

    python scripts/prune_heal.py --workdir RUN --out DIR [--fractions 0.125,0.25,0.5]
        [--selection influence,angular] [--heal_steps 200] [--rank 8] [--learning_rate 1e-3]
        [--batch 8] [--eval_batches 4] [--no_control]

For each selection and fraction f, round(f·L) of the run's L blocks are dropped, the loss is
measured, the model is healed with rank --rank adapters for --heal_steps steps and measured
again; --no_control skips healing the intact model. Writes blocks.md, blocks.json and
blocks.png into --out: `train.instruments.pruning_report.measure_blocks`, whose module docstring
says what it measures.

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

SELECTIONS = ("influence", "angular")  # train.instruments.pruning_report.SELECTIONS


def fractions_of(text: str, layers: int) -> list[float]:
    """The fractions of `--fractions 0.125,0.25` ('': none, only the control), each dropping
    1 ≤ round(f·L) < L of the run's `layers` blocks."""
    try:
        fractions = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise ConfigError(f"--fractions={text} is invalid: expected comma-separated "
                          "numbers") from None
    for fraction in fractions:
        if not 1 <= round(fraction * layers) < layers:
            raise ConfigError(f"--fractions={fraction} is invalid: it drops "
                              f"{round(fraction * layers)} of {layers} blocks; expected "
                              "1 ≤ round(f·L) < L")
    return fractions


def names_of(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    """The names of a comma-separated `flag`, a non-empty subset of `allowed`."""
    names = [x for x in text.split(",") if x]
    if not names or any(x not in allowed for x in names):
        raise ConfigError(f"{flag}={text} is invalid: expected a comma-separated subset of "
                          f"{','.join(allowed)}")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/prune_heal.py", __doc__)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fractions", default="0.125,0.25,0.5",
                        help="'' (empty): only the control")
    parser.add_argument("--selection", default="influence,angular",
                        help="influence, angular or both (comma-separated)")
    parser.add_argument("--heal_steps", type=int, default=200)
    parser.add_argument("--rank", type=positive_int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--eval_batches", type=positive_int, default=4)
    parser.add_argument("--no_control", action="store_true",
                        help="skip healing the intact model (the control)")
    args = parser.parse_args(argv)

    def check() -> tuple[list[float], list[str]]:
        saved = saved_run(args.workdir)
        check_analysis(saved, args.batch)
        fractions = fractions_of(args.fractions, saved["model"]["num_layers"])
        selections = names_of(args.selection, "--selection", SELECTIONS)
        if args.heal_steps < 0:
            raise ConfigError(f"--heal_steps={args.heal_steps} is invalid: must be ≥ 0")
        output_directory(args.out)
        return fractions, selections

    def run(checked: tuple[list[float], list[str]]) -> int:
        from train.instruments import pruning_report  # JAX loads here, after the checks

        fractions, selections = checked
        return pruning_report.measure_and_write(
            lambda: pruning_report.measure_blocks(
                args.workdir, fractions, selections, args.heal_steps, args.rank,
                args.learning_rate, args.batch, args.eval_batches, control=not args.no_control),
            pruning_report.write_blocks, args.out)

    return checked_run(check, run)


if __name__ == "__main__":
    sys.exit(main())
