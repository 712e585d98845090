"""Helpers that experiment files compose.

An experiment file defines `get_config(arg: str | None = None) -> ConfigDict`, starting from
`base_config()` (every field with its default: `config/defaults.py`) and changing what its study
needs.
"""

from __future__ import annotations

import ml_collections

from config.defaults import base_config, model_config

__all__ = ["arm_and_scale", "base_config", "model_config", "use_deepnorm"]


def use_deepnorm(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DeepNet (Wang et al. 2022): Post-LN with x ← LN(αx + F(x)) and β-scaled Xavier on the
    value, attention-output and FFN projections (Q/K keep gain 1); no final norm."""
    model = config.model
    model.residual.name = "deepnorm"
    model.norm.update(name="layernorm", final=False)
    for group in ("value", "attention_output", "ffn_input", "ffn_output"):
        model.init[group] = "deepnorm"
    return config


def arm_and_scale(arg: str | None, arms, scales, default: str) -> tuple[str, str]:
    """A study file's config argument "ARM" or "ARM,SCALE" (docs/studies.md) as (arm, scale):
    the arm defaults to `default`, the scale to the first of `scales`; ValueError naming the
    valid choices otherwise."""
    arm, _, scale = (arg or default).partition(",")
    if arm not in arms:
        raise ValueError(f"unknown arm {arm!r}; arms: {', '.join(arms)}")
    scale = scale or scales[0]
    if scale not in scales:
        raise ValueError(f"unknown scale {scale!r}; scales: {', '.join(scales)}")
    return arm, scale
