"""Pure functions of a config that more than one package reads: the model assembly (`arch`) and
the pipeline schedule (`sharding`) must agree on them, and neither may import the other's side of
the layering, so they live here, in the leaf. No JAX."""

from __future__ import annotations

import math

from config.catalogue import EXPERTS, has, letters


def sublayer_count(model_cfg) -> int:
    """L: residual sublayers in the network (attention and FFN per block, or attention only)."""
    return model_cfg.num_layers * (2 if model_cfg.use_ffn else 1)


def interleaves_moe(model_cfg) -> bool:
    """Whether MoE FFNs alternate with dense ones (`model.moe.every` = k > 1): the layer scan then
    runs groups of k blocks (`arch.model.BlockGroup`) instead of single blocks."""
    return model_cfg.use_ffn and has("ffn", model_cfg.ffn.name, EXPERTS) and model_cfg.moe.every > 1


ATTENTION_LETTER = "A"  # the `model.layer_pattern` letter of `model.attention.name`


def layer_attentions(model_cfg) -> tuple[str, ...]:
    """The attention (token mixer) of each of the `num_layers` blocks: `model.attention.name`, or
    `model.layer_pattern` repeated ("A": `model.attention.name`, another letter: the token mixer
    whose record in `config.catalogue` declares it, e.g. "L": gated_deltanet)."""
    pattern, mixers = model_cfg.layer_pattern or ATTENTION_LETTER, letters()
    mixers[ATTENTION_LETTER] = model_cfg.attention.name
    return tuple(mixers[pattern[i % len(pattern)]] for i in range(model_cfg.num_layers))


def components_in_use(model_cfg) -> list[tuple[str, str]]:
    """(family, name) of every component the `model` section builds, once each: its token mixers
    (`model.attention.name` and the pattern's), norm, position, FFN, residual mechanism and
    head."""
    mixers = dict.fromkeys((model_cfg.attention.name, *layer_attentions(model_cfg)))
    return ([("attention", name) for name in mixers]
            + [(family, model_cfg[family].name)
               for family in ("norm", "position", "ffn", "residual", "head")])


def layer_units(model_cfg) -> int:
    """G, the number of layer-scan units: blocks, or block groups with interleaved MoE."""
    return model_cfg.num_layers // (model_cfg.moe.every if interleaves_moe(model_cfg) else 1)


def dropout_enabled(model_cfg) -> bool:
    """Whether any dropout site of the `model` section has a positive rate (`arch/dropout.py`)."""
    section = model_cfg.get("dropout")
    return section is not None and any(rate > 0 for rate in section.values())


def blocks_per_unit(model_cfg) -> int:
    """Blocks per step of the layer scan: the least common multiple of the layer pattern's length
    and, with MoE interleaving, `moe.every` (1: single blocks)."""
    every = model_cfg.moe.every if interleaves_moe(model_cfg) else 1
    return math.lcm(len(model_cfg.layer_pattern) or 1, every)
