"""AttnRes scaling: the compute multiplier of Block and Full Attention Residuals over Pre-Norm.

Paper: Kimi Team 2026, "Attention Residuals" (arXiv 2603.15031), the scaling-law comparison:
fitted over five model sizes (194M–528M activated parameters, Kimi Linear MoE proxies), Block
AttnRes reaches the baseline's loss with 1/1.25 of its compute, i.e. it matches a baseline
trained with 1.25× the compute. This study fits L = a·C^(−b) per arm over sizes and reports the
multiplier at matched loss with a bootstrap interval over seeds (docs/studies.md).

Registered claims (after the runs: REGISTERED, so the committed runs are post hoc). The report's
claims compare cells at one size, so the paper's multiplier is registered here only through
what it implies at equal size: Block AttnRes ends below the baseline at each of the five sizes
(`block@SIZE < baseline@SIZE`, family "AttnRes scaling, Block", n = 2 seeds, Holm over the
five). The 1.25× multiplier itself is not a CLAIM here: this study is a model-size scan at fixed
data, and its power-law fit and bootstrap multiplier are read in the report's Scaling section,
not tested; the compute-optimal multiplier claim is registered, before any run, in
experiments/attnres_isoflop.py. Full AttnRes is not in the quoted claim and registers none.

Arms: `baseline` (Pre-Norm), `block` (Block AttnRes with N = 4 blocks at every size, S = 2L/4
sublayers per block), `full` (Full AttnRes).

Scales (the config argument is "ARM@SIZE" or "ARM@SIZE,SCALE"; SIZE is xs, s, m, l or xl):
- `cpu` (default): five sizes, d × layers = 64×4, 96×6, 128×8, 160×8, 192×8 (MHA, heads of 32, GELU
  MLP, learned positions, untied head, as the ablation study's acceptance model), all trained
  for the same 400 steps of 16 × 128 bytes of the embedded corpus, AdamW 3e-3, 40 warmup
  steps, cosine decay. Compute spans ≈ 15× from the smallest to the largest (a model-size scan
  at fixed data, not a compute-optimal frontier).
- `paper`: five dense sizes spanning the report's range of activated parameters, d × layers =
  1024×10, 1024×14, 1280×14, 1280×18, 1408×18 (0.19B–0.52B with a 32K vocabulary and an untied
  head; the report's proxies are MoE, these are dense), heads of 128, SwiGLU at the MLP's
  budget (`ffn.width="match_mlp"`), RoPE, seq 8192
  with the blocked attention kernel, subword data
  (`data.name="prepared"` shards of `scripts/prepare_data.py` in data/prepared), bfloat16,
  batch 128 (1M tokens per step) in 8 accumulation steps (16 for Full, which keeps all 2L + 1
  sources) with whole-block rematerialization, 5,000 steps. Sized for 8 × 80 GB GPUs: the
  compiled train step's peak bytes per device under FSDP on 8 (parameters 0.10–0.26 GB and
  AdamW state 0.19–0.52 GB of it), from `python scripts/dry_run.py --config
  experiments/attnres_scaling.py:ARM@SIZE,paper --devices 8 --mesh data=1,fsdp=8
  --config.model.vocab_size=32768` (XLA:CPU's temporaries, an estimate of a GPU's):

      size  parameters  baseline  block   full
      xs    0.19B        7.4 GB   10.8 GB 13.6 GB
      s     0.24B        7.8 GB   12.3 GB 24.4 GB
      m     0.36B        8.5 GB   14.1 GB 30.6 GB
      l     0.44B        9.1 GB   16.0 GB 48.2 GB
      xl    0.52B        9.5 GB   17.1 GB 53.1 GB

  With 8 accumulation steps Full needed 95 GB at l and 105 GB at xl, hence its 16 (the same
  global batch, so the same training).

Commands (results: docs/results/attnres_scaling/):
    python scripts/sweep.py --study experiments/attnres_scaling.py \\
        --root runs/attnres_scaling --scale cpu --seeds 0,1
    python scripts/study_report.py --root runs/attnres_scaling
"""

from experiments.common import arm_size_and_scale, base_config, claim

ARMS = ("baseline", "block", "full")
BASELINE = "baseline"
SEEDS = (0, 1)
SCALES = ("cpu", "paper")
TARGET = "v5p-32"  # the paper scale's pod (scripts/dry_run.py --all, docs/pods.md)
SCALING = ("xs", "s", "m", "l", "xl")
PAPER = {"block": 1.25}
PAPER_METRIC = "compute multiplier at matched loss"
# The registered claims (docs/studies.md), written after the committed runs of
# docs/results/attnres_scaling (every cell has seeds 0 and 1 there, hence n = 2), so REGISTERED
# makes them post hoc until every cell is rerun after it.
REGISTERED = "2026-12-06T05:08"
CLAIMS = tuple(
    claim(f"block@{size}", "<", f"baseline@{size}", quote="Block AttnRes reaches the "
          "baseline's loss with 1/1.25 of its compute (so, at equal size, a lower loss), "
          "paraphrased", source="Kimi Team 2026, Attention Residuals, scaling-law comparison "
          "(table not cited)", family="AttnRes scaling, Block", n=2)
    for size in SCALING)

# Scale → size → (d_model, num_layers).
SIZES = {"cpu": {"xs": (64, 4), "s": (96, 6), "m": (128, 8), "l": (160, 8), "xl": (192, 8)},
         "paper": {"xs": (1024, 10), "s": (1024, 14), "m": (1280, 14), "l": (1280, 18),
                   "xl": (1408, 18)}}
_RESIDUAL = {"baseline": "prenorm", "full": "attnres", "block": "block_attnres"}


def get_config(arg: str | None = None):
    arm, size, scale = arm_size_and_scale(arg, ARMS, SCALING, SCALES)
    d_model, layers = SIZES[scale][size]
    config = base_config()
    model = config.model
    heads = d_model // (32 if scale == "cpu" else 128)
    model.update(d_model=d_model, num_layers=layers)
    model.attention.update(num_heads=heads, num_kv_heads=heads)
    model.residual.name = _RESIDUAL[arm]
    if arm == "block":
        model.attnres.block_size = 2 * layers // 4  # N = 4 blocks of S sublayers
    if scale == "cpu":
        config.update(steps=400, batch_size=16, seq_len=128, eval_every=100, eval_batches=16,
                      checkpoint_every=200, sample_tokens=0)
        model.position.name, model.head.name = "learned", "untied"
        model.ffn.update(name="mlp", activation="gelu")
        config.optimizer.update(learning_rate=3e-3, warmup_steps=40)
    else:
        # Full AttnRes keeps all 2L + 1 sources per token: 16 microbatches, not 8, keep its l
        # and xl sizes within 80 GB per device (the docstring's dry runs).
        config.update(steps=5_000, batch_size=128, seq_len=8192, eval_every=500,
                      checkpoint_every=500, sample_tokens=0,
                      accumulation_steps=16 if arm == "full" else 8)
        config.data.update(name="prepared", path="data/prepared")
        model.update(vocab_size=0, dtype="bfloat16")
        model.head.name, model.ffn.width = "untied", "match_mlp"
        config.execution.update(attention_implementation="blocked", remat="full")
        config.optimizer.update(learning_rate=1e-3, warmup_steps=500, schedule="wsd")
    return config
