"""`python -m train.generate`: sample from a run with a KV cache.

    python -m train.generate --workdir runs/quickstart --prompt "And God said" \
        [--num_tokens 200] [--temperature 0.8] [--top_k 40] [--seed 0] [--allow_extrapolation]
        [--ema]

The arguments are checked against the run's config before the model loads: num_tokens ≥ 0 and
the prompt (UTF-8 text) plus num_tokens within the trained context (model.max_seq_len; beyond it
only with --allow_extrapolation and positions that extrapolate), temperature ≥ 0, top_k in
[0, vocab]; --ema (sample from the EMA of the parameters) needs a run trained with
optimizer.ema_decay > 0.

Everything is checked before JAX is imported: a bad argument is one line and exit status 2 in a
fraction of a second. The sampling itself: `train.sampling`.
"""

from __future__ import annotations

import sys

from config import ConfigError
from config.cli import ArgumentParser
from config.defaults import base_config
from config.validate import check_generation, check_utf8
from train.data.tokenizer import load_tokenizer
from train.rundir import saved_config


def check_arguments(workdir: str, prompt: str, num_tokens, temperature, top_k,
                    allow_extrapolation: bool, ema: bool = False) -> None:
    """Check the generation arguments against the run's config.json before anything loads:
    one-line ConfigError (or FileNotFoundError when `workdir` holds no run)."""
    check_utf8("--prompt", prompt)
    saved = saved_config(workdir, base_config().to_dict())  # over the defaults, upgraded
    if saved is None:
        raise FileNotFoundError(f"--workdir={workdir} holds no config.json; train a model there "
                                "first with python -m train")
    if ema and not saved["optimizer"]["ema_decay"] > 0:
        raise ConfigError(f"--ema is invalid: the run in --workdir={workdir} keeps no EMA of its "
                          f"parameters (optimizer.ema_decay={saved['optimizer']['ema_decay']!r}); "
                          "train one with --config.optimizer.ema_decay=0.999, say")
    model = saved["model"]
    context = model["max_seq_len"] or saved["seq_len"]
    tokenizer = load_tokenizer(saved["data"]["tokenizer"] or "byte")
    prompt_tokens = len(tokenizer.encode(prompt)) if prompt else 1  # "": the separator alone
    check_generation(model["vocab_size"], model["position"]["name"], context, prompt_tokens,
                     num_tokens, temperature, top_k, allow_extrapolation=allow_extrapolation)


def main(argv=None) -> int:
    parser = ArgumentParser("python -m train.generate", __doc__)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--prompt", default="")
    parser.add_argument("--num_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow_extrapolation", action="store_true",
                        help="generate past the trained context (model.max_seq_len) with "
                             "positions that extrapolate (rope, none)")
    parser.add_argument("--ema", action="store_true",
                        help="sample from the EMA of the parameters (a run trained with "
                             "optimizer.ema_decay > 0)")
    args = parser.parse_args(argv)
    try:
        check_arguments(args.workdir, args.prompt, args.num_tokens, args.temperature,
                        args.top_k, args.allow_extrapolation, args.ema)
    except (FileNotFoundError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from train.restore import restore_run, with_ema_params  # JAX loads here, after the checks
    from train.sampling import generate_text

    try:
        program, step, state = restore_run(args.workdir)
        if args.ema:
            state = with_ema_params(state, args.workdir)
    except (FileNotFoundError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"[step {step}{', EMA parameters' if args.ema else ''}]")
    print(generate_text(program, state, args.prompt, args.num_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
