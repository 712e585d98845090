"""Rank collapse: pure attention loses rank with depth; skips and MLPs stop it.

Papers:
- Dong, Cordonnier & Loukas 2021, "Attention is not all you need: pure attention loses rank
  doubly exponentially with depth" (ICML; arXiv 2103.03404). Claim: the output of a stack of
  self-attention layers without skip connections or MLPs converges to a rank-1 matrix (every
  token the same vector) doubly exponentially in depth, res(X_L) ≤ c^{3^L}-type decay; skip
  connections stop the collapse, MLPs slow it, and LayerNorm does not help (§2, §4, Fig. 2).
- Noci et al. 2022, "Signal propagation in transformers: theoretical perspectives and the role of
  rank collapse" (NeurIPS; arXiv 2206.03126). Claim: at initialization rank collapse makes the
  gradients of the queries and keys vanish; scaling the residual branches by 1/√L prevents it.

Arms (norm "none" everywhere, so that only the skip and the MLP differ; Dong et al.'s analysis
has no norms):
    attention         pure attention: no skip (x ← SA(x)), no FFN
    attention_mlp     + MLP: x ← MLP(SA(x)) as two skipless sublayers
    skip              + skip: x ← x + SA(x), no FFN
    skip_mlp          + both: the plain residual sum with both sublayers (the baseline)
    skip_mlp_scaled   + both, the branch outputs initialized 1/√(2L) smaller (`depth_scaled` on
                      the attention-output and FFN-down projections): Noci et al.'s branch scale

Measure: `res(h_i)` = ‖X − 1x̄ᵀ‖_F / ‖X‖_F by boundary i (`probes.depth_profile`), the curvature
of log res against depth (negative: faster than exponential), and ‖∂loss/∂W_Q‖, ‖∂loss/∂W_K‖ by
layer, at initialization and after training (`scripts/study_probes.py`).

Registered claims: none, and so no REGISTERED. Neither paper claims anything of the final
validation loss: the collapse (res by depth and its curvature), the vanishing Q/K gradients and
what skips, MLPs and the 1/√L branch scale do to them are measured by `scripts/study_probes.py`
(docs/results/rank_collapse/probes_init.md and probes.md), and report.md's loss table is
descriptive. A loss claim added later gets its own REGISTERED time (a time set now, with no
claims, would predate it).

Scales:
- `cpu` (default): `experiments.common.small_cpu` at 8 layers (d = 64, batch 32 × 64 bytes,
  300 steps, AdamW 1e-3: the norm-free stacks do not train at 3e-3), GELU MLP, learned
  positions (rotary positions act inside attention and would not change the argument).
- `paper`: Dong et al.'s depth-wise experiment sizes are small (their Fig. 2 uses trained BERT,
  Albert and XLNet); ours: d = 768, 12 layers, 12 heads on subword shards, 20,000 steps of
  64 × 512 tokens, one accelerator host.

Commands (results: docs/results/rank_collapse/):
    python scripts/study_probes.py --study experiments/rank_collapse.py \\
        --root runs/rank_collapse --initialization
    python scripts/sweep.py --study experiments/rank_collapse.py --root runs/rank_collapse \\
        --seeds 0,1,2
    python scripts/study_report.py --root runs/rank_collapse
    python scripts/study_probes.py --root runs/rank_collapse
"""

from experiments.common import arm_and_scale, base_config, small_cpu, subword

ARMS = ("skip_mlp", "attention", "attention_mlp", "skip", "skip_mlp_scaled")
BASELINE = "skip_mlp"
SEEDS = (0, 1, 2)
SCALES = ("cpu", "paper")
TARGET = "v5e-8"  # the paper scale's pod (scripts/dry_run.py --all, docs/pods.md)


def get_config(arg: str | None = None):
    arm, scale = arm_and_scale(arg, ARMS, SCALES, BASELINE)
    config = base_config()
    model = config.model
    if scale == "cpu":
        small_cpu(config)
        model.num_layers = 8
        config.optimizer.learning_rate = 1e-3
    else:
        subword(config, d_model=768, num_layers=12, num_heads=12, steps=20_000, batch_size=64,
                seq_len=512, learning_rate=3e-4, warmup_steps=1000)
    model.position.name = "learned"
    model.ffn.update(name="mlp", activation="gelu")
    model.norm.update(name="none", final=False)
    model.residual.name = "noskip" if arm.startswith("attention") else "prenorm"
    model.use_ffn = arm.endswith(("mlp", "scaled"))
    if arm == "skip_mlp_scaled":
        model.init.update(attention_output="depth_scaled", ffn_output="depth_scaled")
    return config
