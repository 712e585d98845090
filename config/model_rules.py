"""The rules of the `model` and `execution` sections: every field's type and range, and every
rule between fields (heads divide the width, a residual mechanism's options, what reversible
blocks need, ...), run by `config.resolve` before JAX loads.

`resolve_model` also fills the derived fields that are arithmetic on the config: the attention
head width and width, the MLA and Gated DeltaNet widths, the FFN and expert widths, the branch
scale's default. What a rule needs to know of a component (an FFN's projection count, which
residual mechanisms carry one stream) is in `config.catalogue`.

A residual mechanism's options are a section of `config/defaults.py`; their rules are a function
in `RESIDUAL_RULES`, under the mechanism's registered name. Imports only `config`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from config import ConfigError, check, is_int
from config.catalogue import FFN_PROJECTIONS, SINGLE_STREAM_RESIDUALS, check_names, names
from config.derived import (
    DELTANET,
    PATTERN_LETTERS,
    blocks_per_unit,
    layer_attentions,
    sublayer_count,
)

# Choices of the fields that are not registries.
FFN_WIDTHS = ("ratio", "match_mlp")  # hidden_width
BRANCH_SCALES = ("none", "layerscale", "fixed")  # arch.branch_scale
DROPOUT_SITES = ("embedding", "attention_probs", "attention_output", "ffn_hidden", "residual")
ATTNRES_WEIGHTS = ("softmax", "sigmoid", "static")  # arch.attnres
ATTNRES_QUERIES = ("static", "input")
GR_STATE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")  # arch.gated_residual
GR_INITS = ("graded", "random")
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


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _positive_int(value) -> bool:
    return is_int(value) and value > 0


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
    with n d × d_ff matrices (`config.catalogue.FFN_PROJECTIONS`), so that n·d·d_ff equals the
    two-projection FFN's 2·d·(ffn.ratio·d): 2/3 of the ratio for the gated FFNs (Shazeer 2020
    §2: d_ff 3072 → 2048), unchanged for `mlp`. Rounded to the nearest integer, then up to a
    multiple of `ffn.multiple_of`.
    """
    width = cfg.ffn.ratio * cfg.d_model
    if cfg.ffn.width == "match_mlp":
        width *= 2 / FFN_PROJECTIONS[cfg.ffn.name]
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
    check(not cfg.fixnorm or cfg.head.name == "tied", "model.fixnorm", cfg.fixnorm,
          "FixNorm is used with a tied output head; set model.head.name='tied' (got "
          f"{cfg.head.name!r})")
    check(cfg.fixnorm_scale is None or cfg.fixnorm_scale > 0, "model.fixnorm_scale",
          cfg.fixnorm_scale, "must be positive (or None: unit-length rows)")
    for field in ("d_model", "num_layers"):  # vocab_size 0 is the tokenizer's, filled later
        check(_positive_int(cfg[field]), f"model.{field}", cfg[field], "must be a positive integer")
    _resolve_attention(cfg)
    if cfg.position.name == "rope":
        check(cfg.attention.head_dim % 2 == 0, "model.attention.head_dim", cfg.attention.head_dim,
              "RoPE needs an even head width")
    if cfg.attention.name == "mla":
        _resolve_mla(cfg)
    ffn = cfg.ffn
    check(ffn.width in FFN_WIDTHS, "model.ffn.width", ffn.width,
          f"valid widths: {', '.join(FFN_WIDTHS)}")
    check(_positive_int(ffn.multiple_of), "model.ffn.multiple_of", ffn.multiple_of,
          "must be a positive integer")
    if ffn.d_ff is None:
        ffn.d_ff = hidden_width(cfg)
    check(ffn.d_ff > 0, "model.ffn.d_ff", ffn.d_ff, "must be positive")
    if cfg.linear_bias:  # biases exist in MultiHeadAttention and the dense FFNs only
        check(cfg.attention.name == "mha", "model.linear_bias", True,
              f"model.attention.name={cfg.attention.name!r} has no biases; use "
              "attention.name='mha' or linear_bias=False")
        check(not cfg.use_ffn or ffn.name != "moe", "model.linear_bias", True,
              "model.ffn.name='moe' has no biases; use a dense model.ffn.name or linear_bias=False")
    _resolve_head(cfg.head)
    if ffn.name == "moe":
        _resolve_moe(cfg)
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
    check(cfg.loop_count == 1 or cfg.residual.name in SINGLE_STREAM_RESIDUALS, "model.loop_count",
          cfg.loop_count, "looped depth needs a single-stream model.residual.name "
          f"({', '.join(sorted(SINGLE_STREAM_RESIDUALS))}); got {cfg.residual.name!r} (the "
          "depth-attention histories and multi-stream states are sized and parameterized for "
          "one pass)")
    rules = RESIDUAL_RULES.get(cfg.residual.name)
    if rules is not None:
        rules(cfg)


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


def _resolve_mla(cfg) -> None:
    """Multi-head latent attention fields (`arch.attention.MultiHeadLatentAttention`)."""
    mla = cfg.mla
    for field in ("nope_dim", "v_dim"):
        if mla[field] is None:
            mla[field] = cfg.attention.head_dim
    for field in ("kv_rank", "rope_dim", "nope_dim", "v_dim"):
        check(_positive_int(mla[field]), f"model.mla.{field}", mla[field],
              "must be a positive integer")
    check(is_int(mla.q_rank) and mla.q_rank >= 0, "model.mla.q_rank", mla.q_rank,
          "must be a non-negative integer (0: full-rank query projection)")
    check(mla.rope_dim % 2 == 0, "model.mla.rope_dim", mla.rope_dim,
          "the decoupled rotary key/query width must be even (RoPE rotates feature pairs)")


def _resolve_moe(cfg) -> None:
    """Mixture-of-experts fields (`arch.moe.MixtureOfExperts`): the expert and dense FFNs are
    dense FFNs; `moe.d_ff` defaults to `ffn.d_ff`."""
    moe = cfg.moe
    dense = sorted(set(names("ffn")) - {"moe"})
    for field in ("dense_ffn", "expert_ffn"):
        check(moe[field] in dense, f"model.moe.{field}", moe[field],
              f"valid dense ffns: {', '.join(dense)}")
    if moe.d_ff is None:
        moe.d_ff = cfg.ffn.d_ff
    check(_positive_int(moe.every) and cfg.num_layers % moe.every == 0, "model.moe.every",
          moe.every, f"must be a positive divisor of model.num_layers={cfg.num_layers}")
    check(_positive_int(moe.experts), "model.moe.experts", moe.experts,
          "must be a positive integer")
    check(is_int(moe.top_k) and 1 <= moe.top_k <= moe.experts, "model.moe.top_k", moe.top_k,
          f"must be an integer in [1, model.moe.experts={moe.experts}]")
    check(moe.capacity_factor > 0, "model.moe.capacity_factor", moe.capacity_factor,
          "must be positive")
    check(is_int(moe.shared_experts) and moe.shared_experts >= 0, "model.moe.shared_experts",
          moe.shared_experts, "must be a non-negative integer")
    for field in ("balance_coef", "z_coef"):
        check(moe[field] >= 0, f"model.moe.{field}", moe[field], "must be non-negative")
    check(moe.d_ff is None or _positive_int(moe.d_ff), "model.moe.d_ff", moe.d_ff,
          "must be a positive integer")


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


def _resolve_layer_pattern(cfg) -> None:
    """`model.layer_pattern` (hybrid stacks) and, when a block is Gated DeltaNet, the
    `model.deltanet` fields (`arch.deltanet.GatedDeltaNet`; defaults from `model.attention`)."""
    pattern = cfg.layer_pattern
    check(isinstance(pattern, str) and set(pattern) <= set(PATTERN_LETTERS),
          "model.layer_pattern", pattern,
          f"a string over {', '.join(PATTERN_LETTERS)} (L: gated_deltanet, A: "
          "model.attention.name), e.g. 'LLLA'; '' for one attention in every block")
    unit = blocks_per_unit(cfg)
    check(cfg.num_layers % unit == 0, "model.layer_pattern", pattern,
          f"model.num_layers={cfg.num_layers} must be a multiple of "
          + (f"the pattern's length {len(pattern)}" if unit == len(pattern) else
             f"lcm(len(layer_pattern), moe.every) = {unit}"))
    if pattern:
        check(not cfg.reversible, "model.layer_pattern", pattern,
              "reversible blocks run a uniform stack; set layer_pattern='' or reversible=False")
    if DELTANET not in layer_attentions(cfg):
        return
    dn, attention = cfg.deltanet, cfg.attention
    for field, default in (("num_heads", attention.num_heads), ("head_dim", attention.head_dim)):
        if dn[field] is None:
            dn[field] = default
    if dn.value_dim is None:
        dn.value_dim = dn.head_dim
    for field in ("num_heads", "head_dim", "value_dim", "conv_width", "chunk"):
        check(_positive_int(dn[field]), f"model.deltanet.{field}", dn[field],
              "must be a positive integer")
    check(not cfg.linear_bias, "model.linear_bias", True,
          "gated_deltanet blocks have no biases on their projections; set linear_bias=False")


def _resolve_reversible(cfg) -> None:
    """Reversible blocks (`arch.reversible`) couple a Pre-Norm attention and FFN, statelessly."""
    check(cfg.residual.name == "prenorm", "model.reversible", True,
          f"reversible blocks need model.residual.name='prenorm' (got {cfg.residual.name!r})")
    check(cfg.use_ffn, "model.reversible", True,
          "reversible blocks couple attention with an FFN; set model.use_ffn=True")
    check(cfg.norm.name not in ("batchnorm", "causal_batchnorm"), "model.reversible", True,
          "reversible blocks cannot replay running statistics of "
          f"model.norm.name={cfg.norm.name!r}; use a stateless norm")
    check(cfg.ffn.name != "moe", "model.reversible", True,
          "reversible blocks do not carry the MoE auxiliary losses; use a dense model.ffn.name")
    check(cfg.branch_scale.name == "none", "model.reversible", True,
          "reversible blocks do not scale their branches; set model.branch_scale.name='none' "
          f"(got {cfg.branch_scale.name!r})")


# ---------------------------------------------------------------------------------------------
# The residual mechanisms' options (the mechanism: arch/<file> registering the name)


def _attnres(cfg) -> None:
    """attnres, block_attnres (arch/attnres.py)."""
    section = cfg.attnres
    check(_positive_int(section.block_size), "model.attnres.block_size", section.block_size,
          "must be an integer ≥ 1 (sublayers per block)")
    check(section.weights in ATTNRES_WEIGHTS, "model.attnres.weights", section.weights,
          f"valid: {', '.join(ATTNRES_WEIGHTS)}")
    check(section.query in ATTNRES_QUERIES, "model.attnres.query", section.query,
          f"valid: {', '.join(ATTNRES_QUERIES)}")
    check(section.query == "static" or section.weights != "static", "model.attnres.query",
          section.query,
          "static (input-independent) weights use no query; set model.attnres.query='static'"
          " or model.attnres.weights='softmax'/'sigmoid'")
    scale = section.query_scale
    check(scale > 0, "model.attnres.query_scale", scale, "must be positive")
    check(section.query == "input" or scale == 1, "model.attnres.query_scale", scale,
          "scales the input-dependent query only; set model.attnres.query='input'")
    heads, d = section.heads, cfg.d_model
    check(_positive_int(heads) and d % heads == 0, "model.attnres.heads", heads,
          f"must divide model.d_model={d}; valid: {_divisors(d)}")
    check(isinstance(section.key_norm, bool), "model.attnres.key_norm", section.key_norm,
          "must be True or False")
    check(is_int(section.window) and section.window >= 0, "model.attnres.window",
          section.window, "must be an integer ≥ 0 (0: every source)")


def _streams(cfg) -> None:
    """width (arch/hyper.py)."""
    check(_positive_int(cfg.residual.streams), "model.residual.streams", cfg.residual.streams,
          "must be a positive integer (the number of residual streams n)")


def _hyper(cfg) -> None:
    """hc (arch/hyper.py)."""
    _streams(cfg)
    check(isinstance(cfg.residual.dynamic, bool), "model.residual.dynamic", cfg.residual.dynamic,
          "must be True (static + input-dependent weights) or False (static only)")
    if cfg.residual.dynamic:
        check(cfg.hyper.dynamic_scale > 0, "model.hyper.dynamic_scale", cfg.hyper.dynamic_scale,
              "must be positive: with the zero-initialized projections a scale of 0 keeps the "
              "dynamic part at 0 forever; set model.residual.dynamic=False for static weights")


def _mhc(cfg) -> None:
    """mhc (arch/hyper.py)."""
    _hyper(cfg)
    check(_positive_int(cfg.hyper.sinkhorn_iters), "model.hyper.sinkhorn_iters",
          cfg.hyper.sinkhorn_iters,
          "must be a positive integer (the most steps of the Sinkhorn projection)")
    tolerance = cfg.hyper.sinkhorn_tolerance
    check(isinstance(tolerance, int | float) and not isinstance(tolerance, bool)
          and 0 <= tolerance < 1, "model.hyper.sinkhorn_tolerance", tolerance,
          "must be a number in [0, 1): the largest |column sum − 1| of the mixing matrices "
          "(0: as close as float32 gets, in at most model.hyper.sinkhorn_iters steps)")


def _gated_residual(cfg) -> None:
    """gated_residual (arch/gated_residual.py)."""
    n = cfg.residual.streams
    check(is_int(n) and n >= 2, "model.residual.streams", n,
          "gated_residual needs an integer n ≥ 2 branches (one branch: use "
          "residual='prenorm' with norm='gatednorm')")
    gr = cfg.gated_residual
    check(_positive_int(gr.rank), "model.gated_residual.rank", gr.rank,
          "must be a positive integer (rank of the gate predictor)")
    check(gr.state_dtype in GR_STATE_DTYPES, "model.gated_residual.state_dtype", gr.state_dtype,
          f"valid: {', '.join(GR_STATE_DTYPES)}")
    check(isinstance(cfg.residual.dynamic, bool), "model.residual.dynamic",
          cfg.residual.dynamic, "must be a bool")
    for field in ("channelwise", "mixing", "static", "static_frozen"):
        check(isinstance(gr[field], bool), f"model.gated_residual.{field}", gr[field],
              "must be a bool")
    for field in ("channelwise_read", "channelwise_write"):
        check(gr[field] is None or isinstance(gr[field], bool),
              f"model.gated_residual.{field}", gr[field],
              "must be a bool, or None: follow model.gated_residual.channelwise")
    check(gr.static or cfg.residual.dynamic, "model.gated_residual.static", gr.static,
          "removing the static gate term needs model.residual.dynamic=True (with "
          "residual.dynamic=False the gates have no other term)")
    check(gr.static or not gr.static_frozen, "model.gated_residual.static_frozen",
          gr.static_frozen, "freezes the static gate logits, which "
          "model.gated_residual.static=False removes")
    check(gr.init in GR_INITS, "model.gated_residual.init", gr.init,
          f"valid: {', '.join(GR_INITS)}")
    check(gr.init == "graded" or gr.static, "model.gated_residual.init", gr.init,
          "initializes the static write logits, which model.gated_residual.static=False "
          "removes")
    k = gr.read_top_k
    check(is_int(k) and 0 <= k <= n, "model.gated_residual.read_top_k", k,
          f"must be an integer in [0, model.residual.streams={n}] (0: read all branches)")


# A mechanism's option rules, under its registered name (none: no options to check).
RESIDUAL_RULES: dict[str, Callable] = {
    "attnres": _attnres, "block_attnres": _attnres, "hc": _hyper, "mhc": _mhc, "width": _streams,
    "gated_residual": _gated_residual,
}
