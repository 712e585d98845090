"""Export a run as a Hugging Face checkpoint that `transformers` loads.

    python scripts/export_hf.py --workdir RUN --out DIR [--ema]

Writes DIR/config.json, DIR/model.safetensors and the run's tokenizer from RUN's newest
checkpoint (`train.interop.export_hf.export_run`, whose module docstring says what it reads and
writes and which models export exactly). DIR must not exist or be empty. The weights are the
run's parameters or, with --ema, their exponential moving average (a run trained with
optimizer.ema_decay > 0); the last line says which, and the step.

Exit status: 0 done; 2 a bad argument, a run that does not restore or a model that cannot be
exported exactly, one line on stderr. The arguments, and whether the export would load back
(`train.interop.exportable`), are checked before JAX loads.
"""

from __future__ import annotations

import sys

from config import ConfigError
from config.cli import ArgumentParser
from train.data.arguments import output_directory
from train.data.tokenizer import tokenizer_of
from train.interop.exportable import check_exportable
from train.rundir import saved_run


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser("python scripts/export_hf.py", __doc__)
    parser.add_argument("--workdir", required=True, help="the run directory to export")
    parser.add_argument("--out", required=True, help="the Hugging Face checkpoint directory")
    parser.add_argument("--ema", action="store_true",
                        help="export the EMA of the parameters (optimizer.ema_decay > 0)")
    args = parser.parse_args(argv)
    try:
        saved = saved_run(args.workdir)
        ema_decay = saved.get("optimizer", {}).get("ema_decay") or 0
        if args.ema and not ema_decay > 0:
            raise ConfigError(f"--ema is invalid: the run in --workdir={args.workdir} keeps no "
                              "EMA of its parameters (optimizer.ema_decay=0); export its "
                              "parameters without --ema")
        check_exportable(saved["model"], tokenizer_of(saved["data"]))
        out = output_directory(args.out)
        if out.is_dir() and any(out.iterdir()):
            raise ConfigError(f"--out={out} is not empty; export into a new directory")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.interop.export_hf import export_run  # JAX loads here, after the checks
    from train.interop.hf import SINGLE_FILE

    try:
        step = export_run(args.workdir, out, ema=args.ema)
    except (FileNotFoundError, ValueError) as error:  # ConfigError is a ValueError
        print(f"error: {error}", file=sys.stderr)
        return 2
    weights = (f"the EMA of the parameters (ema_decay={ema_decay})" if args.ema else
               "the parameters" + (" (not their EMA: --ema exports that)" if ema_decay else ""))
    print(f"wrote {out / 'config.json'}, {out / SINGLE_FILE} and the tokenizer: {weights} at "
          f"step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
