"""Books of a model from its config alone (via `jax.eval_shape`, nothing allocated)."""

from __future__ import annotations

import math

import jax
import ml_collections
from flax import nnx

from arch.model import TransformerLM


def abstract_model(model_cfg) -> TransformerLM:
    """The model with ShapeDtypeStruct leaves: shapes and logical axes, no memory."""
    frozen = ml_collections.FrozenConfigDict(model_cfg)
    return nnx.eval_shape(lambda: TransformerLM(frozen, rngs=nnx.Rngs(0)))


def parameter_count(model_cfg) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract_model(model_cfg))))


def matmul_parameter_count(model_cfg) -> int:
    """Weights used in one matrix multiply per token: every Dense kernel, plus the embedding
    matrix when the tied head reuses it as the output projection."""
    kernels = nnx.state(abstract_model(model_cfg), lambda path, _: path[-1] == "kernel")
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(kernels))
    if model_cfg.head == "tied":
        count += model_cfg.vocab_size * model_cfg.d_model
    return count


def flops_per_token(model_cfg, seq_len: int, training: bool = True) -> float:
    """Matmul FLOPs per token: 2 per matmul weight, plus causal attention counted honestly.

    Attention at position t does QKᵀ and AV over t + 1 keys: 4·H·P·(t + 1) FLOPs per layer;
    averaged over t = 0..T−1 that is 2·H·P·(T + 1). Training (forward + backward) is 3× forward.
    """
    attention = 2 * model_cfg.num_heads * model_cfg.head_dim * (seq_len + 1)
    forward = 2 * matmul_parameter_count(model_cfg) + model_cfg.num_layers * attention
    return float(3 * forward if training else forward)
