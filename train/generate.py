"""Sampling with a KV cache, and the `python -m train.generate` command.

    python -m train.generate --workdir runs/quickstart --prompt "And God said" \
        [--num_tokens 200] [--temperature 0.8] [--top_k 40] [--seed 0] [--allow_extrapolation]
        [--ema]

The arguments are checked against the run's config before the model loads: num_tokens ≥ 0 and
the prompt plus num_tokens within the trained context (model.max_seq_len; beyond it only with
--allow_extrapolation and positions that extrapolate), temperature ≥ 0, top_k in [0, vocab];
--ema (sample from the EMA of the parameters) needs a run trained with optimizer.ema_decay > 0.

The prompt is run once through the model (prefill), filling the cache; then one token at a time
is sampled and decoded against the cache, all inside one jitted `lax.scan`.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from config import ConfigError
from config.cli import ArgumentParser
from config.defaults import base_config
from config.validate import check_generation
from train.data.tokenizer import load_tokenizer, tokenizer_of
from train.restore import restore_run, with_ema_params
from train.rundir import saved_config


def sample(logits_BxV, key, temperature: float, top_k: int):
    """Greedy when temperature is 0; otherwise softmax(logits / temperature) over the top k."""
    if temperature == 0:
        return jnp.argmax(logits_BxV, axis=-1)
    logits_BxV = logits_BxV / temperature
    if top_k:
        kth_largest = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_largest, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_tokens", "temperature", "top_k"))
def generate_tokens(graphdef, params, model_state, prompt_BxP, key, *, num_tokens: int,
                    temperature: float = 0.8, top_k: int = 0):
    """Sample `num_tokens` continuations of `prompt_BxP` (int32); returns int32 [B, num_tokens].

    The model runs in evaluation mode (e.g. BatchNorm uses its running statistics)."""
    model = nnx.merge(graphdef, params, model_state)
    model.eval()
    batch, prompt_len = prompt_BxP.shape
    cache = model.init_cache(batch, prompt_len + num_tokens, jnp.dtype(model.cfg.dtype))
    positions_BxP = jnp.broadcast_to(jnp.arange(prompt_len), prompt_BxP.shape)
    logits_BxPxV, cache = model.decode(prompt_BxP, positions_BxP, cache)

    def next_token(carry, key):
        logits_BxV, cache, position = carry
        token_B = sample(logits_BxV, key, temperature, top_k).astype(jnp.int32)
        logits_Bx1xV, cache = model.decode(token_B[:, None],
                                           jnp.full((batch, 1), position), cache)
        return (logits_Bx1xV[:, 0], cache, position + 1), token_B

    carry = (logits_BxPxV[:, -1], cache, jnp.int32(prompt_len))
    _, tokens_NxB = jax.lax.scan(next_token, carry, jax.random.split(key, num_tokens))
    return tokens_NxB.T


def generate_text(program, state, prompt: str, num_tokens: int, *, temperature: float = 0.8,
                  top_k: int = 0, seed: int = 0) -> str:
    """Continue `prompt` with a train state of `program` (a TrainProgram: graph and mesh)."""
    tokenizer = tokenizer_of(program.config.data)
    prompt_tokens = (tokenizer.encode(prompt) if prompt
                     else np.array([tokenizer.separator], np.int32))
    model_cfg = program.model_cfg
    length = len(prompt_tokens) + num_tokens
    if model_cfg.position.name == "learned" and length > model_cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_tokens)} tokens) + num_tokens={num_tokens} exceeds "
                         f"model.max_seq_len={model_cfg.max_seq_len} of learned positions")
    with jax.set_mesh(program.mesh):
        tokens = generate_tokens(program.graphdef, state["params"], state["model_state"],
                                 jnp.asarray(prompt_tokens)[None],
                                 jax.random.key(seed), num_tokens=num_tokens,
                                 temperature=temperature, top_k=top_k)
    return prompt + tokenizer.decode(np.asarray(tokens[0]))


def check_arguments(workdir: str, prompt: str, num_tokens, temperature, top_k,
                    allow_extrapolation: bool, ema: bool = False) -> None:
    """Check the generation arguments against the run's config.json before anything loads:
    one-line ConfigError (or FileNotFoundError when `workdir` holds no run)."""
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
