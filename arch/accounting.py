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


def _size(state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def parameter_count(model_cfg) -> int:
    """All parameters (`nnx.Param`; not running statistics or MoE loss/metric variables), every
    routed expert included."""
    return _size(nnx.state(abstract_model(model_cfg), nnx.Param))


def _routed_expert_share(model_cfg, model) -> tuple[int, int, int]:
    """(routed-expert weights, k, E): the stacked weights of `arch.moe.RoutedExperts`, of which
    each token uses k of E experts (0 weights without MoE)."""
    if model_cfg.ffn != "moe":
        return 0, 1, 1
    routed = nnx.state(model, lambda path, _: "routed_experts" in path)
    return _size(routed), model_cfg.moe_top_k, model_cfg.moe_experts


def active_parameter_count(model_cfg) -> int:
    """Parameters one token uses: the total minus the (E − k)/E share of the routed-expert
    weights (each token runs k of the E experts); equals `parameter_count` without MoE."""
    model = abstract_model(model_cfg)
    routed, k, experts = _routed_expert_share(model_cfg, model)
    return _size(nnx.state(model, nnx.Param)) - routed * (experts - k) // experts


def matmul_parameter_count(model_cfg) -> int:
    """Weights used in one matrix multiply per token: every Dense kernel once (MoE router and
    shared experts included), routed MoE expert weights at k/E of their size (a token runs k of
    the E experts; dispatch/combine einsums are not counted), plus what the head multiplies again
    (the tied embedding; MoS's K vocabulary projections)."""
    model = abstract_model(model_cfg)
    count = _size(nnx.state(model, lambda path, _: path[-1] == "kernel"))
    routed, k, experts = _routed_expert_share(model_cfg, model)
    count += routed * k // experts
    return count + HEADS[model_cfg.head].reused_matmul_parameters(model_cfg)


def flops_per_token(model_cfg, seq_len: int, training: bool = True) -> float:
    """Matmul FLOPs per token: 2 per matmul weight, plus causal attention counted honestly (each
    attention class's `score_flops_per_token`: position t attends to t + 1 keys, not T).
    Training (forward + backward) is 3× forward.
    """
    attention = ATTENTION[model_cfg.attention].score_flops_per_token(model_cfg, seq_len)
    forward = 2 * matmul_parameter_count(model_cfg) + model_cfg.num_layers * attention
    return float(3 * forward if training else forward)
