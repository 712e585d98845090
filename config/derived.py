"""Pure functions of a config that more than one package reads: the model assembly (`arch`) and
the pipeline schedule (`sharding`) must agree on them, and neither may import the other's side of
the layering, so they live here, in the leaf. No JAX."""

from __future__ import annotations


def interleaves_moe(model_cfg) -> bool:
    """Whether MoE FFNs alternate with dense ones (`model.moe.every` = k > 1): the layer scan then
    runs groups of k blocks (`arch.model.BlockGroup`) instead of single blocks."""
    return model_cfg.use_ffn and model_cfg.ffn.name == "moe" and model_cfg.moe.every > 1
