"""Model configuration: validation and derived fields, before anything is built or compiled."""

from __future__ import annotations

from arch.attention import ATTENTION
from arch.ffn import ACTIVATIONS, FFNS
from arch.heads import HEADS
from arch.norms import NORMS
from arch.positions import POSITIONS
from arch.registry import Registry
from arch.residual import RESIDUALS


class ConfigError(ValueError):
    """A user error in the config: one line naming the field, the bad value and what is valid."""


def check(condition: bool, field: str, value, valid: str) -> None:
    if not condition:
        raise ConfigError(f"{field}={value!r} is invalid: {valid}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_choice(field: str, value, registry: Registry) -> None:
    valid = ", ".join(sorted(registry))
    check(value in registry, field, value, f"valid {registry.family}s: {valid}")


def resolve_model(cfg) -> None:
    """Validate `cfg` (the `model` ConfigDict) in place and fill in its derived fields:
    `head_dim` (from `attention_width` or d / h) and `d_ff` (from `ffn_ratio` × d)."""
    for field, registry in (("attention", ATTENTION), ("norm", NORMS), ("position", POSITIONS),
                            ("ffn", FFNS), ("activation", ACTIVATIONS), ("residual", RESIDUALS),
                            ("head", HEADS)):
        check_choice(f"model.{field}", cfg[field], registry)
    check(cfg.dtype in ("float32", "bfloat16"), "model.dtype", cfg.dtype, "use float32 or bfloat16")
    for field in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads"):
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
    if cfg.d_ff is None:
        cfg.d_ff = int(round(cfg.ffn_ratio * d))
    check(cfg.d_ff > 0, "model.d_ff", cfg.d_ff, "must be positive")
