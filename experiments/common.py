"""Helpers that experiment files compose.

An experiment file defines `get_config(arg: str | None = None) -> ConfigDict`, starting from
`base_config()` (every field with its default: `config/defaults.py`) and changing what its study
needs.
"""

from __future__ import annotations

import ml_collections

from config.defaults import base_config, model_config

__all__ = ["arm_and_scale", "arm_size_and_scale", "base_config", "claim", "model_config",
           "small_cpu", "subword", "use_deepnorm", "use_placement"]


def use_deepnorm(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """DeepNet (Wang et al. 2022): Post-LN with x ← LN(αx + F(x)) and β-scaled Xavier on the
    value, attention-output and FFN projections (Q/K keep gain 1); no final norm."""
    model = config.model
    model.residual.name = "deepnorm"
    model.norm.update(name="layernorm", final=False)
    for group in ("value", "attention_output", "ffn_input", "ffn_output"):
        model.init[group] = "deepnorm"
    return config


def use_placement(config: ml_collections.ConfigDict, placement: str) -> ml_collections.ConfigDict:
    """LayerNorm placed as `placement`: "pre" (Pre-LN with a final norm), "post" (Post-LN, no final
    norm), "scalefix" (Pre-Norm ScaleNorm with FixNorm embeddings, Nguyen & Salazar 2019) or
    "deepnorm" (`use_deepnorm`)."""
    model = config.model
    model.norm.name = "layernorm"
    if placement == "post":
        model.residual.name = "postnorm"
        model.norm.final = False
    elif placement == "scalefix":
        model.norm.name, model.fixnorm = "scalenorm", True
    elif placement == "deepnorm":
        use_deepnorm(config)
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


def arm_size_and_scale(arg: str | None, arms, sizes, scales) -> tuple[str, str, str]:
    """A scaling study's config argument "ARM@SIZE" or "ARM@SIZE,SCALE" as (arm, size, scale):
    the default is the first arm at the first size and scale; ValueError naming the valid choices
    otherwise."""
    cell, _, scale = (arg or f"{arms[0]}@{sizes[0]}").partition(",")
    arm, _, size = cell.partition("@")
    scale = scale or scales[0]
    if arm not in arms or size not in sizes or scale not in scales:
        raise ValueError(f"unknown {arg!r}: ARM@SIZE[,SCALE] with ARM in {', '.join(arms)}, "
                         f"SIZE in {', '.join(sizes)}, SCALE in {', '.join(scales)}")
    return arm, size, scale


def claim(arm: str, relation: str, reference: str, *, quote: str, source: str, family: str,
          n: int, margin: float | None = None, metric: str = "eval_loss",
          tails: int = 2) -> dict:
    """A registered claim of a study file's `CLAIMS` (docs/studies.md), made before its runs:
    Δ = arm − reference in the runs' final `metric`, paired by seed, is negative (relation
    "<": the arm ends lower, better), positive (">"), or within (−margin, margin) ("≈", margin
    in the metric's units). `quote` gives the claim in its source's words, `source` where it
    comes from (paper, table), `family` the claims Holm's correction runs over, `n` the seeds
    every arm of the family must have, `tails` whether a direction is tested two-sided (2) or
    one-sided toward the claimed side (1). `train.studies.study.load_study` checks the fields."""
    return dict(arm=arm, relation=relation, reference=reference, quote=quote, source=source,
                family=family, n=n, margin=margin, metric=metric, tails=tails)


def small_cpu(config: ml_collections.ConfigDict, steps: int = 300) -> ml_collections.ConfigDict:
    """The CPU scale of the block-anatomy studies: d = 64, 4 layers of 4-head MHA, batch 32 × 64
    bytes of the embedded corpus, AdamW 3e-3 with 30 warmup steps and cosine decay to `steps`
    (300: about 1.5 minutes a run on one core), evaluated every 100 steps on 16 batches."""
    config.update(steps=steps, batch_size=32, seq_len=64, eval_every=100, eval_batches=16,
                  checkpoint_every=100, sample_tokens=0)
    config.model.update(d_model=64, num_layers=4)
    config.model.attention.update(num_heads=4, num_kv_heads=4)
    config.optimizer.update(learning_rate=3e-3, warmup_steps=30, schedule="cosine")
    return config


def subword(config: ml_collections.ConfigDict, *, d_model: int, num_layers: int, num_heads: int,
            steps: int, batch_size: int, seq_len: int, learning_rate: float, warmup_steps: int,
            accumulation_steps: int = 1) -> ml_collections.ConfigDict:
    """A paper scale: subword shards of `scripts/prepare_data.py` (`data/prepared`, the
    tokenizer's vocabulary), bfloat16 compute, the blocked attention kernel, whole-block
    rematerialization, AdamW with warmup and cosine decay."""
    config.update(steps=steps, batch_size=batch_size, seq_len=seq_len,
                  eval_every=max(steps // 20, 1), eval_batches=16,
                  checkpoint_every=max(steps // 20, 1), sample_tokens=0,
                  accumulation_steps=accumulation_steps)
    config.data.update(name="prepared", path="data/prepared")
    config.model.update(d_model=d_model, num_layers=num_layers, vocab_size=0, dtype="bfloat16")
    config.model.attention.update(num_heads=num_heads, num_kv_heads=num_heads)
    config.execution.update(attention_implementation="blocked", remat="full")
    config.optimizer.update(learning_rate=learning_rate, warmup_steps=warmup_steps,
                            schedule="cosine")
    return config
