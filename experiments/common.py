"""Helpers that experiment files compose.

An experiment file defines `get_config(arg: str | None = None) -> ConfigDict`, starting from
`base_config()` (every field with its default: `config/defaults.py`) and changing what its study
needs.
"""

from __future__ import annotations

import ml_collections

from config.defaults import base_config, model_config

__all__ = ["base_config", "model_config", "use_deepnorm"]


def use_deepnorm(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DeepNet (Wang et al. 2022): Post-LN with x ← LN(αx + F(x)) and β-scaled Xavier on the
    value, attention-output and FFN projections (Q/K keep gain 1); no final norm."""
    model = config.model
    model.update(residual="deepnorm", norm="layernorm", final_norm=False)
    for group in ("value", "attention_output", "ffn_input", "ffn_output"):
        model.init[group] = "deepnorm"
    return config
