"""AttnRes IsoFLOP: the compute multiplier of Block AttnRes over Pre-Norm on a compute-optimal
frontier.

Paper: Kimi Team 2026, "Attention Residuals" (arXiv 2603.15031), the scaling-law comparison:
Block AttnRes reaches the baseline's loss with 1/1.25 of its compute, i.e. it matches a
baseline trained with 1.25× the compute, on a compute-optimal frontier. experiments/
attnres_scaling.py scans model size at fixed data (400 steps), so its multiplier extrapolates a
flat fit; this study measures the frontier with IsoFLOP profiles (Hoffmann et al. 2022,
approach 2) and was registered before any of its runs.

Arms: `baseline` (Pre-Norm) and `block` (Block AttnRes with S = 4 sublayers per block, as the
`block` arm of experiments/attnres_ablation.py).

Cells: at each compute budget C, several model sizes N, each trained on D = C / (6N) tokens,
so steps = round(D / (batch_size · seq_len)), with its own warmup (10% of its steps) and cosine
decay to its own end. N is the FLOP-equivalent parameter count, flops_per_token / 6 from
`arch.accounting.flops_per_token(model, seq_len, training=True)` (matmul weights and causal
attention scores; the two arms count the same), so a run's training FLOPs, as the report counts
them, are C up to the rounding of its steps (< 0.3%). A size name carries its budget and shape,
`c2e13-d64L8` (`train.studies.study.size_budget` reads the budget): the study's `SCALING` sizes
are the run cells `ARM@SIZE` of the machinery, unchanged.

Scales (the config argument is "ARM@SIZE" or "ARM@SIZE,SCALE"):
- `cpu` (default): budgets 2e12, 6e12 and 2e13 FLOPs (10×), 5 widths each, every model 8
  layers (16 sublayers, the ablation's depth; Block then has N = 4 blocks of S = 4), heads of
  16, GELU MLP, learned positions, untied head, batch 16 × 128 bytes of the embedded corpus
  (nats per byte: the multiplier has no unit):

      budget  d (N, tokens/N, steps)
      2e12    16 (45k, 163, 3,602)  32 (0.14M, 17, 1,167)  48 (0.28M, 4.2, 575)
              64 (0.48M, 1.5, 342)  80 (0.72M, 0.6, 227)
      6e12    16 (490, 10,807)  32 (51, 3,500)  48 (12.5, 1,725)  64 (4.4, 1,027)
              80 (1.9, 681)
      2e13    32 (171, 11,666)  48 (42, 5,751)  64 (15, 3,422)  80 (6.5, 2,269)
              96 (1.0M, 3.3, 1,614)

  (`python -c "from experiments.attnres_isoflop import plan; plan()"` prints the table.)
  The training split is 3.9 MB (docs/data.md): the smallest model of each budget repeats it
  up to 6 times (c6e12-d16L8 5.7, c2e13-d32L8 6.1 epochs), sizes near 20 tokens per parameter
  1–2 times; repetition beyond ~4 epochs costs loss (Muennighoff et al. 2023), so the left
  ends of the profiles may read high, which would move N* up, for both arms alike.
  AdamW at a learning rate per arm (`TUNING`, registered before any run): each arm is tuned
  once, at c2e12-d48L8 (the smallest budget's middle width, 575 steps), over 7.5e-4 … 1.2e-2
  (a factor of 2 apart around the ablation's shared 3e-3, widened at an edge while the best
  lies there), tuning seed 100, on the last 10% of the train split, and every size of the arm
  trains at that rate (`Tuning.at`). Tuning each of the 30 cells (150 runs, five times the
  study) does not fit the CPU. The price: under standard parametrization the best rate drifts
  with width and length, so sizes far from d = 48 at 575 steps train at a rate not quite their
  own, both arms alike (it can bend the profiles' ends; it does not favour one arm). The
  layer scan runs unrolled (`execution.scan_unroll` = 8: equal to the rolled scan to float
  rounding, faster on the CPU at these widths, docs/performance.md).
  CPU time: at the ablation's measured 2.4e10 FLOP/s (d = 128, one core:
  docs/performance.md) a run takes C / 2.4e10 s, 1.4–14 minutes; narrower models run at a lower
  FLOP rate, so allow up to twice that (the largest, 2e13 at d = 32, ≤ 28 minutes). In all,
  2 arms × 2 seeds × 5 × (2e12 + 6e12 + 2e13) = 5.6e14 FLOPs: 6.5 core-hours at 2.4e10
  FLOP/s, up to 13; two sweeps, one per core, take half.
- `paper`: each cpu size with its budget × 5e5 (1e18, 3e18, 1e19 FLOPs), its width × 16 (d =
  256–1536, heads of 128) and 12 layers (24 sublayers); SwiGLU at the MLP's budget, RoPE, seq
  2048, batch 256 (0.5M tokens per step) in 4 accumulation steps, subword data
  (`data.name="prepared"`), bfloat16, the blocked kernel, whole-block rematerialization,
  AdamW 1e-3; N (24M–428M) counts a 32,768-token vocabulary (the run takes its vocabulary
  from the tokenizer). For one 8 × 80 GB GPU host (not dry-run here): at 40% of 8 × 1e15
  FLOP/s a run takes 5–52 minutes, the study about 24 hours (`plan("paper", 3.2e15)`).

Registered claim (`CLAIMS`, before any run): block's compute multiplier over baseline at
matched loss on the frontier, at the largest budget, is the paper's 1.25 (`PAPER`). It agrees
when the 95% bootstrap interval over seeds lies above 1 and contains 1.25, disagrees when the
interval excludes 1.25 or lies below 1, and is inconclusive otherwise (it holds 1 and 1.25):
containing 1.25 alone would agree by ignorance with a wide two-seed interval, and excluding 1
alone would accept any gain, so both are needed (`train.studies.stats.multiplier_verdict`).

Registered 2026-12-07, before any of its runs (family "AttnRes compute v2", n = 3): the same
multiplier, judged by its misfit-aware interval (`train.studies.stats.
misfit_bootstrap_frontier_multiplier`: each parabola's residuals, then the frontier's
log-residuals, resampled), agrees only if that interval excludes 1 (`excludes_one_verdict`).
Each arm is placed at its true compute, AttnRes's depth reads included
(`arch.accounting.flops_per_token`); the runs keep the steps of the count without them (1–4%
fewer FLOPs for Block), so they are placed at their C, not retrained. Its runs: seed 2 of every
cell (seeds 0 and 1 are v1's), at the rate tuned at c2e12-d48L8 if a second tuning at the
largest budget's middle size, c2e13-d64L8, picks the same rate; else v2 waits for a per-budget
rate. Nothing of v2 has run yet: its second tuning point needs `TUNING` at two sizes, which the
sweep does not take yet.

Commands (results: docs/results/attnres_isoflop/; the tuned sweeps one per core):
    python scripts/sweep.py --study experiments/attnres_isoflop.py --root runs/attnres_isoflop \\
        --scale cpu --tune
    taskset -c 0 python scripts/sweep.py --study experiments/attnres_isoflop.py \\
        --root runs/attnres_isoflop --scale cpu --tuned --seeds 0
    taskset -c 1 python scripts/sweep.py --study experiments/attnres_isoflop.py \\
        --root runs/attnres_isoflop --scale cpu --tuned --seeds 1
    python scripts/study_report.py --root runs/attnres_isoflop/tuned
"""

from __future__ import annotations

import functools

from experiments.common import arm_size_and_scale, base_config, claim, subword

ARMS = ("baseline", "block")
BASELINE = "baseline"
SEEDS = (0, 1)
SCALES = ("cpu", "paper")
TARGET = "v5p-16"  # the paper scale's pod (scripts/dry_run.py --all, docs/pods.md)
PAPER = {"block": 1.25}
PAPER_METRIC = "compute multiplier at matched loss"
TUNING = dict(rates=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2), seed=100, at="c2e12-d48L8")
CLAIMS = (
    claim("block", ">", "baseline", metric="compute_multiplier",
          quote="Block AttnRes matches the loss of a baseline trained with 1.25× the compute",
          source="Kimi Team 2026, Attention Residuals, scaling-law comparison",
          family="AttnRes compute", n=2),
    claim("block", ">", "baseline", metric="compute_multiplier_misfit",
          quote="Block AttnRes matches the loss of a baseline trained with 1.25× the compute",
          source="Kimi Team 2026, Attention Residuals, scaling-law comparison",
          family="AttnRes compute v2", n=3),
)

LAYERS = 8
BATCH = {"cpu": (16, 128), "paper": (256, 2048)}  # (batch_size, seq_len)
# Budget (cpu FLOPs) → the widths trained at it (cpu scale).
BUDGETS = {"2e12": (16, 32, 48, 64, 80), "6e12": (16, 32, 48, 64, 80),
           "2e13": (32, 48, 64, 80, 96)}
# The paper scale: each cpu size with its budget × PAPER_COMPUTE, its width × PAPER_WIDTH and
# PAPER_LAYERS layers; N counts a PAPER_VOCAB vocabulary.
PAPER_COMPUTE, PAPER_WIDTH, PAPER_LAYERS, PAPER_VOCAB = 5e5, 16, 12, 32_768


def size_name(budget: str, d_model: int, layers: int) -> str:
    """`c2e13-d64L8`: the budget, then the shape (both the cpu scale's)."""
    return f"c{budget}-d{d_model}L{layers}"


# Size → (budget in FLOPs, d_model, num_layers) at the cpu scale.
SIZES = {size_name(budget, d, LAYERS): (float(budget), d, LAYERS)
         for budget, widths in BUDGETS.items() for d in widths}
SCALING = tuple(SIZES)


def shape(size: str, scale: str) -> tuple[float, int, int]:
    """(budget C in FLOPs, d_model, num_layers) of a size at a scale."""
    budget, d_model, layers = SIZES[size]
    if scale == "paper":
        return budget * PAPER_COMPUTE, d_model * PAPER_WIDTH, PAPER_LAYERS
    return budget, d_model, layers


def _shape(config, arm: str, scale: str, d_model: int, layers: int) -> None:
    """The model and its training at `scale`, steps left to `get_config`."""
    model = config.model
    heads = d_model // (16 if scale == "cpu" else 128)
    if scale == "cpu":
        config.update(batch_size=BATCH["cpu"][0], seq_len=BATCH["cpu"][1], eval_batches=16,
                      sample_tokens=0)
        model.update(d_model=d_model, num_layers=layers)
        model.attention.update(num_heads=heads, num_kv_heads=heads)
        model.position.name, model.head.name = "learned", "untied"
        model.ffn.update(name="mlp", activation="gelu")
        config.execution.scan_unroll = layers
    else:
        subword(config, d_model=d_model, num_layers=layers, num_heads=heads, steps=2,
                batch_size=BATCH["paper"][0], seq_len=BATCH["paper"][1], learning_rate=1e-3,
                warmup_steps=1, accumulation_steps=4)
        model.head.name, model.ffn.name, model.ffn.width = "untied", "swiglu", "match_mlp"
        model.position.name = "rope"
    if arm == "block":
        model.residual.name = "block_attnres"
        model.attnres.block_size = 4  # S = 4, the ablation's block arm
    else:
        model.residual.name = "prenorm"


@functools.cache
def flop_parameters(arm: str, scale: str, d_model: int, layers: int) -> float:
    """N = flops_per_token(training=True, depth_mixing=False) / 6 of the arm's model at this
    shape (the paper scale counted with PAPER_VOCAB): the steps were set without AttnRes's own
    depth-read FLOPs (about 1–2% of Block's here), and stay so that every run keeps its config;
    the report places each run at its true compute, depth reads included."""
    from arch.accounting import flops_per_token  # JAX: only when a config is built
    from config.resolution import resolve

    config = base_config()
    _shape(config, arm, scale, d_model, layers)
    if not config.model.vocab_size:
        config.model.vocab_size = PAPER_VOCAB
    resolved = resolve(config, 1)
    return flops_per_token(resolved.model, resolved.seq_len, training=True,
                           depth_mixing=False) / 6


def run_steps(arm: str, scale: str, size: str) -> int:
    """steps = round(C / (6N · batch_size · seq_len)), at least 1."""
    budget, d_model, layers = shape(size, scale)
    batch, seq_len = BATCH[scale]
    tokens = budget / (6 * flop_parameters(arm, scale, d_model, layers))
    return max(round(tokens / (batch * seq_len)), 1)


def get_config(arg: str | None = None):
    arm, size, scale = arm_size_and_scale(arg, ARMS, SCALING, SCALES)
    _, d_model, layers = shape(size, scale)
    config = base_config()
    _shape(config, arm, scale, d_model, layers)
    steps = run_steps(arm, scale, size)
    every = max(steps // (4 if scale == "cpu" else 20), 1)
    config.update(steps=steps, eval_every=every, checkpoint_every=every)
    config.optimizer.update(learning_rate=3e-3 if scale == "cpu" else 1e-3,
                            warmup_steps=max(steps // 10, 1), schedule="cosine")
    return config


def plan(scale: str = "cpu", flops_per_second: float = 2.4e10) -> None:
    """Print each size's N, tokens / N, steps and its estimated minutes at `flops_per_second`."""
    batch, seq_len = BATCH[scale]
    for size in SCALING:
        _, d_model, layers = shape(size, scale)
        n = flop_parameters(BASELINE, scale, d_model, layers)
        steps = run_steps(BASELINE, scale, size)
        tokens = steps * batch * seq_len
        print(f"{size:16} N {n:11.4g}  tokens/N {tokens / n:7.1f}  steps {steps:7d}  "
              f"{6 * n * tokens / flops_per_second / 60:6.1f} min")
