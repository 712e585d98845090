"""Model configuration: validation and derived fields, before anything is built or compiled."""

from __future__ import annotations

from arch.attention import ATTENTION
from arch.attention_kernels import IMPLEMENTATIONS
from arch.branch_scale import BRANCH_SCALES, default_multiplier, layerscale_init
from arch.dropout import SITES
from arch.ffn import ACTIVATIONS, FFN_WIDTHS, FFNS, hidden_width
from arch.heads import HEADS
from arch.init import INITS
from arch.norms import NORMS
from arch.positions import POSITIONS
from arch.registry import Registry
from arch.remat import REMAT_POLICIES, host_offload_supported
from arch.residual import RESIDUALS
from config import ConfigError, check, lookup, registered
from config.defaults import INIT_GROUPS
from config.derived import DELTANET, PATTERN_LETTERS, blocks_per_unit, layer_attentions
from sharding.sequence import SEQUENCE_ATTENTIONS


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_choice(field: str, value, registry: Registry) -> None:
    registered.check_choice(field, value, registry.family, registry)


def resolve_model(cfg) -> None:
    """Validate `cfg` (the `model` ConfigDict) in place and fill in its derived fields:
    `attention.head_dim` (from `attention.width` or d / h) and `ffn.d_ff`
    (`arch.ffn.hidden_width`)."""
    for field, registry in (("attention.name", ATTENTION), ("norm.name", NORMS),
                            ("position.name", POSITIONS), ("ffn.name", FFNS),
                            ("ffn.activation", ACTIVATIONS), ("residual.name", RESIDUALS),
                            ("head.name", HEADS)):
        check_choice(f"model.{field}", lookup(cfg, field), registry)
    for group in ("default", *INIT_GROUPS):
        if group != "default" and cfg.init[group] is None:
            continue
        check_choice(f"model.init.{group}", cfg.init[group], INITS)
    check(cfg.dtype in ("float32", "bfloat16"), "model.dtype", cfg.dtype, "use float32 or bfloat16")
    check(isinstance(cfg.norm.gated_rank, int) and cfg.norm.gated_rank > 0,
          "model.norm.gated_rank", cfg.norm.gated_rank, "must be a positive integer")
    check(0 <= cfg.norm.batchnorm_momentum < 1, "model.norm.batchnorm_momentum",
          cfg.norm.batchnorm_momentum, "must be in [0, 1)")
    check(cfg.norm.dyt_alpha_init > 0, "model.norm.dyt_alpha_init", cfg.norm.dyt_alpha_init,
          "must be positive")
    check(not cfg.fixnorm or cfg.head.name == "tied", "model.fixnorm", cfg.fixnorm,
          "FixNorm is used with a tied output head; set model.head.name='tied' (got "
          f"{cfg.head.name!r})")
    check(cfg.fixnorm_scale is None or cfg.fixnorm_scale > 0, "model.fixnorm_scale",
          cfg.fixnorm_scale, "must be positive (or None: unit-length rows)")
    for field in ("vocab_size", "d_model", "num_layers", "attention.num_heads",
                  "attention.num_kv_heads"):
        value = lookup(cfg, field)
        check(isinstance(value, int) and value > 0, f"model.{field}", value,
              "must be a positive integer")
    h, h_kv, d = cfg.attention.num_heads, cfg.attention.num_kv_heads, cfg.d_model
    check(h % h_kv == 0, "model.attention.num_kv_heads", h_kv,
          f"must divide model.attention.num_heads={h}; valid: {_divisors(h)}")
    attention = cfg.attention
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
    check(isinstance(attention.window, int) and attention.window >= 0, "model.attention.window",
          attention.window, "must be a non-negative integer (0: full causal attention)")
    if cfg.position.name == "rope":
        check(cfg.attention.head_dim % 2 == 0, "model.attention.head_dim", cfg.attention.head_dim,
              "RoPE needs an even head width")
    if cfg.attention.name == "mla":
        _resolve_mla(cfg)
    check(cfg.ffn.width in FFN_WIDTHS, "model.ffn.width", cfg.ffn.width,
          f"valid widths: {', '.join(FFN_WIDTHS)}")
    check(isinstance(cfg.ffn.multiple_of, int) and cfg.ffn.multiple_of > 0,
          "model.ffn.multiple_of", cfg.ffn.multiple_of, "must be a positive integer")
    if cfg.ffn.d_ff is None:
        cfg.ffn.d_ff = hidden_width(cfg)  # ffn.ratio·d, or matched to the two-projection FFN
    check(cfg.ffn.d_ff > 0, "model.ffn.d_ff", cfg.ffn.d_ff, "must be positive")
    if cfg.linear_bias:  # biases exist in MultiHeadAttention and the dense FFNs only
        check(cfg.attention.name == "mha", "model.linear_bias", True,
              f"model.attention.name={cfg.attention.name!r} has no biases; use "
              "attention.name='mha' or linear_bias=False")
        check(not cfg.use_ffn or cfg.ffn.name != "moe", "model.linear_bias", True,
              "model.ffn.name='moe' has no biases; use a dense model.ffn.name or linear_bias=False")
    check(isinstance(cfg.head.mos_components, int) and cfg.head.mos_components >= 1,
          "model.head.mos_components", cfg.head.mos_components, "must be an integer ≥ 1")
    check(isinstance(cfg.head.mtp_depth, int) and cfg.head.mtp_depth >= 0,
          "model.head.mtp_depth", cfg.head.mtp_depth,
          "must be an integer ≥ 0 (0: no multi-token prediction)")
    check(cfg.head.mtp_weight >= 0, "model.head.mtp_weight", cfg.head.mtp_weight,
          "must be non-negative")
    if cfg.ffn.name == "moe":  # arch/moe.py
        _resolve_moe(cfg)
    _resolve_branch(cfg)
    _resolve_layer_pattern(cfg)  # hybrid stacks, Gated DeltaNet (arch/deltanet.py)
    if cfg.reversible:  # arch/reversible.py
        _resolve_reversible(cfg)
    for site in SITES:  # arch/dropout.py
        rate = cfg.dropout[site]
        check(isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate < 1,
              f"model.dropout.{site}", rate, "must be a rate in [0, 1)")
    _resolve_loop(cfg)
    resolve_residual = getattr(RESIDUALS[cfg.residual.name], "resolve", None)
    if resolve_residual is not None:  # the mechanism's own fields (e.g. arch/attnres.py)
        resolve_residual(cfg)


def resolve_execution(execution) -> None:
    """Check the `execution` section: the attention kernel and its tile, sequence attention, the
    remat policy (arch/remat.py) and the layer scan's unroll. The pipeline fields are checked with
    the mesh (`sharding.pipeline.validate_pipeline`)."""
    check(execution.attention_implementation in IMPLEMENTATIONS,
          "execution.attention_implementation", execution.attention_implementation,
          f"valid: {', '.join(IMPLEMENTATIONS)}")
    for field in ("attention_chunk", "scan_unroll"):
        check(isinstance(execution[field], int) and execution[field] > 0, f"execution.{field}",
              execution[field], "must be a positive integer")
    check(execution.sequence_attention in SEQUENCE_ATTENTIONS, "execution.sequence_attention",
          execution.sequence_attention, f"valid: {', '.join(SEQUENCE_ATTENTIONS)}")
    check(execution.remat in REMAT_POLICIES, "execution.remat", execution.remat,
          f"valid: {', '.join(REMAT_POLICIES)}")
    check(execution.remat != "offload" or host_offload_supported(), "execution.remat",
          execution.remat, "the default device has no pinned_host memory to offload to; use "
          "save_attention_and_ffn_outputs")


def _resolve_mla(cfg) -> None:
    """Multi-head latent attention fields (`arch.attention.MultiHeadLatentAttention`)."""
    mla = cfg.mla
    for field in ("nope_dim", "v_dim"):
        if mla[field] is None:
            mla[field] = cfg.attention.head_dim
    for field in ("kv_rank", "rope_dim", "nope_dim", "v_dim"):
        check(isinstance(mla[field], int) and mla[field] > 0, f"model.mla.{field}", mla[field],
              "must be a positive integer")
    check(isinstance(cfg.mla.q_rank, int) and cfg.mla.q_rank >= 0, "model.mla.q_rank",
          cfg.mla.q_rank, "must be a non-negative integer (0: full-rank query projection)")
    check(cfg.mla.rope_dim % 2 == 0, "model.mla.rope_dim", cfg.mla.rope_dim,
          "the decoupled rotary key/query width must be even (RoPE rotates feature pairs)")


def _resolve_loop(cfg) -> None:
    """Looped depth (`TransformerLM._loop`): the stack applied `loop_count` times; a residual
    state that is the hidden state itself (the depth-attention histories and multi-stream
    states are sized and parameterized for one pass), and no reversible coupling."""
    loops = cfg.loop_count
    check(isinstance(loops, int) and loops >= 1, "model.loop_count", loops,
          "must be a positive integer (1: no looping)")
    check(isinstance(cfg.loop_inject, bool), "model.loop_inject", cfg.loop_inject,
          "must be True or False")
    if loops == 1:
        return
    single = sorted(name for name, mechanism in RESIDUALS.items() if mechanism.single_stream)
    check(cfg.residual.name in single, "model.loop_count", loops,
          f"looped depth needs a single-stream model.residual.name ({', '.join(single)}); got "
          f"{cfg.residual.name!r}")
    check(not cfg.reversible, "model.loop_count", loops,
          "looped depth does not run reversible blocks; set model.reversible=False")


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
        check(isinstance(dn[field], int) and dn[field] > 0, f"model.deltanet.{field}", dn[field],
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


def _resolve_moe(cfg) -> None:
    """Mixture-of-experts fields (`arch.moe.MixtureOfExperts`); fills `moe.d_ff` (default d_ff)."""
    check(isinstance(cfg.moe.every, int) and cfg.moe.every >= 1
          and cfg.num_layers % cfg.moe.every == 0, "model.moe.every", cfg.moe.every,
          f"must be a positive divisor of model.num_layers={cfg.num_layers}")
    check(cfg.moe.dense_ffn in FFNS and cfg.moe.dense_ffn != "moe", "model.moe.dense_ffn",
          cfg.moe.dense_ffn, f"valid dense ffns: {', '.join(sorted(set(FFNS) - {'moe'}))}")
    check(isinstance(cfg.moe.experts, int) and cfg.moe.experts >= 1, "model.moe.experts",
          cfg.moe.experts, "must be a positive integer")
    check(isinstance(cfg.moe.top_k, int) and 1 <= cfg.moe.top_k <= cfg.moe.experts,
          "model.moe.top_k", cfg.moe.top_k,
          f"must be an integer in [1, model.moe.experts={cfg.moe.experts}]")
    check(cfg.moe.expert_ffn in FFNS and cfg.moe.expert_ffn != "moe", "model.moe.expert_ffn",
          cfg.moe.expert_ffn, f"valid: {', '.join(sorted(set(FFNS) - {'moe'}))}")
    check(cfg.moe.capacity_factor > 0, "model.moe.capacity_factor", cfg.moe.capacity_factor,
          "must be positive")
    check(isinstance(cfg.moe.shared_experts, int) and cfg.moe.shared_experts >= 0,
          "model.moe.shared_experts", cfg.moe.shared_experts, "must be a non-negative integer")
    for field in ("balance_coef", "z_coef"):
        check(cfg.moe[field] >= 0, f"model.moe.{field}", cfg.moe[field], "must be non-negative")
    if cfg.moe.d_ff is None:
        cfg.moe.d_ff = cfg.ffn.d_ff
    check(isinstance(cfg.moe.d_ff, int) and cfg.moe.d_ff > 0, "model.moe.d_ff", cfg.moe.d_ff,
          "must be a positive integer")
