"""Norm placement at depth: Post-LN, Pre-LN, ScaleNorm + FixNorm and DeepNorm from 6 to 48 layers.

Papers:
- Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture" (ICML; arXiv
  2002.04745), Theorem 1 and Fig. 3: at initialization the gradient of the parameters near the
  output of a Post-LN Transformer is large (it does not shrink with depth), while Pre-LN's
  shrinks like 1/√L and is the same in every layer; hence Post-LN needs a learning-rate warmup
  and Pre-LN does not (the warmup itself: experiments/warmup.py).
- Nguyen & Salazar 2019, "Transformers without Tears" (arXiv 1910.05895): Pre-Norm with
  ScaleNorm (g·x/‖x‖, one scalar gain) and FixNorm (unit-length embeddings) trains faster and as
  well as Pre-LN.
- Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers" (arXiv 2203.00555): DeepNorm
  (x ← LN(α·x + F(x)) with α = (2M)^{1/4} and β-scaled Xavier initialization) lets Post-LN train
  stably at depths where plain Post-LN diverges (their Fig. 1: Post-LN fails beyond ~18 layers
  at their learning rate; DeepNorm trains 1,000).

Arms (LayerNorm unless said): pre (the baseline), post (no final norm), scalefix (Pre-Norm
ScaleNorm with FixNorm), deepnorm (`experiments.common.use_deepnorm`). Sizes: the depth, 6, 12,
24 or 48 layers (cells `ARM@DEPTH`).

Measures: per-layer ‖∂loss/∂W‖_F of every projection at initialization (`scripts/study_probes.py
--initialization`: Xiong et al.'s Fig. 3 plots the FFN's W¹ and W² by layer), and, trained, the
final loss and the runs that diverge (a non-finite loss stops a run: the report lists it).

Scales:
- `cpu` (default): `experiments.common.small_cpu` (d = 64, batch 32 × 64 bytes, 300 steps,
  30 warmup steps) at each depth, ReLU MLP and learned positions, with AdamW at 1e-3 rather than
  small_cpu's 3e-3: at 3e-3 DeepNorm stays on the unigram plateau even at 6 layers
  (docs/results/depth), so only a rate at which every arm trains when shallow can show which
  ones stop training as they deepen. About 1.5 (6 layers) to 12 (48 layers) minutes a run on one
  core.
- `paper`: d = 512, 8 heads, the same depths, on subword shards, 50,000 steps of 64 × 512 tokens,
  AdamW 5e-4 with 4,000 warmup steps (the Transformer translation recipe DeepNet starts from;
  their task is translation, ours language modelling); one accelerator host.

Commands (results: docs/results/depth/):
    python scripts/study_probes.py --study experiments/depth.py --root runs/depth \\
        --initialization
    python scripts/sweep.py --study experiments/depth.py --root runs/depth --seeds 0,1,2
    python scripts/study_report.py --root runs/depth
"""

from experiments.common import arm_size_and_scale, base_config, small_cpu, subword, use_placement

ARMS = ("pre", "post", "scalefix", "deepnorm")
BASELINE = "pre"
SEEDS = (0, 1, 2)
SCALES = ("cpu", "paper")
SCALING = ("6", "12", "24", "48")


def get_config(arg: str | None = None):
    arm, depth, scale = arm_size_and_scale(arg, ARMS, SCALING, SCALES)
    config = base_config()
    model = config.model
    if scale == "cpu":
        small_cpu(config)
        config.optimizer.learning_rate = 1e-3
    else:
        subword(config, d_model=512, num_layers=6, num_heads=8, steps=50_000, batch_size=64,
                seq_len=512, learning_rate=5e-4, warmup_steps=4000)
    model.num_layers = int(depth)
    model.position.name = "learned"
    model.ffn.update(name="mlp", activation="relu")
    use_placement(config, arm)
    return config
