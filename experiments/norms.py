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

Registered claims (after the runs: REGISTERED, so the committed runs are post hoc): the
paper's "comparable performance" as an equivalence, RMSNorm − LayerNorm within ±0.01 nats/byte
(about three quarters of the LayerNorm arm's seed standard deviation, 0.013: a difference
smaller than one arm's seed-to-seed spread), and this docstring's BatchNorm claim as a
direction (causal BatchNorm ends above LayerNorm); one family, n = 3 (every arm has seeds 0-2
in docs/results/norms). The running-time half of the paper's claim is measured by
scripts/bench.py (docs/results/norms/bench_*.json), not registered: a claim tests final loss.
The committed runs predate the claims, so the report marks every verdict exploratory until the
runs are repeated (or tuned, below) after REGISTERED.

A learning rate per arm (registered before any tuning run: `TUNING`): every arm is tuned at the
cpu scale over 7.5e-4 … 1.2e-2 (five rates a factor of 2 apart around the shared 3e-3, widened
at an edge while the best lies there), each at its full 300 steps with tuning seed 100 (not a
reporting seed), on the last 10% of the train split; then seeds 0-2 of each train at its own
rate into ROOT/tuned, at the registered n = 3 (DyT's failure at the shared rate is the case a
per-arm rate may change).

Commands (results: docs/results/norms/):
    python scripts/sweep.py --study experiments/norms.py --root runs/norms --seeds 0,1,2
    python scripts/sweep.py --study experiments/norms.py --root runs/norms --tune
    python scripts/sweep.py --study experiments/norms.py --root runs/norms --seeds 0,1,2 --tuned
    python scripts/study_report.py --root runs/norms
    # step time against LayerNorm, all norms timed interleaved in one run, at two shapes:
    python scripts/bench.py --config experiments/norms.py:layernorm --steps 40 --compare \\
        "model.norm.name=rmsnorm;model.norm.name=scalenorm;model.norm.name=dyt;\\
model.norm.name=causal_batchnorm;model.norm.name=gatednorm"
"""

from experiments.common import arm_and_scale, base_config, claim, small_cpu, subword

ARMS = ("layernorm", "rmsnorm", "scalenorm", "dyt", "causal_batchnorm", "gatednorm")
BASELINE = "layernorm"
SEEDS = (0, 1, 2)
SCALES = ("cpu", "paper")
TARGET = "v5e-8"  # the paper scale's pod (scripts/dry_run.py --all, docs/pods.md)
TUNING = dict(rates=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2), seed=100)
# The registered claims (docs/studies.md), written after the committed runs (REGISTERED): the
# report calls every verdict on those runs post hoc. n: every arm has seeds 0-2 in
# docs/results/norms. The equivalence margin, in final validation loss (nats per byte at the
# cpu scale): about three quarters of LayerNorm's seed standard deviation (0.0131, seeds 0-2),
# so "comparable" means closer than one arm's seed-to-seed spread.
_MARGIN = 0.01
_NORMS = dict(family="Norms", n=3)
CLAIMS = (
    claim("rmsnorm", "≈", "layernorm", margin=_MARGIN,
          quote="RMSNorm achieves comparable performance against LayerNorm",
          source="Zhang & Sennrich 2019, Root Mean Square Layer Normalization, abstract "
          "(table not cited)", **_NORMS),
    claim("causal_batchnorm", ">", "layernorm",
          quote="BatchNorm is weak for language modelling (paraphrased)",
          source="Shen et al. 2020, as this docstring cites them, paraphrased (table not cited)",
          **_NORMS),
)
REGISTERED = "2026-12-06T05:08"


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
