"""Optimizer: AdamW, or Muon on the hidden matrices with AdamW for the rest, with a learning-rate
schedule, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

import jax
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from arch.residual import MixingParam

# Parameter names (the last path component) by group, for the weight-decay mask.
NORM_PARAMS = ("scale", "alpha")  # norm gains; DyT's scalar α
BIAS_PARAMS = ("bias",)
EMBEDDING_PARAMS = ("embedding", "table")
HEAD_MODULES = ("head",)  # top-level modules that Muon leaves to AdamW, with the embeddings


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


def muon_dimensions(params):
    """Per parameter, how Muon sees it as matrices: `MuonDimensionNumbers` for a hidden matrix (a
    parameter marked `matrix=(n_in, n_out)` by `arch.layers.param`, not in the output head, not a
    `MixingParam`), None for the rest, which AdamW updates. Axes before the matrix's own (the
    stacked layers, experts) are a batch of matrices orthogonalized one by one. Leaves that an
    enclosing `optax.partition` masked out are None."""

    def dimensions(path, variable):
        n_in, n_out = variable.get_metadata().get("matrix", (0, 0))
        top = getattr(path[0], "key", None) if path else None
        if (not n_in or top in HEAD_MODULES or isinstance(variable, MixingParam)
                or not hasattr(variable[...], "ndim")):
            return None
        first = variable[...].ndim - n_in - n_out
        return MuonDimensionNumbers(tuple(range(first, first + n_in)),
                                    tuple(range(first + n_in, first + n_in + n_out)))

    return jax.tree_util.tree_map_with_path(
        dimensions, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(opt, steps: int, mask=None) -> optax.GradientTransformation:
    """`optimizer.name="adamw"`: AdamW with `schedule` and clipping. The weight-decay `mask`
    defaults to `decay_mask` of the parameters (nnx.Variables); pass a tree of booleans to
    optimize a plain pytree instead (e.g. `nnx.to_pure_dict(decay_mask(opt, params))` for the
    reference model).

    `optimizer.name="muon"` (Jordan et al. 2024, "Muon"; as scaled in Liu et al. 2025, "Muon is
    Scalable for LLM Training", the optimizer of Kimi Linear): `optax.contrib.muon` on the hidden
    matrices (`muon_dimensions`): Nesterov momentum β = `muon_momentum`, orthogonalized by five
    Newton–Schulz iterations, scaled by √max(fan_in, fan_out)·`muon_rms` to update RMS muon_rms
    (0.2 matches AdamW's, so one learning rate and weight decay serve both), then decoupled
    weight decay; AdamW (with the decay mask) on embeddings, head, norms, biases, mixing weights
    and every other parameter. Both follow `schedule` after one global-norm clip. Cost: five
    Newton–Schulz steps per matrix per step, O(m·n·min(m, n)) each; one momentum buffer (AdamW:
    two). Muon needs nnx.Variable parameters (it reads their `matrix` metadata)."""
    learning_rate = schedule(opt, steps)
    adamw = optax.adamw(learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                        weight_decay=opt.weight_decay,
                        mask=mask if mask is not None else lambda p: decay_mask(opt, p))
    if opt.get("name", "adamw") == "muon":
        if mask is not None:
            raise ValueError("optimizer.name='muon' reads the parameters' matrix metadata: pass "
                             "nnx.Variable parameters, not a plain pytree with a mask")
        muon = optax.contrib.muon(learning_rate, beta=opt.muon_momentum, eps=opt.eps,
                                  weight_decay=opt.weight_decay, consistent_rms=opt.muon_rms,
                                  muon_weight_dimension_numbers=muon_dimensions)

        def labels(params):
            return jax.tree.map(lambda dims, variable: variable.replace(
                "adamw" if dims is None else "muon"), muon_dimensions(params), params,
                is_leaf=lambda x: x is None or isinstance(x, (MuonDimensionNumbers,
                                                              nnx.Variable)))

        transform = optax.partition({"muon": muon, "adamw": adamw}, labels)
    else:
        transform = adamw
    if opt.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(opt.grad_clip), transform)
    return transform
