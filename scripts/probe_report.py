"""The instrument panel of a run: accounting, per-depth probes, pruning, head ablation, the softmax
bottleneck and compiled memory, as a Markdown report with PNG plots and a JSON file of every number.

    python scripts/probe_report.py --workdir runs/X [--out DIR] [--batch 8] [--seq_len T]
        [--prune 1] [--bottleneck_tokens M] [--sparsity_threshold 0.01] [--text PATH]

Restores the newest checkpoint of the run in --workdir (a trained run, or a Hugging Face import
from scripts/import_hf.py) and measures it on the first validation batch of --batch sequences
(--seq_len defaults to the run's) of --text (a local text file or a prepared directory), or of
the run's validation split: `train.instruments.probe_report.measure`, whose module docstring
says what it measures. --prune: blocks to prune by influence (0 skips it); --bottleneck_tokens:
the tokens of the log-odds matrix (default min(vocab − 1, 2(d + 1))). Writes report.md,
report.json and the plots into --out (default WORKDIR/report).

Progress goes to stderr. Exit status: 0 done; 2 a bad argument or a run that does not restore,
one line on stderr. The arguments are checked against the run's config.json before JAX loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from config import ConfigError
from config.cli import ArgumentParser
from train.data.arguments import check_analysis, check_text, output_directory
from train.rundir import saved_run


def check_counts(saved: dict, prune: int, bottleneck_tokens: int | None) -> None:
    """--prune in [0, num_layers) and --bottleneck_tokens in [1, vocab_size) of the saved run."""
    layers, vocab = saved["model"]["num_layers"], saved["model"]["vocab_size"]
    if not 0 <= prune < layers:
        raise ConfigError(f"--prune={prune} is invalid: must be in [0, {layers - 1}] "
                          f"(the model has {layers} blocks)")
    if bottleneck_tokens is not None and not 1 <= bottleneck_tokens < vocab:
        raise ConfigError(f"--bottleneck_tokens={bottleneck_tokens} is invalid: must be in "
                          f"[1, {vocab - 1}] (vocab_size − 1)")


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/probe_report.py", __doc__)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", default=None, help="default: WORKDIR/report")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=None, help="default: the run's seq_len")
    parser.add_argument("--prune", type=int, default=1, help="blocks to prune (0: skip)")
    parser.add_argument("--bottleneck_tokens", type=int, default=None,
                        help="default: min(vocab − 1, 2(d + 1)), enough to test the bound")
    parser.add_argument("--sparsity_threshold", type=float, default=1e-2)
    parser.add_argument("--text", default=None,
                        help="evaluation text: a text file or a prepared directory (default: "
                             "the run's validation split)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.workdir) / "report"
    try:
        saved = saved_run(args.workdir)
        check_analysis(saved, args.batch, args.seq_len)
        check_counts(saved, args.prune, args.bottleneck_tokens)
        check_text(args.text)
        output_directory(out)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.instruments import probe_report  # JAX loads here, after the checks

    try:
        report = probe_report.measure(args.workdir, args.batch, args.seq_len, args.prune,
                                      args.bottleneck_tokens, args.sparsity_threshold, args.text)
    except (FileNotFoundError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    written = probe_report.write_report(report, out)
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
