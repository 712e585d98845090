"""The components of the zoo, family by family: one record per registered name, with what the
config's rules need to know of it. No JAX: `config.resolve` checks a config's component names
against it and runs each record's rules before JAX loads, and `arch` registers the modules it
names. The rules ask the records (`has`, `record`), never compare component names, so adding a
component, even one with its own options, is its module, its record here and its defaults
section. tests/test_config_sections.py checks that this catalogue and `arch`'s live registries
name the same components, both ways, each from the module its record names.

A record (`Component`) declares:
  module        the module of `arch` that registers the name (or a dotted path)
  family        attention (token mixers), norm, position, ffn, activation, residual, head, init
  capabilities  what the rules ask for (the constants below): ring attention, sequence
                parallelism, pipeline stages, recurrent decoding, ...; `limits` may say why one
                is missing, for the error message
  letter        a token mixer's letter in `model.layer_pattern` (hybrid stacks), if it has one
  projections   an FFN's number of d × d_ff matrices
  axes          its extra logical parameter axes → mesh axes (`sharding.rules` merges them)
  section       the name of its options' section of `model`, and `options`, a function giving
                that section's defaults (`config.defaults.model_config` adds it), for a
                component whose options are not in `config/defaults.py` itself
  rules         a JAX-free function over the `model` section: its own section's checks and
                derived fields, run by `config.resolve` when a config uses the component
  mesh_rules    the same, given the mesh's axis sizes too (`config.resolution`)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import ml_collections

from config import check, component_rules, is_int, lookup
from config.component_rules import positive_int

# Capabilities: what the rules ask of a component.
RING_ATTENTION = "ring_attention"  # a token mixer sharding.sequence's ring attention runs
SEQUENCE_PARALLEL = "sequence_parallel"  # correct on striped sequence shards (sharding.sequence)
PIPELINE = "pipeline"  # correct on the pipeline's microbatches (sharding.pipeline)
RECURRENT_DECODING = "recurrent_decoding"  # decodes from a fixed-size recurrent state
LINEAR_BIAS = "linear_bias"  # adds `model.linear_bias` biases to its projections
REVERSIBLE = "reversible"  # runs in reversible blocks (arch.reversible)
HEAD_PRUNING = "head_pruning"  # heads that train.instruments.head_pruning masks and removes
SINGLE_STREAM = "single_stream"  # a residual mechanism whose state is one (B, T, d) stream
EXPERTS = "experts"  # an FFN that routes tokens to experts (`model.moe`)
ROTARY = "rotary"  # a position scheme that rotates queries and keys (RoPE)
LEARNED_TABLE = "learned_table"  # positions from a table of model.max_seq_len rows
TIES_EMBEDDING = "ties_embedding"  # an output head that is the embedding table
OUTPUT_TABLE = "output_table"  # an output head with its own vocabulary table

Axes = Mapping[str, "str | tuple[str, ...] | None"]


@dataclass(frozen=True)
class Component:
    """One registered component: what the rules need of it (module docstring)."""

    family: str
    module: str
    capabilities: frozenset[str] = frozenset()
    limits: Mapping[str, str] = field(default_factory=dict)
    letter: str | None = None
    projections: int = 0
    axes: Axes = field(default_factory=dict)
    section: str | None = None
    options: Callable[[], dict] | None = None
    rules: Callable[[object], None] | None = None
    mesh_rules: Callable[[object, dict[str, int]], None] | None = None


def _records(family: str, defaults: frozenset[str], members: dict) -> dict[str, Component]:
    """`members` (name → module, or name → (module, keyword arguments of `Component`)) as records
    of `family`, each with the family's default capabilities `defaults` plus its own."""
    records = {}
    for name, entry in members.items():
        module, options = (entry, {}) if isinstance(entry, str) else entry
        extra = frozenset(options.pop("capabilities", ()))
        drop = frozenset(options.pop("without", ()))
        records[name] = Component(family, module, (defaults | extra) - drop, **options)
    return records


def _rotary(cfg) -> None:
    """RoPE rotates feature pairs of every head."""
    check(cfg.attention.head_dim % 2 == 0, "model.attention.head_dim", cfg.attention.head_dim,
          "RoPE needs an even head width")


def _differential(cfg) -> None:
    """Differential attention splits each head into two halves (that RoPE rotates)."""
    p, rope = cfg.attention.head_dim, has("position", cfg.position.name, ROTARY)
    check(p % (4 if rope else 2) == 0, "model.attention.head_dim", p,
          "differential attention splits each head into two halves"
          + (" that RoPE rotates, so it must be a multiple of 4" if rope else
             ", so it must be even"))


def _moe(cfg) -> None:
    """Mixture-of-experts fields (`arch.moe.MixtureOfExperts`): the expert and dense FFNs are
    dense FFNs; `moe.d_ff` defaults to `ffn.d_ff`."""
    moe = cfg.moe
    dense = sorted(name for name in names("ffn") if not has("ffn", name, EXPERTS))
    for option in ("dense_ffn", "expert_ffn"):
        check(moe[option] in dense, f"model.moe.{option}", moe[option],
              f"valid dense ffns: {', '.join(dense)}")
    if moe.d_ff is None:
        moe.d_ff = cfg.ffn.d_ff
    check(positive_int(moe.every) and cfg.num_layers % moe.every == 0, "model.moe.every",
          moe.every, f"must be a positive divisor of model.num_layers={cfg.num_layers}")
    check(positive_int(moe.experts), "model.moe.experts", moe.experts,
          "must be a positive integer")
    check(is_int(moe.top_k) and 1 <= moe.top_k <= moe.experts, "model.moe.top_k", moe.top_k,
          f"must be an integer in [1, model.moe.experts={moe.experts}]")
    check(moe.capacity_factor > 0, "model.moe.capacity_factor", moe.capacity_factor,
          "must be positive")
    check(is_int(moe.shared_experts) and moe.shared_experts >= 0, "model.moe.shared_experts",
          moe.shared_experts, "must be a non-negative integer")
    for option in ("balance_coef", "z_coef"):
        check(moe[option] >= 0, f"model.moe.{option}", moe[option], "must be non-negative")
    check(moe.d_ff is None or positive_int(moe.d_ff), "model.moe.d_ff", moe.d_ff,
          "must be a positive integer")


def _moe_mesh(cfg, mesh: dict[str, int]) -> None:
    """Experts shard over `expert`, their hidden width over `tensor`; capacity is given out in
    token order, which sequence parallelism permutes."""
    moe, tensor = cfg.moe, mesh["tensor"]
    check(moe.experts % mesh["expert"] == 0, "model.moe.experts", moe.experts,
          f"must be divisible by mesh.expert={mesh['expert']}")
    check(moe.d_ff % tensor == 0, "model.moe.d_ff", moe.d_ff,
          f"must be divisible by mesh.tensor={tensor}")
    if cfg.use_ffn and mesh["sequence"] > 1:
        check(moe.dropless, "model.moe.dropless", moe.dropless,
              f"MoE capacity goes first-come-first-served in token order, which "
              f"mesh.sequence={mesh['sequence']} permutes (striping); set "
              "model.moe.dropless=True or mesh.sequence=1")


def _mamba2_options() -> dict:
    """`model.mamba2`: Mamba-2's options (arch.mamba2.Mamba2; Dao & Gu 2024 defaults but P)."""
    return dict(
        num_heads=ml_collections.FieldReference(None, field_type=int),  # H; default 2·d / P
        head_dim=ml_collections.FieldReference(None, field_type=int),   # P; default
                                  # attention.head_dim
        state_dim=128,            # N, the state size per head (B and C width)
        conv_width=4,             # W of the causal depthwise convolution on x, B and C
        chunk=64,                 # tokens per chunk of the chunked (SSD) training form
    )


def _mamba2(cfg) -> None:
    """Mamba-2's fields: P defaults to `attention.head_dim`, H to 2·d / P (expand = 2)."""
    m, d = cfg.mamba2, cfg.d_model
    if m.head_dim is None:
        m.head_dim = cfg.attention.head_dim
    check(positive_int(m.head_dim), "model.mamba2.head_dim", m.head_dim,
          "must be a positive integer")
    if m.num_heads is None:
        check(2 * d % m.head_dim == 0, "model.mamba2.head_dim", m.head_dim,
              f"must divide 2·model.d_model = {2 * d} (the default H·P, expand 2); or set "
              "model.mamba2.num_heads")
        m.num_heads = 2 * d // m.head_dim
    for option in ("num_heads", "state_dim", "conv_width", "chunk"):
        check(positive_int(m[option]), f"model.mamba2.{option}", m[option],
              "must be a positive integer")


def _mamba2_mesh(cfg, mesh: dict[str, int]) -> None:
    """Mamba-2's heads shard over `tensor`."""
    heads = cfg.mamba2.num_heads
    check(heads % mesh["tensor"] == 0, "model.mamba2.num_heads", heads,
          f"must be divisible by mesh.tensor={mesh['tensor']}")


_MIXER = frozenset({SEQUENCE_PARALLEL, PIPELINE})
_NORM = frozenset({SEQUENCE_PARALLEL, PIPELINE, REVERSIBLE})
_DENSE = frozenset({LINEAR_BIAS, REVERSIBLE})
_BATCH_STATISTICS = "batch statistics of a microbatch differ from the batch's"

# family → the config field naming it, and each registered name's record.
FAMILIES: dict[str, tuple[str, dict[str, Component]]] = {
    "attention": ("attention.name", _records("attention", _MIXER, {  # token mixers
        "mha": ("attention", dict(capabilities=(RING_ATTENTION, LINEAR_BIAS, HEAD_PRUNING))),
        "mla": ("attention", dict(axes={"kv_latent": None, "q_latent": None},
                                  rules=component_rules.mla)),
        "gated_deltanet": ("deltanet", dict(
            capabilities=(RECURRENT_DECODING,), without=_MIXER, letter="L",
            limits={SEQUENCE_PARALLEL: "do not pass their state between sequence shards",
                    PIPELINE: "do not run in the pipeline"},
            rules=component_rules.gated_deltanet, mesh_rules=component_rules.gated_deltanet_mesh)),
        "differential": ("differential_attention", dict(rules=_differential)),
        "mamba2": ("mamba2", dict(
            capabilities=(RECURRENT_DECODING,), without=_MIXER, letter="M",
            limits={SEQUENCE_PARALLEL: "do not pass their state between sequence shards",
                    PIPELINE: "do not run in the pipeline"},
            axes={"ssm_heads": "tensor", "ssm_state": None}, section="mamba2",
            options=_mamba2_options, rules=_mamba2, mesh_rules=_mamba2_mesh)),
    })),
    "norm": ("norm.name", _records("norm", _NORM, {
        "rmsnorm": "norms", "layernorm": "norms", "scalenorm": "norms", "dyt": "norms",
        "gatednorm": ("norms", dict(axes={"norm_rank": None})), "none": "norms",
        "batchnorm": ("batchnorm", dict(
            without=(PIPELINE, REVERSIBLE),
            limits={PIPELINE: _BATCH_STATISTICS,
                    REVERSIBLE: "reversible blocks cannot replay running statistics"})),
        "causal_batchnorm": ("batchnorm", dict(
            without=_NORM,
            limits={PIPELINE: _BATCH_STATISTICS,
                    REVERSIBLE: "reversible blocks cannot replay running statistics",
                    SEQUENCE_PARALLEL: "its statistics accumulate in token order"})),
    })),
    "position": ("position.name", _records("position", frozenset(), {
        "rope": ("positions", dict(capabilities=(ROTARY,), rules=_rotary)),
        "learned": ("positions", dict(capabilities=(LEARNED_TABLE,))),
        "sinusoidal": "positions", "none": "positions",
    })),
    "ffn": ("ffn.name", _records("ffn", _DENSE, {
        "mlp": ("ffn", dict(projections=2)), "glu": ("ffn", dict(projections=3)),
        "reglu": ("ffn", dict(projections=3)), "geglu": ("ffn", dict(projections=3)),
        "swiglu": ("ffn", dict(projections=3)),
        "moe": ("moe", dict(
            projections=3, capabilities=(EXPERTS,), without=_DENSE,
            limits={REVERSIBLE: "reversible blocks do not carry the MoE auxiliary losses"},
            rules=_moe, mesh_rules=_moe_mesh)),
    })),
    "activation": ("ffn.activation", _records("activation", frozenset(), {
        name: "ffn" for name in ("gelu", "hardtanh", "leaky_relu", "relu", "sigmoid", "silu",
                                 "tanh")
    })),
    "residual": ("residual.name", _records("residual", frozenset(), {
        "prenorm": ("residual", dict(capabilities=(SINGLE_STREAM, REVERSIBLE))),
        "postnorm": ("residual", dict(capabilities=(SINGLE_STREAM,))),
        "deepnorm": ("residual", dict(capabilities=(SINGLE_STREAM,))),
        "noskip": ("residual", dict(capabilities=(SINGLE_STREAM,))),
        "rezero": ("rezero", dict(capabilities=(SINGLE_STREAM,))),
        "attnres": ("attnres", dict(rules=component_rules.attnres)),
        "block_attnres": ("attnres", dict(rules=component_rules.attnres)),
        "hc": ("hyper", dict(rules=component_rules.hyper)),
        "mhc": ("hyper", dict(rules=component_rules.mhc)),
        "width": ("hyper", dict(rules=component_rules.streams)),
        "gated_residual": ("gated_residual", dict(axes={"norm_rank": None},
                                                  rules=component_rules.gated_residual)),
    })),
    "head": ("head.name", _records("head", frozenset(), {
        "tied": ("heads", dict(capabilities=(TIES_EMBEDDING,))),
        "untied": ("heads", dict(capabilities=(OUTPUT_TABLE,))),
        "mos": ("heads", dict(axes={"head_mixture": None, "head_context": "tensor"})),
        "moc": ("heads", dict(axes={"head_mixture": None, "head_context": "tensor"})),
        "sigsoftmax": "heads",
    })),
    "init": ("init.<group>", _records("init", frozenset(), {
        name: "init" for name in ("fan_in", "xavier", "bert", "depth_scaled", "deepnorm", "zeros")
    })),
}


def records(family: str) -> dict[str, Component]:
    """The registered names of `family` → their records."""
    return FAMILIES[family][1]


def names(family: str) -> tuple[str, ...]:
    """The registered names of `family`."""
    return tuple(records(family))


def record(family: str, name: str) -> Component:
    """The record of `name` in `family`."""
    return records(family)[name]


def has(family: str, name: str, capability: str) -> bool:
    """Whether the component `name` of `family` has `capability`."""
    return capability in record(family, name).capabilities


def with_capability(family: str, capability: str) -> tuple[str, ...]:
    """The names of `family` that have `capability`, sorted (for "use ..." messages)."""
    return tuple(sorted(name for name in names(family) if has(family, name, capability)))


def limit(family: str, name: str, capability: str) -> str:
    """Why `name` lacks `capability`: its record's reason, or a generic one."""
    return record(family, name).limits.get(
        capability, f"do not declare the {capability!r} capability (config.catalogue)")


def letters() -> dict[str, str]:
    """`model.layer_pattern` letters → the token mixer each names ("A": the configured one)."""
    return {entry.letter: name for name, entry in records("attention").items() if entry.letter}


def logical_axes() -> dict[str, str | tuple[str, ...] | None]:
    """Every record's extra logical parameter axes → mesh axes (ValueError if two records map an
    axis differently)."""
    merged: dict = {}
    for family in FAMILIES:
        for name, entry in records(family).items():
            for axis, target in entry.axes.items():
                if merged.setdefault(axis, target) != target:
                    raise ValueError(f"logical axis {axis!r}: {family} {name!r} maps it to "
                                     f"{target!r}, another record to {merged[axis]!r}")
    return merged


def option_sections() -> dict[str, Callable[[], dict]]:
    """The `model` sections the records declare (`section` → its defaults' function), once
    each; ValueError if a section is declared twice."""
    sections: dict = {}
    for family in FAMILIES:
        for name, entry in records(family).items():
            if entry.section is None:
                continue
            if entry.section in sections:
                raise ValueError(f"model.{entry.section} is declared by two records ({name!r})")
            sections[entry.section] = entry.options
    return sections


def module_path(family: str, name: str) -> str:
    """The dotted path of the module that registers `name` in `family`."""
    module = record(family, name).module
    return module if "." in module else f"arch.{module}"


def modules() -> tuple[str, ...]:
    """Every module of `arch` that the catalogue names, once each."""
    return tuple(dict.fromkeys(entry.module for family in FAMILIES
                               for entry in records(family).values() if "." not in entry.module))


def plugin(family: str, module: str, **options) -> Component:
    """A record for a component defined outside `arch` (a test's), by its module's dotted path:
    the `register_component` fixture of tests/conftest.py puts it in `records(family)` beside
    the component's `arch` registry entry and restores both afterwards."""
    return replace(Component(family, module), **options)


def check_choice(field_name: str, value, family: str) -> None:
    """ConfigError "`field`=`value` is invalid: valid <family>s: ..." unless `value` is a
    registered name of `family`."""
    valid = names(family)
    check(value in valid, field_name, value, f"valid {family}s: {', '.join(sorted(valid))}")


def check_names(model) -> None:
    """Check each component name of the `model` section, and each `init` scheme."""
    for family, (path, _) in FAMILIES.items():
        if family != "init":
            check_choice(f"model.{path}", lookup(model, path), family)
    for group, scheme in model.init.items():
        if scheme is not None or group == "default":
            check_choice(f"model.init.{group}", scheme, "init")
