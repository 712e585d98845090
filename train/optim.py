"""Optimizer: AdamW with a learning-rate schedule, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from arch.residual import MixingParam

# Parameter names (the last path component) by group, for the weight-decay mask.
NORM_PARAMS = ("scale", "alpha")  # norm gains; DyT's scalar α
BIAS_PARAMS = ("bias",)
EMBEDDING_PARAMS = ("embedding", "table")


def schedule(opt, steps: int) -> optax.Schedule:
    """Learning rate by step.

    cosine: linear warmup to `learning_rate`, then cosine decay to final_lr_fraction × peak.
    wsd (warmup-stable-decay, Hu et al. 2024 "MiniCPM" §4.1): linear warmup, constant, then a
    linear decay to final_lr_fraction × peak over the last `decay_fraction` of the steps.
    """
    peak, final = opt.learning_rate, opt.learning_rate * opt.final_lr_fraction
    if opt.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, opt.warmup_steps, steps, final)
    decay_steps = max(1, int(round(opt.decay_fraction * steps)))
    stable_steps = max(0, steps - opt.warmup_steps - decay_steps)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, opt.warmup_steps),
         optax.constant_schedule(peak),
         optax.linear_schedule(peak, final, decay_steps)],
        [opt.warmup_steps, opt.warmup_steps + stable_steps])


def decay_mask(opt, params):
    """True for parameters that get weight decay: all but norm gains, biases, embeddings (by
    name) and residual mixing weights (`arch.residual.MixingParam`: their initialization sets the
    starting mechanism, which decay would pull them away from), unless `optimizer.decay_norms /
    decay_biases / decay_embeddings / decay_mixing` say otherwise. `params` is a pytree of
    `nnx.Variable`s (e.g. `nnx.state(model, nnx.Param)`), whose types the mask reads."""
    excluded = ((() if opt.decay_norms else NORM_PARAMS)
                + (() if opt.decay_biases else BIAS_PARAMS)
                + (() if opt.decay_embeddings else EMBEDDING_PARAMS))

    def name(path):
        keys = [getattr(k, "key", None) for k in path]
        return [k for k in keys if isinstance(k, str)][-1]

    def decayed(path, variable) -> nnx.Variable:
        mixing = isinstance(variable, MixingParam) and not opt.decay_mixing
        return variable.replace(not mixing and name(path) not in excluded)

    return jax.tree_util.tree_map_with_path(
        decayed, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(opt, steps: int, mask=None) -> optax.GradientTransformation:
    """AdamW with `schedule` and clipping. The weight-decay `mask` defaults to `decay_mask` of the
    parameters (nnx.Variables); pass a tree of booleans to optimize a plain pytree instead (e.g.
    `nnx.to_pure_dict(decay_mask(opt, params))` for the reference model)."""
    adamw = optax.adamw(schedule(opt, steps), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                        weight_decay=opt.weight_decay,
                        mask=mask if mask is not None else lambda p: decay_mask(opt, p))
    if opt.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(opt.grad_clip), adamw)
    return adamw
