"""Optimizer: AdamW with a learning-rate schedule, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import optax

# Parameter names (the last path component) by group, for the weight-decay mask.
NORM_PARAMS = ("scale", "alpha")  # norm gains; DyT's scalar α
BIAS_PARAMS = ("bias",)
EMBEDDING_PARAMS = ("embedding", "table")
# Residual-mechanism mixing parameters whose initialization sets the starting mechanism (AttnRes
# pseudo-queries, HC/mHC static weights, biases and scales, the width baseline's branch weights):
# decay would pull them away from it (to uniform depth weights, or no stream at all).
MIXING_PARAMS = ("pseudo_queries", "static_weights", "static_read", "static_mixing",
                 "static_write", "width_scale", "depth_scale", "read_bias", "write_bias",
                 "mixing_bias", "read_scale", "write_scale", "mixing_scale", "branch_weights")


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
    """True for parameters that get weight decay: all but norm gains, biases, embeddings and
    residual mixing parameters, unless `optimizer.decay_norms / decay_biases / decay_embeddings /
    decay_mixing` say otherwise."""
    excluded = ((() if opt.decay_norms else NORM_PARAMS)
                + (() if opt.decay_mixing else MIXING_PARAMS)
                + (() if opt.decay_biases else BIAS_PARAMS)
                + (() if opt.decay_embeddings else EMBEDDING_PARAMS))

    def name(path):
        keys = [getattr(k, "key", None) for k in path]
        return [k for k in keys if isinstance(k, str)][-1]

    return jax.tree_util.tree_map_with_path(lambda path, _: name(path) not in excluded, params)


def make_optimizer(opt, steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(schedule(opt, steps), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                        weight_decay=opt.weight_decay, mask=lambda p: decay_mask(opt, p))
    if opt.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(opt.grad_clip), adamw)
    return adamw
