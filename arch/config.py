"""Model configuration against the component registries: the rules that need a registered
component or the devices, after the JAX-free rules of `config.model` (which `resolve_model`
runs first, and `python -m train` runs before JAX loads)."""

from __future__ import annotations

from arch.attention import ATTENTION
from arch.ffn import ACTIVATIONS, FFNS, hidden_width
from arch.heads import HEADS
from arch.init import INITS
from arch.norms import NORMS
from arch.positions import POSITIONS
from arch.registry import Registry
from arch.remat import host_offload_supported
from arch.residual import RESIDUALS
from config import check, lookup, registered
from config import model as rules
from config.defaults import INIT_GROUPS


def check_choice(field: str, value, registry: Registry) -> None:
    registered.check_choice(field, value, registry.family, registry)


def resolve_model(cfg) -> None:
    """Validate `cfg` (the `model` ConfigDict) in place and fill in its derived fields: those of
    `config.model.resolve_model` (`attention.head_dim`, ...), then `ffn.d_ff`
    (`arch.ffn.hidden_width`) and `moe.d_ff`."""
    for field, registry in (("attention.name", ATTENTION), ("norm.name", NORMS),
                            ("position.name", POSITIONS), ("ffn.name", FFNS),
                            ("ffn.activation", ACTIVATIONS), ("residual.name", RESIDUALS),
                            ("head.name", HEADS)):
        check_choice(f"model.{field}", lookup(cfg, field), registry)
    for group in ("default", *INIT_GROUPS):
        if group != "default" and cfg.init[group] is None:
            continue
        check_choice(f"model.init.{group}", cfg.init[group], INITS)
    check(isinstance(cfg.vocab_size, int) and cfg.vocab_size > 0, "model.vocab_size",
          cfg.vocab_size, "must be a positive integer")
    rules.resolve_model(cfg)
    if cfg.ffn.d_ff is None:
        cfg.ffn.d_ff = hidden_width(cfg)  # ffn.ratio·d, or matched to the two-projection FFN
    check(cfg.ffn.d_ff > 0, "model.ffn.d_ff", cfg.ffn.d_ff, "must be positive")
    if cfg.ffn.name == "moe":  # arch/moe.py
        dense = sorted(set(FFNS) - {"moe"})
        for field in ("dense_ffn", "expert_ffn"):
            check(cfg.moe[field] in dense, f"model.moe.{field}", cfg.moe[field],
                  f"valid dense ffns: {', '.join(dense)}")
        if cfg.moe.d_ff is None:
            cfg.moe.d_ff = cfg.ffn.d_ff
    if cfg.loop_count > 1:  # looped depth (`TransformerLM._loop`)
        single = sorted(name for name, mechanism in RESIDUALS.items() if mechanism.single_stream)
        check(cfg.residual.name in single, "model.loop_count", cfg.loop_count,
              f"looped depth needs a single-stream model.residual.name ({', '.join(single)}); "
              f"got {cfg.residual.name!r} (the depth-attention histories and multi-stream states "
              "are sized and parameterized for one pass)")


def resolve_execution(execution) -> None:
    """Check the `execution` section (`config.model.check_execution`), and that the devices can
    host-offload if the remat policy asks for it (arch/remat.py)."""
    rules.check_execution(execution)
    check(execution.remat != "offload" or host_offload_supported(), "execution.remat",
          execution.remat, "the default device has no pinned_host memory to offload to; use "
          "save_attention_and_ffn_outputs")
