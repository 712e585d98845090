"""The rules of the `model` and `execution` sections: every field's type and range, and every
rule between fields (heads divide the width, a residual mechanism's options, what reversible
blocks need, ...), run by `config.resolve` before JAX loads.

`resolve_model` also fills the derived fields that are arithmetic on the config: the attention
head width and width, the MLA and Gated DeltaNet widths, the FFN and expert widths, the branch
scale's default. What a rule needs to know of a component (an FFN's projection count, which
residual mechanisms carry one stream) is its record in `config.catalogue`.

A component's options are a section of `config/defaults.py`; their rules are the function its
record names (`config.catalogue`, `config.component_rules`). Rules ask the records for
capabilities and never compare component names. Imports only `config`.
"""

from __future__ import annotations

import math

from config import ConfigError, check, is_int
from config.catalogue import (
    LINEAR_BIAS,
    REVERSIBLE,
    SINGLE_STREAM,
    TIES_EMBEDDING,
    check_names,
    has,
    letters,
    limit,
    record,
    with_capability,
)
from config.component_rules import divisors as _divisors
from config.component_rules import positive_int as _positive_int
from config.derived import ATTENTION_LETTER, blocks_per_unit, components_in_use, sublayer_count

# Choices of the fields that are not registries.
FFN_WIDTHS = ("ratio", "match_mlp")  # hidden_width
BRANCH_SCALES = ("none", "layerscale", "fixed")  # arch.branch_scale
DROPOUT_SITES = ("embedding", "attention_probs", "attention_output", "ffn_hidden", "residual")
# arch.kernels.attention_implementations
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "blocked", "cudnn", "splash")
SEQUENCE_ATTENTIONS = ("all_gather", "ring")  # sharding.sequence
PIPELINE_SCHEDULES = ("gpipe", "circular")  # sharding.pipeline
PIPELINE_TRANSFERS = ("cached", "full")
DEPTH_READS = ("xla", "pallas")  # arch.kernels.depth_read, arch.kernels.pallas_depth_read
# What a block keeps for its backward pass (arch.remat binds each name to a jax.checkpoint policy).
REMAT_POLICIES: dict[str, str] = {
    # Everything autodiff keeps; no recomputation. Most memory, no extra compute.
    "none": "no checkpoint: every residual of the forward pass is kept",
    # Only the block's inputs; the whole block is recomputed. Least memory, ~one extra forward.
    "full": "only the block's inputs (jax.checkpoint with no policy)",
    # Every matmul output (projections, FFN, and the batched attention scores and mixes);
    # elementwise ops, softmax and norms are recomputed. Between full and none; cheap recompute.
    "dots_saveable": "every matmul output (jax.checkpoint_policies.dots_saveable)",
    # The two sublayer outputs; the sublayers' insides are recomputed. About two B×T×D per block
    # beyond `full`; about `full`'s recompute.
    "save_attention_and_ffn_outputs": "the attention and FFN sublayer outputs "
                                      "(save_only_these_names)",
    # As save_attention_and_ffn_outputs, but the two outputs go to pinned host memory and come
    # back for the backward pass. Device memory as `full`; host transfers instead of recompute.
    "offload": "the attention and FFN sublayer outputs, offloaded to pinned host memory "
               "(save_and_offload_only_these_names)",
}


def layerscale_init(num_layers: int) -> float:
    """CaiT's initial γ by depth (Touvron et al. 2021, §2): 0.1 up to 18 blocks, 1e-5 up to 24,
    1e-6 beyond."""
    return 0.1 if num_layers <= 18 else 1e-5 if num_layers <= 24 else 1e-6


def default_multiplier(cfg) -> float:
    """c = 1/√(number of residual sublayers): 1/√(2L) with FFNs, 1/√L without."""
    return sublayer_count(cfg) ** -0.5


def hidden_width(cfg) -> int:
    """d_ff derived from the `model` section (when `model.ffn.d_ff` is not given).

    `ffn.width="ratio"`: d_ff = ffn.ratio·d. `"match_mlp"`: d_ff = (2 / n)·ffn.ratio·d for an FFN
    with n d × d_ff matrices (its record's `projections`, `config.catalogue`), so that n·d·d_ff
    equals the two-projection FFN's 2·d·(ffn.ratio·d): 2/3 of the ratio for the gated FFNs
    (Shazeer 2020 §2: d_ff 3072 → 2048), unchanged for `mlp`. Rounded to the nearest integer,
    then up to a
    multiple of `ffn.multiple_of`.
    """
    width = cfg.ffn.ratio * cfg.d_model
    if cfg.ffn.width == "match_mlp":
        width *= 2 / record("ffn", cfg.ffn.name).projections
    multiple = cfg.ffn.multiple_of
    return multiple * math.ceil(int(round(width)) / multiple)


def resolve_model(cfg) -> None:
    """Check the `model` section (`cfg`): its component names (`config.catalogue`) and every
    rule, and fill the derived fields; `ConfigError` in one line naming the field, the value and
    the fix."""
    check_names(cfg)
    check(is_int(cfg.vocab_size) and cfg.vocab_size > 0, "model.vocab_size", cfg.vocab_size,
          "must be a positive integer")
    check(cfg.dtype in ("float32", "bfloat16"), "model.dtype", cfg.dtype, "use float32 or bfloat16")
    eps = cfg.norm.eps
    check(isinstance(eps, int | float) and not isinstance(eps, bool) and math.isfinite(eps)
          and eps > 0, "model.norm.eps", eps,
          "must be a finite number > 0 (it keeps the norm's division away from zero), e.g. 1e-6")
    check(_positive_int(cfg.norm.gated_rank), "model.norm.gated_rank", cfg.norm.gated_rank,
          "must be a positive integer")
    check(0 <= cfg.norm.batchnorm_momentum < 1, "model.norm.batchnorm_momentum",
          cfg.norm.batchnorm_momentum, "must be in [0, 1)")
    check(cfg.norm.dyt_alpha_init > 0, "model.norm.dyt_alpha_init", cfg.norm.dyt_alpha_init,
          "must be positive")
    tied = ", ".join(repr(name) for name in with_capability("head", TIES_EMBEDDING))
    check(not cfg.fixnorm or has("head", cfg.head.name, TIES_EMBEDDING), "model.fixnorm",
          cfg.fixnorm, f"FixNorm is used with a tied output head; set model.head.name={tied} "
          f"(got {cfg.head.name!r})")
    check(cfg.fixnorm_scale is None or cfg.fixnorm_scale > 0, "model.fixnorm_scale",
          cfg.fixnorm_scale, "must be positive (or None: unit-length rows)")
    for field in ("d_model", "num_layers"):  # vocab_size 0 is the tokenizer's, filled later
        check(_positive_int(cfg[field]), f"model.{field}", cfg[field], "must be a positive integer")
    _resolve_attention(cfg)
    _check_layer_pattern(cfg)
    ffn = cfg.ffn
    check(ffn.width in FFN_WIDTHS, "model.ffn.width", ffn.width,
          f"valid widths: {', '.join(FFN_WIDTHS)}")
    check(_positive_int(ffn.multiple_of), "model.ffn.multiple_of", ffn.multiple_of,
          "must be a positive integer")
    if ffn.d_ff is None:
        ffn.d_ff = hidden_width(cfg)
    check(ffn.d_ff > 0, "model.ffn.d_ff", ffn.d_ff, "must be positive")
    _resolve_head(cfg.head)
    for family, name in components_in_use(cfg):  # each component's own rules (its record)
        rules = record(family, name).rules
        if rules is not None:
            rules(cfg)
    if cfg.linear_bias:
        _check_linear_bias(cfg)
    _resolve_branch(cfg)
    _resolve_layer_pattern(cfg)
    if cfg.reversible:
        _resolve_reversible(cfg)
    for site in DROPOUT_SITES:  # arch/dropout.py
        rate = cfg.dropout[site]
        check(isinstance(rate, int | float) and not isinstance(rate, bool) and 0 <= rate < 1,
              f"model.dropout.{site}", rate, "must be a rate in [0, 1)")
    check(_positive_int(cfg.loop_count), "model.loop_count", cfg.loop_count,
          "must be a positive integer (1: no looping)")
    check(isinstance(cfg.loop_inject, bool), "model.loop_inject", cfg.loop_inject,
          "must be True or False")
    check(cfg.loop_count == 1 or not cfg.reversible, "model.loop_count", cfg.loop_count,
          "looped depth does not run reversible blocks; set model.reversible=False")
    check(cfg.loop_count == 1 or has("residual", cfg.residual.name, SINGLE_STREAM),
          "model.loop_count", cfg.loop_count, "looped depth needs a single-stream "
          f"model.residual.name ({', '.join(with_capability('residual', SINGLE_STREAM))}); got "
          f"{cfg.residual.name!r} (the depth-attention histories and multi-stream states are "
          "sized and parameterized for one pass)")


def _check_linear_bias(cfg) -> None:
    """`model.linear_bias` needs every token mixer and the FFN to have biases to add."""
    for family, name in components_in_use(cfg):
        if family not in ("attention", "ffn") or (family == "ffn" and not cfg.use_ffn):
            continue
        valid = ", ".join(repr(other) for other in with_capability(family, LINEAR_BIAS))
        path = {"attention": "attention.name", "ffn": "ffn.name"}[family]
        check(has(family, name, LINEAR_BIAS), "model.linear_bias", True,
              f"model.{path}={name!r} has no biases; use {path}={valid} or linear_bias=False")


def check_execution(execution) -> None:
    """Check the `execution` section: the attention kernel and its tile, sequence attention, the
    remat policy, AttnRes's depth read, the layer scan's unroll and the pipeline's fields (what
    they ask of the mesh: `config.resolve`; host offload, a property of the devices:
    `train.step.build_program`)."""
    check(execution.attention_implementation in ATTENTION_IMPLEMENTATIONS,
          "execution.attention_implementation", execution.attention_implementation,
          f"valid: {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    for field in ("attention_chunk", "scan_unroll"):
        check(_positive_int(execution[field]), f"execution.{field}", execution[field],
              "must be a positive integer")
    check(execution.sequence_attention in SEQUENCE_ATTENTIONS, "execution.sequence_attention",
          execution.sequence_attention, f"valid: {', '.join(SEQUENCE_ATTENTIONS)}")
    check(execution.remat in REMAT_POLICIES, "execution.remat", execution.remat,
          f"valid: {', '.join(REMAT_POLICIES)}")
    check(execution.depth_read in DEPTH_READS, "execution.depth_read", execution.depth_read,
          f"valid: {', '.join(DEPTH_READS)}")
    pipeline = execution.pipeline
    check(pipeline.schedule in PIPELINE_SCHEDULES, "execution.pipeline.schedule",
          pipeline.schedule, f"valid schedules: {', '.join(PIPELINE_SCHEDULES)}")
    for field in ("microbatches", "virtual_stages"):
        check(_positive_int(pipeline[field]), f"execution.pipeline.{field}", pipeline[field],
              "must be a positive integer")
    check(pipeline.transfer in PIPELINE_TRANSFERS, "execution.pipeline.transfer",
          pipeline.transfer, f"valid: {', '.join(PIPELINE_TRANSFERS)}")
    check(pipeline.schedule == "circular" or pipeline.virtual_stages == 1,
          "execution.pipeline.virtual_stages", pipeline.virtual_stages,
          "gpipe runs one chunk per device; use 1 or execution.pipeline.schedule='circular'")


def _resolve_attention(cfg) -> None:
    """Head counts, and `attention.head_dim` (from `attention.width` or d / h) and `width`."""
    attention, d = cfg.attention, cfg.d_model
    for field in ("num_heads", "num_kv_heads"):
        check(_positive_int(attention[field]), f"model.attention.{field}", attention[field],
              "must be a positive integer")
    h, h_kv = attention.num_heads, attention.num_kv_heads
    check(h % h_kv == 0, "model.attention.num_kv_heads", h_kv,
          f"must divide model.attention.num_heads={h}; valid: {_divisors(h)}")
    width, p = attention.width, attention.head_dim
    if p is None:
        width = width or d
        check(width % h == 0, "model.attention.num_heads", h,
              f"must divide the attention width {width}; valid: {_divisors(width)}")
        attention.head_dim = p = width // h
    elif h * p != (width or d):
        raise ConfigError(
            f"model.attention.head_dim={p} gives h·p = {h}·{p} = {h * p} "
            f"≠ {'model.attention.width' if width else 'model.d_model'}={width or d}; set "
            f"model.attention.width={h * p} to use an attention width different from d")
    attention.width = h * p
    check(is_int(attention.window) and attention.window >= 0, "model.attention.window",
          attention.window, "must be a non-negative integer (0: full causal attention)")


def _resolve_head(head) -> None:
    check(_positive_int(head.mos_components), "model.head.mos_components", head.mos_components,
          "must be an integer ≥ 1")
    check(is_int(head.mtp_depth) and head.mtp_depth >= 0, "model.head.mtp_depth",
          head.mtp_depth, "must be an integer ≥ 0 (0: no multi-token prediction)")
    check(head.mtp_weight >= 0, "model.head.mtp_weight", head.mtp_weight, "must be non-negative")






def _resolve_branch(cfg) -> None:
    """Branch scaling (`arch.branch_scale`): fills the chosen scale's default, LayerScale's γ₀
    or the fixed multiplier c (the other stays as given, so a run without branch scaling keeps
    the config it was saved with)."""
    branch = cfg.branch_scale
    check(branch.name in BRANCH_SCALES, "model.branch_scale.name", branch.name,
          f"valid: {', '.join(BRANCH_SCALES)}")
    if branch.name == "layerscale" and branch.layerscale_init is None:
        branch.layerscale_init = layerscale_init(cfg.num_layers)
    if branch.name == "fixed" and branch.multiplier is None:
        branch.multiplier = default_multiplier(cfg)
    for field in ("layerscale_init", "multiplier"):
        check(branch[field] is None or branch[field] > 0, f"model.branch_scale.{field}",
              branch[field], "must be positive")


def _check_layer_pattern(cfg) -> None:
    """`model.layer_pattern` (hybrid stacks): a string over "A" (`model.attention.name`) and the
    letters the token mixers' records declare (`config.catalogue.letters`)."""
    pattern, mixers = cfg.layer_pattern, letters()
    valid = (ATTENTION_LETTER, *sorted(mixers))
    meanings = ", ".join(f"{letter}: {name}" for letter, name in sorted(mixers.items()))
    check(isinstance(pattern, str) and set(pattern) <= set(valid),
          "model.layer_pattern", pattern,
          f"a string over {', '.join(valid)} ({meanings}, {ATTENTION_LETTER}: "
          "model.attention.name), e.g. 'LLLA'; '' for one attention in every block")


def _resolve_layer_pattern(cfg) -> None:
    """What a hybrid stack's layer scan needs: whole patterns (and MoE groups) per step."""
    pattern = cfg.layer_pattern
    unit = blocks_per_unit(cfg)
    check(cfg.num_layers % unit == 0, "model.layer_pattern", pattern,
          f"model.num_layers={cfg.num_layers} must be a multiple of "
          + (f"the pattern's length {len(pattern)}" if unit == len(pattern) else
             f"lcm(len(layer_pattern), moe.every) = {unit}"))
    if pattern:
        check(not cfg.reversible, "model.layer_pattern", pattern,
              "reversible blocks run a uniform stack; set layer_pattern='' or reversible=False")


def _resolve_reversible(cfg) -> None:
    """Reversible blocks (`arch.reversible`) couple a stateless attention and FFN around one
    stream: every component in use declares the `reversible` capability."""
    valid = ", ".join(repr(name) for name in with_capability("residual", REVERSIBLE))
    check(has("residual", cfg.residual.name, REVERSIBLE), "model.reversible", True,
          f"reversible blocks need model.residual.name={valid} (got {cfg.residual.name!r})")
    check(cfg.use_ffn, "model.reversible", True,
          "reversible blocks couple attention with an FFN; set model.use_ffn=True")
    check(has("norm", cfg.norm.name, REVERSIBLE), "model.reversible", True,
          f"{limit('norm', cfg.norm.name, REVERSIBLE)} of model.norm.name={cfg.norm.name!r}; "
          "use a stateless norm")
    check(has("ffn", cfg.ffn.name, REVERSIBLE), "model.reversible", True,
          f"{limit('ffn', cfg.ffn.name, REVERSIBLE)}; use a dense model.ffn.name")
    check(cfg.branch_scale.name == BRANCH_SCALES[0], "model.reversible", True,
          f"reversible blocks do not scale their branches; set model.branch_scale.name="
          f"{BRANCH_SCALES[0]!r} (got {cfg.branch_scale.name!r})")
