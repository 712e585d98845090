"""Sampling with a KV cache: the prompt runs once through the model (prefill), filling the cache;
then one token at a time is sampled and decoded against the cache, all inside one jitted
`lax.scan`. `python -m train.generate` is its command (train/generate.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from config.catalogue import LEARNED_TABLE, has
from train.data.tokenizer import tokenizer_of


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
    if has("position", model_cfg.position.name, LEARNED_TABLE) and length > model_cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_tokens)} tokens) + num_tokens={num_tokens} exceeds "
                         f"model.max_seq_len={model_cfg.max_seq_len} of learned positions")
    with jax.set_mesh(program.mesh):
        tokens = generate_tokens(program.graphdef, state["params"], state["model_state"],
                                 jnp.asarray(prompt_tokens)[None],
                                 jax.random.key(seed), num_tokens=num_tokens,
                                 temperature=temperature, top_k=top_k)
    return prompt + tokenizer.decode(np.asarray(tokens[0]))
