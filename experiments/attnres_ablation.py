"""AttnRes ablations: Full and Block Attention Residuals against the Pre-Norm sum, and the
report's variants of the depth read.

Paper: Kimi Team 2026, "Attention Residuals" (arXiv 2603.15031), the 16-layer ablation table
(final validation loss; lower is better): Pre-Norm baseline 1.766, Full AttnRes 1.737, Block
AttnRes with S = 4 1.746, mHC 1.747. The text's further claims, whose direction this study checks:
a finer block partition approaches Full (S = 1) and one block loses most of the gain; a window of
recent sources only is worse than keeping distant block summaries; an input-dependent query
helps a little; more depth-attention heads do not help; sigmoid weights are worse than softmax;
removing the key norm is worse; DenseFormer-style static weights are worse than AttnRes.

Arms (the config argument is "ARM" or "ARM,SCALE"):
    baseline    Pre-Norm sum
    full        Full AttnRes (attnres)
    block       Block AttnRes, S = 4 sublayers per block (the report's S = 4)
    block2, block8, block16
                Block AttnRes with S = 2, 8, 16 (16 sublayers at the cpu scale: S = 16 is one
                block, the embedding beside one running sum)
    window      Block S = 4 reading only its 2 most recent sources (no distant summaries)
    input_query Block S = 4 with the input-dependent query w_l + W_l k̂_cur
    input_query_scaled
                the same with w_l + W_l k̂_cur / d (`attnres.query_scale`; ours, not the
                report's: under Adam the unscaled W_l moves the scores up to d times as fast as
                w_l, see arch/attnres.py)
    heads4      Block S = 4 with 4 depth-attention heads
    sigmoid     Block S = 4 with sigmoid weights
    no_key_norm Block S = 4 with raw keys
    static      Block S = 4 with DenseFormer-style static weights
    mhc         mHC with 4 streams (the table's fourth row); projected to a column error of 10⁻³
                in at most 50 steps (`model.hyper`), since 2026-12-06: the committed mhc runs
                used 20 plain Sinkhorn iterations, so they are not this arm's numbers

Scales:
- `cpu` (default) is the issue's CPU acceptance point: d = 128, 8 layers (16 sublayers), MHA with
  4 heads, learned positions, GELU MLP, untied head, batch 32 × 128 bytes of the embedded corpus,
  AdamW 3e-3 with 100 warmup steps and cosine decay, 800 steps. One run takes 16–42 minutes on
  one core (docs/results/attnres_ablation).
- `paper`: the table's 16 layers; the width (d = 1024, 16 heads), SwiGLU, RoPE and the budget
  (batch 256 × 8192 tokens, 20,000 steps, AdamW 1e-3 with 1,000 warmup steps) are our choice,
  not the report's. Subword data (`data.name="prepared"` shards of `scripts/prepare_data.py`),
  the blocked attention kernel, bfloat16, whole-block rematerialization and 16 accumulation
  steps (16 sequences of 8K per microbatch, 2 per device on 8), for one accelerator host (8 ×
  80 GB GPUs or a v5p-8). Parameters and AdamW state are 0.16 + 0.32 GB per device under FSDP on 8
  (`scripts/dry_run.py --no_compile`); activations were not compiled here.

A learning rate per arm (registered before any tuning run: `TUNING`). The table's arms
(baseline, block, full, mhc) are tuned at the cpu scale over 7.5e-4 … 1.2e-2 (five rates a
factor of 2 apart around the shared 3e-3, widened at an edge while the best lies there), each
at its full 800 steps with tuning seed 100 (not a reporting seed), on the last 10% of the train
split; then seeds 0–3 of each train at its own rate into ROOT/tuned, the table's family at its
registered n = 4. The variants keep the shared rate. The tuning and tuned runs unroll the layer
scan (`execution.scan_unroll=8`, after `--`: the same model to float rounding, faster on the
CPU, docs/performance.md#the-layer-scan-unrolled-on-the-cpu).

Commands (results: docs/results/attnres_ablation/):
    python scripts/sweep.py --study experiments/attnres_ablation.py --root runs/attnres_ablation \\
        --scale cpu --seeds 0,1,2 --arms baseline,block,full
    python scripts/sweep.py --study experiments/attnres_ablation.py --root runs/attnres_ablation \\
        --scale cpu --arms baseline,block,full,mhc --tune -- --config.execution.scan_unroll=8
    python scripts/sweep.py --study experiments/attnres_ablation.py --root runs/attnres_ablation \\
        --scale cpu --arms baseline,block,full,mhc --seeds 0,1,2,3 --tuned \\
        -- --config.execution.scan_unroll=8
    python scripts/study_report.py --root runs/attnres_ablation
"""

from experiments.common import arm_and_scale, base_config, claim

ARMS = ("baseline", "full", "block", "block2", "block8", "block16", "window", "input_query",
        "input_query_scaled", "heads4", "sigmoid", "no_key_norm", "static", "mhc")
BASELINE = "baseline"
SEEDS = (0, 1, 2)
SCALES = ("cpu", "paper")
TARGET = "v5p-16"  # the paper scale's pod (scripts/dry_run.py --all, docs/pods.md)
PAPER = {"baseline": 1.766, "full": 1.737, "block": 1.746, "mhc": 1.747}
PAPER_METRIC = "final validation loss (16-layer ablation table)"
TUNING = dict(rates=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2), seed=100)
# The registered claims (docs/studies.md). Sources as this docstring gives them: the report's
# 16-layer ablation table and its text (paraphrased above); the table's number is not cited.
_TABLE_SOURCE = "Kimi Team 2026, Attention Residuals, 16-layer ablation table (table not cited)"
_TEXT_SOURCE = "Kimi Team 2026, Attention Residuals, text, paraphrased (table not cited)"
# n: the seeds every arm of the family has in docs/results/attnres_ablation. The table's
# family: 4 (baseline, block and full have seeds 0-3; mHC has 0-2, so its claim is exploratory
# until it has seed 3). The variants: 3 (each variant has seeds 0-2; Block has 0-3, so every
# variant's claim is exploratory until the variants have seed 3 and n is raised to 4 here).
_TABLE = dict(source=_TABLE_SOURCE, family="AttnRes table", n=4)
_VARIANTS = dict(source=_TEXT_SOURCE, family="AttnRes variants", n=3)
CLAIMS = (
    claim("full", "<", "baseline", quote="Full AttnRes beats the Pre-Norm baseline (1.737 vs "
          "1.766)", **_TABLE),
    claim("block", "<", "baseline", quote="Block AttnRes, S = 4, beats the baseline (1.746 vs "
          "1.766)", **_TABLE),
    claim("mhc", "<", "baseline", quote="mHC beats the baseline (1.747 vs 1.766)", **_TABLE),
    claim("full", "<", "block", quote="Full beats Block (1.737 vs 1.746)", **_TABLE),
    claim("block2", "<", "block", quote="a finer block partition approaches Full", **_VARIANTS),
    claim("block16", ">", "block", quote="one block loses most of the gain", **_VARIANTS),
    claim("window", ">", "block", quote="a window of recent sources only is worse than distant "
          "summaries", **_VARIANTS),
    claim("input_query", "<", "block", quote="an input-dependent query helps a little",
          **_VARIANTS),
    claim("input_query_scaled", "<", "block", quote="an input-dependent query helps a little "
          "(W·k̂ / d)", **_VARIANTS),
    claim("heads4", ">", "block", quote="more depth-attention heads do not help", **_VARIANTS),
    claim("sigmoid", ">", "block", quote="sigmoid weights are worse than softmax", **_VARIANTS),
    claim("no_key_norm", ">", "block", quote="removing the key norm is worse", **_VARIANTS),
    claim("static", ">", "block", quote="DenseFormer-style static weights are worse than "
          "AttnRes", **_VARIANTS),
)
# NUMERICS_SINCE is not registered: no commit is known to have changed this study's numbers
# (the runs' READMEs list the commits each trained at).
# The claims were registered at d61bc05, after the shared-rate runs in docs/results (seed 3 of
# baseline, Block and Full among them, run after a borderline p): those runs are post hoc, and
# the tuned-rate seeds 0-3, launched later, are the claims' test.
REGISTERED = "2026-12-06T00:35"

# Arm → the model fields it changes, on top of Block AttnRes with S = 4 unless it says otherwise.
def _block(**attnres) -> dict:
    return dict(residual=dict(name="block_attnres"), attnres=dict(block_size=4) | attnres)


_ARMS = {
    "baseline": dict(residual=dict(name="prenorm")),
    "full": dict(residual=dict(name="attnres")),
    "block": _block(),
    "block2": _block(block_size=2),
    "block8": _block(block_size=8),
    "block16": _block(block_size=16),
    "window": _block(window=2),
    "input_query": _block(query="input"),
    "input_query_scaled": _block(query="input"),  # query_scale = 1/d: in get_config
    "heads4": _block(heads=4),
    "sigmoid": _block(weights="sigmoid"),
    "no_key_norm": _block(key_norm=False),
    "static": _block(weights="static"),
    "mhc": dict(residual=dict(name="mhc", streams=4), hyper=dict(sinkhorn_iters=50)),
}


def get_config(arg: str | None = None):
    arm, scale = arm_and_scale(arg, ARMS, SCALES, BASELINE)
    config = base_config()
    model = config.model
    model.position.name, model.head.name = "learned", "untied"
    model.ffn.update(name="mlp", activation="gelu")
    if scale == "cpu":
        config.update(steps=800, batch_size=32, seq_len=128, eval_every=100, eval_batches=16,
                      checkpoint_every=200, sample_tokens=0)
        model.update(d_model=128, num_layers=8)
        model.attention.update(num_heads=4, num_kv_heads=4)
    else:
        config.update(steps=20_000, batch_size=256, seq_len=8192, eval_every=1000,
                      checkpoint_every=1000, sample_tokens=0, accumulation_steps=16)
        config.data.update(name="prepared", path="data/prepared")
        model.update(d_model=1024, num_layers=16, vocab_size=0, dtype="bfloat16")
        model.attention.update(num_heads=16, num_kv_heads=16)
        model.ffn.name, model.position.name = "swiglu", "rope"
        config.execution.update(attention_implementation="blocked", remat="full")
    scale_lr = (3e-3, 100) if scale == "cpu" else (1e-3, 1000)
    config.optimizer.update(learning_rate=scale_lr[0], warmup_steps=scale_lr[1],
                            schedule="cosine")
    model.update(_ARMS[arm])
    if arm == "input_query_scaled":
        model.attnres.query_scale = 1 / model.d_model
    return config
