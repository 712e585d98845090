"""Normalizations at a fixed recipe, and what each costs per step.

Paper: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization" (NeurIPS; arXiv
1910.07467). Claim (abstract): "RMSNorm achieves comparable performance against LayerNorm but
reduces the running time by 7%∼64% on different models." The other arms are the zoo's norms in
the same slot: ScaleNorm (Nguyen & Salazar 2019, g·x/‖x‖), DyT (Zhu et al. 2025, "Transformers
without Normalization": γ ⊙ tanh(αx) + β), causal BatchNorm (statistics over the batch and the
positions up to t; Shen et al. 2020 discuss why BatchNorm is weak for language) and GatedNorm
(RMSNorm with a low-rank sigmoid gate, Qwen Team 2026). Every arm is Pre-Norm with the same norm
in every slot and as the final norm; nothing else changes.

Arms: layernorm (the baseline), rmsnorm, scalenorm, dyt, causal_batchnorm, gatednorm.

Scales:
- `cpu` (default): `experiments.common.small_cpu` (d = 64, 4 layers, batch 32 × 64 bytes, 300
  steps; about 1.5 minutes a run on one core) with the default RoPE/SwiGLU/tied decoder.
- `paper`: the width and depth of the Transformer-base model the paper's machine-translation
  rows use (d = 512, 6 layers, 8 heads, ReLU MLP of 2048) as a decoder-only LM on subword shards,
  100,000 steps of 64 × 512 tokens (our budget, not the paper's task); one accelerator host.

Commands (results: docs/results/norms/):
    python scripts/sweep.py --study experiments/norms.py --root runs/norms --seeds 0,1,2
    python scripts/study_report.py --root runs/norms
    # step time against LayerNorm, all norms timed interleaved in one run, at two shapes:
    python scripts/bench.py --config experiments/norms.py:layernorm --steps 40 --compare \\
        "model.norm.name=rmsnorm;model.norm.name=scalenorm;model.norm.name=dyt;\\
model.norm.name=causal_batchnorm;model.norm.name=gatednorm"
"""

from experiments.common import arm_and_scale, base_config, small_cpu, subword

ARMS = ("layernorm", "rmsnorm", "scalenorm", "dyt", "causal_batchnorm", "gatednorm")
BASELINE = "layernorm"
SEEDS = (0, 1, 2)
SCALES = ("cpu", "paper")


def get_config(arg: str | None = None):
    arm, scale = arm_and_scale(arg, ARMS, SCALES, BASELINE)
    config = base_config()
    if scale == "cpu":
        small_cpu(config)
    else:
        subword(config, d_model=512, num_layers=6, num_heads=8, steps=100_000, batch_size=64,
                seq_len=512, learning_rate=1e-3, warmup_steps=4000)
        config.model.ffn.update(name="mlp", activation="relu", d_ff=2048)
    config.model.norm.name = arm
    return config
