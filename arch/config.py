"""Model configuration: validation and derived fields, before anything is built or compiled."""

from __future__ import annotations

from arch.attention import ATTENTION
from arch.attention_kernels import IMPLEMENTATIONS
from arch.ffn import ACTIVATIONS, FFN_WIDTHS, FFNS, hidden_width
from arch.heads import HEADS
from arch.init import INITS
from arch.norms import NORMS
from arch.positions import POSITIONS
from arch.registry import Registry
from arch.remat import REMAT_POLICIES, host_offload_supported
from arch.residual import RESIDUALS
from config import ConfigError, check
from config.defaults import INIT_GROUPS
from sharding.sequence import SEQUENCE_ATTENTIONS


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_choice(field: str, value, registry: Registry) -> None:
    valid = ", ".join(sorted(registry))
    check(value in registry, field, value, f"valid {registry.family}s: {valid}")


def resolve_model(cfg) -> None:
    """Validate `cfg` (the `model` ConfigDict) in place and fill in its derived fields:
    `head_dim` (from `attention_width` or d / h) and `d_ff` (`arch.ffn.hidden_width`)."""
    for field, registry in (("attention", ATTENTION), ("norm", NORMS), ("position", POSITIONS),
                            ("ffn", FFNS), ("activation", ACTIVATIONS), ("residual", RESIDUALS),
                            ("head", HEADS)):
        check_choice(f"model.{field}", cfg[field], registry)
    for group in ("default", *INIT_GROUPS):
        if group != "default" and cfg.init[group] is None:
            continue
        check_choice(f"model.init.{group}", cfg.init[group], INITS)
    check(cfg.dtype in ("float32", "bfloat16"), "model.dtype", cfg.dtype, "use float32 or bfloat16")
    check(cfg.attention_implementation in IMPLEMENTATIONS, "model.attention_implementation",
          cfg.attention_implementation, f"valid: {', '.join(IMPLEMENTATIONS)}")
    check(isinstance(cfg.attention_chunk, int) and cfg.attention_chunk > 0,
          "model.attention_chunk", cfg.attention_chunk, "must be a positive integer")
    check(cfg.sequence_attention in SEQUENCE_ATTENTIONS, "model.sequence_attention",
          cfg.sequence_attention, f"valid: {', '.join(SEQUENCE_ATTENTIONS)}")
    check(isinstance(cfg.gated_norm_rank, int) and cfg.gated_norm_rank > 0,
          "model.gated_norm_rank", cfg.gated_norm_rank, "must be a positive integer")
    check(0 <= cfg.batchnorm_momentum < 1, "model.batchnorm_momentum", cfg.batchnorm_momentum,
          "must be in [0, 1)")
    check(cfg.dyt_alpha_init > 0, "model.dyt_alpha_init", cfg.dyt_alpha_init, "must be positive")
    check(not cfg.fixnorm or cfg.head == "tied", "model.fixnorm", cfg.fixnorm,
          f"FixNorm is used with a tied output head; set model.head='tied' (got {cfg.head!r})")
    check(cfg.fixnorm_scale is None or cfg.fixnorm_scale > 0, "model.fixnorm_scale",
          cfg.fixnorm_scale, "must be positive (or None: unit-length rows)")
    _resolve_remat(cfg)
    for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                  "scan_unroll"):
        check(isinstance(cfg[field], int) and cfg[field] > 0, f"model.{field}", cfg[field],
              "must be a positive integer")
    h, h_kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.d_model
    check(h % h_kv == 0, "model.num_kv_heads", h_kv,
          f"must divide model.num_heads={h}; valid: {_divisors(h)}")
    width = cfg.attention_width
    if cfg.head_dim is None:
        width = width or d
        check(width % h == 0, "model.num_heads", h,
              f"must divide the attention width {width}; valid: {_divisors(width)}")
        cfg.head_dim = width // h
    elif h * cfg.head_dim != (width or d):
        raise ConfigError(
            f"model.head_dim={cfg.head_dim} gives h·p = {h}·{cfg.head_dim} = {h * cfg.head_dim} "
            f"≠ {'model.attention_width' if width else 'model.d_model'}={width or d}; set "
            f"model.attention_width={h * cfg.head_dim} to use an attention width different from d")
    cfg.attention_width = h * cfg.head_dim
    if cfg.position == "rope":
        check(cfg.head_dim % 2 == 0, "model.head_dim", cfg.head_dim,
              "RoPE needs an even head width")
    if cfg.attention == "mla":
        _resolve_mla(cfg)
    check(cfg.ffn_width in FFN_WIDTHS, "model.ffn_width", cfg.ffn_width,
          f"valid widths: {', '.join(FFN_WIDTHS)}")
    check(isinstance(cfg.ffn_multiple_of, int) and cfg.ffn_multiple_of > 0,
          "model.ffn_multiple_of", cfg.ffn_multiple_of, "must be a positive integer")
    if cfg.d_ff is None:
        cfg.d_ff = hidden_width(cfg)  # ffn_ratio·d, or matched to the two-projection FFN
    check(cfg.d_ff > 0, "model.d_ff", cfg.d_ff, "must be positive")
    if cfg.linear_bias:  # biases exist in MultiHeadAttention and the dense FFNs only
        check(cfg.attention == "mha", "model.linear_bias", True,
              f"model.attention={cfg.attention!r} has no biases; use attention='mha' or "
              "linear_bias=False")
        check(not cfg.use_ffn or cfg.ffn != "moe", "model.linear_bias", True,
              "model.ffn='moe' has no biases; use a dense model.ffn or linear_bias=False")
    check(isinstance(cfg.mos_components, int) and cfg.mos_components >= 1,
          "model.mos_components", cfg.mos_components, "must be an integer ≥ 1")
    if cfg.ffn == "moe":  # arch/moe.py
        _resolve_moe(cfg)
    if cfg.reversible:  # arch/reversible.py
        _resolve_reversible(cfg)
    resolve_residual = getattr(RESIDUALS[cfg.residual], "resolve", None)
    if resolve_residual is not None:  # the mechanism's own fields (e.g. arch/attnres.py)
        resolve_residual(cfg)


def _resolve_remat(cfg) -> None:
    """`model.remat_policy` (arch/remat.py) from itself or `model.remat`: None resolves to `full`
    when `remat=True`, else `none`; `remat=True` with `none` contradicts itself. Afterwards
    `remat` is True exactly when a policy other than `none` is applied."""
    policy = cfg.get("remat_policy")  # absent from configs saved before the field
    if policy is None:
        policy = "full" if cfg.remat else "none"
    check(policy in REMAT_POLICIES, "model.remat_policy", policy,
          f"valid: {', '.join(REMAT_POLICIES)}")
    check(not (cfg.remat and policy == "none"), "model.remat_policy", policy,
          "contradicts model.remat=True; set remat_policy=full (or another policy) or remat=False")
    check(policy != "offload" or host_offload_supported(), "model.remat_policy", policy,
          "the default device has no pinned_host memory to offload to; use "
          "save_attention_and_ffn_outputs")
    cfg.remat_policy = policy
    cfg.remat = policy != "none"


def _resolve_mla(cfg) -> None:
    """Multi-head latent attention fields (`arch.attention.MultiHeadLatentAttention`)."""
    for field in ("mla_nope_dim", "mla_v_dim"):
        if cfg[field] is None:
            cfg[field] = cfg.head_dim
    for field in ("mla_kv_rank", "mla_rope_dim", "mla_nope_dim", "mla_v_dim"):
        check(isinstance(cfg[field], int) and cfg[field] > 0, f"model.{field}", cfg[field],
              "must be a positive integer")
    check(isinstance(cfg.mla_q_rank, int) and cfg.mla_q_rank >= 0, "model.mla_q_rank",
          cfg.mla_q_rank, "must be a non-negative integer (0: full-rank query projection)")
    check(cfg.mla_rope_dim % 2 == 0, "model.mla_rope_dim", cfg.mla_rope_dim,
          "the decoupled rotary key/query width must be even (RoPE rotates feature pairs)")


def _resolve_reversible(cfg) -> None:
    """Reversible blocks (`arch.reversible`) couple a Pre-Norm attention and FFN, statelessly."""
    check(cfg.residual == "prenorm", "model.reversible", True,
          f"reversible blocks need model.residual='prenorm' (got {cfg.residual!r})")
    check(cfg.use_ffn, "model.reversible", True,
          "reversible blocks couple attention with an FFN; set model.use_ffn=True")
    check(cfg.norm not in ("batchnorm", "causal_batchnorm"), "model.reversible", True,
          f"reversible blocks cannot replay running statistics of model.norm={cfg.norm!r}; "
          "use a stateless norm")
    check(cfg.ffn != "moe", "model.reversible", True,
          "reversible blocks do not carry the MoE auxiliary losses; use a dense model.ffn")


def _resolve_moe(cfg) -> None:
    """Mixture-of-experts fields (`arch.moe.MixtureOfExperts`); fills `moe_d_ff` (default d_ff)."""
    check(isinstance(cfg.moe_every, int) and cfg.moe_every >= 1
          and cfg.num_layers % cfg.moe_every == 0, "model.moe_every", cfg.moe_every,
          f"must be a positive divisor of model.num_layers={cfg.num_layers}")
    check(cfg.moe_dense_ffn in FFNS and cfg.moe_dense_ffn != "moe", "model.moe_dense_ffn",
          cfg.moe_dense_ffn, f"valid dense ffns: {', '.join(sorted(set(FFNS) - {'moe'}))}")
    check(isinstance(cfg.moe_experts, int) and cfg.moe_experts >= 1, "model.moe_experts",
          cfg.moe_experts, "must be a positive integer")
    check(isinstance(cfg.moe_top_k, int) and 1 <= cfg.moe_top_k <= cfg.moe_experts,
          "model.moe_top_k", cfg.moe_top_k,
          f"must be an integer in [1, model.moe_experts={cfg.moe_experts}]")
    check(cfg.moe_expert_ffn in FFNS and cfg.moe_expert_ffn != "moe", "model.moe_expert_ffn",
          cfg.moe_expert_ffn, f"valid: {', '.join(sorted(set(FFNS) - {'moe'}))}")
    check(cfg.moe_capacity_factor > 0, "model.moe_capacity_factor", cfg.moe_capacity_factor,
          "must be positive")
    check(isinstance(cfg.moe_shared_experts, int) and cfg.moe_shared_experts >= 0,
          "model.moe_shared_experts", cfg.moe_shared_experts, "must be a non-negative integer")
    for field in ("moe_balance_coef", "moe_z_coef"):
        check(cfg[field] >= 0, f"model.{field}", cfg[field], "must be non-negative")
    if cfg.moe_d_ff is None:
        cfg.moe_d_ff = cfg.d_ff
    check(isinstance(cfg.moe_d_ff, int) and cfg.moe_d_ff > 0, "model.moe_d_ff", cfg.moe_d_ff,
          "must be a positive integer")
