"""Books of a model from its config alone (via `jax.eval_shape`, nothing allocated)."""

from __future__ import annotations

import math

import jax
import ml_collections
from flax import nnx

from arch.attention import ATTENTION
from arch.heads import HEADS
from arch.model import TransformerLM


def abstract_model(model_cfg) -> TransformerLM:
    """The model with ShapeDtypeStruct leaves: shapes and logical axes, no memory."""
    frozen = ml_collections.FrozenConfigDict(model_cfg)
    return nnx.eval_shape(lambda: TransformerLM(frozen, rngs=nnx.Rngs(0)))


def parameter_count(model_cfg) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract_model(model_cfg))))


def matmul_parameter_count(model_cfg) -> int:
    """Weights used in one matrix multiply per token: every Dense kernel once, plus what the head
    multiplies again (the tied embedding; MoS's K vocabulary projections)."""
    kernels = nnx.state(abstract_model(model_cfg), lambda path, _: path[-1] == "kernel")
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(kernels))
    return count + HEADS[model_cfg.head].reused_matmul_parameters(model_cfg)


def flops_per_token(model_cfg, seq_len: int, training: bool = True) -> float:
    """Matmul FLOPs per token: 2 per matmul weight, plus causal attention counted honestly (each
    attention class's `score_flops_per_token`: position t attends to t + 1 keys, not T).
    Training (forward + backward) is 3× forward.
    """
    attention = ATTENTION[model_cfg.attention].score_flops_per_token(model_cfg, seq_len)
    forward = 2 * matmul_parameter_count(model_cfg) + model_cfg.num_layers * attention
    return float(3 * forward if training else forward)
