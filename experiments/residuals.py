"""Residual-stream ablation: one small model, every residual mechanism, the same data and budget.

What it compares: the plain Pre-Norm sum against Attention Residuals (Kimi Team 2026, "Attention
Residuals", arXiv 2603.15031: Full, and Block with N = 8 blocks), Hyper-Connections (Zhu et al.
2024, arXiv 2409.19606), mHC (Xie et al. 2025, arXiv 2512.24880), the simple width baseline and the
Gated Residual, plus Post-Norm and DeepNorm, on an 8-block (16-sublayer) byte-level LM trained
on the King James Bible for 600 steps. The AttnRes report finds Block AttnRes matching a baseline
trained with 1.25× the compute at 0.2B–2B-active-parameter scale; this file is the small-scale
harness for checking the direction of such claims on one machine, not a reproduction of their
scale. Compare `eval_loss` in each run's metrics.jsonl; plot what each mechanism learned to read
with `python scripts/depth_mixing.py --workdir runs/residuals-NAME`.

Registered claims: none. This is a single-run experiment file, not a study (no ARMS, seeds or
committed results), so it has no CLAIMS or REGISTERED; the claims it could check are registered
in the studies that test them: experiments/attnres_ablation.py (AttnRes, mHC),
experiments/gated_residual_table.py (HC, mHC, the width baseline, the Gated Residual),
experiments/attnres_isoflop.py (the 1.25× compute multiplier).

Run one mechanism (the config argument names it; default prenorm):
    python -m train --config experiments/residuals.py:block_attnres \
        --workdir runs/residuals-block_attnres
Mechanisms: any name registered in `arch.residual.RESIDUALS` (the README's table lists them).
Hardware: a 2-core CPU, about ten minutes per mechanism.
"""

from experiments.common import base_config, use_deepnorm


def get_config(arg: str | None = None):
    mechanism = arg or "prenorm"
    config = base_config()
    config.steps = 600
    config.batch_size = 16
    config.seq_len = 128
    config.eval_every = 200
    config.checkpoint_every = 200
    model = config.model
    model.d_model, model.num_layers = 128, 8
    model.attention.num_heads, model.attention.num_kv_heads = 4, 2
    model.residual.name = mechanism
    model.attnres.block_size = 2  # block_attnres: 16 sublayers in N = 8 blocks
    config.optimizer.warmup_steps = 60
    if mechanism == "deepnorm":
        use_deepnorm(config)
    elif mechanism == "postnorm":
        model.norm.final = False
    return config
