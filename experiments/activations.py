"""Activations and gated FFNs at matched parameter budgets.

Paper: Shazeer 2020, "GLU Variants Improve Transformer" (arXiv 2002.05202), Table 1: T5-base
(12 + 12 layers, d = 768) pre-trained on C4 span corruption; the FFN is either an MLP with
d_ff = 3072 or a gated unit with d_ff = 2048, so that both have the same parameters and compute.
Held-out log-perplexity after 65,536 steps: ReLU 1.997, GELU 1.983, Swish 1.994, GLU 1.982,
ReGLU 1.953, GEGLU 1.942, SwiGLU 1.944 (Bilinear 1.960 is not an arm here). The claim: GEGLU and
SwiGLU beat the ReLU and GELU MLPs at equal parameters.

Arms: the MLP with `relu` (the baseline), `gelu` and `silu` (Swish₁); the gated units `glu`
(sigmoid), `reglu`, `geglu` and `swiglu`, at `ffn.width="match_mlp"` (d_ff = ⅔ · 4d, the MLP's
parameter count).

Scales:
- `cpu` (default): `experiments.common.small_cpu` (d = 64, 4 layers, batch 32 × 64 bytes, 300
  steps; about 1.5 minutes a run on one core).
- `paper`: T5-base's decoder-only half at its widths (d = 768, 12 layers, 12 heads, MLP 3072,
  gated 2048) on subword shards, 65,536 steps of 128 × 512 tokens as in the paper's table (the
  paper's encoder-decoder and span-corruption objective are not reproduced); one accelerator
  host.

Dead units (ReLU's "dying" units): `python scripts/study_probes.py --root runs/activations` reads
each run's last checkpoint and counts, per layer, the FFN units never active (|a| below the
probe threshold for every token of the evaluation batches).

Registered claims (after the runs: REGISTERED, so the committed runs are post hoc): the claim
above as four directions, GEGLU and SwiGLU each below the ReLU and the GELU MLP, one family
(Table 1), n = 3 (every arm has seeds 0-2 in docs/results/activations). The committed runs
predate the claims, so the report marks every verdict exploratory until the runs are repeated
(or tuned, below) after REGISTERED.

A learning rate per arm (registered before any tuning run: `TUNING`): every arm is tuned at the
cpu scale over 7.5e-4 … 1.2e-2 (five rates a factor of 2 apart around the shared 3e-3, widened
at an edge while the best lies there), each at its full 300 steps with tuning seed 100 (not a
reporting seed), on the last 10% of the train split; then seeds 0-2 of each train at its own
rate into ROOT/tuned, at the registered n = 3.

Commands (results: docs/results/activations/):
    python scripts/sweep.py --study experiments/activations.py --root runs/activations \\
        --seeds 0,1,2
    python scripts/sweep.py --study experiments/activations.py --root runs/activations --tune
    python scripts/sweep.py --study experiments/activations.py --root runs/activations \\
        --seeds 0,1,2 --tuned
    python scripts/study_report.py --root runs/activations
"""

from experiments.common import arm_and_scale, base_config, claim, small_cpu, subword

ARMS = ("relu", "gelu", "silu", "glu", "reglu", "geglu", "swiglu")
BASELINE = "relu"
SEEDS = (0, 1, 2)
SCALES = ("cpu", "paper")
TARGET = "v5e-8"  # the paper scale's pod (scripts/dry_run.py --all, docs/pods.md)
PAPER = {"relu": 1.997, "gelu": 1.983, "silu": 1.994, "glu": 1.982, "reglu": 1.953,
         "geglu": 1.942, "swiglu": 1.944}
PAPER_METRIC = "held-out log-perplexity at 65,536 steps (T5-base on C4, Table 1)"
TUNING = dict(rates=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2), seed=100)
# The registered claims (docs/studies.md), written after the committed runs (REGISTERED): the
# report calls every verdict on those runs post hoc. The source as this docstring gives it;
# n: every arm has seeds 0-2 in docs/results/activations.
_TABLE1 = dict(source="Shazeer 2020, GLU Variants Improve Transformer, Table 1, paraphrased",
               family="GLU variants (Table 1)", n=3)
CLAIMS = (
    claim("geglu", "<", "relu", quote="GEGLU beats the ReLU MLP at equal parameters (1.942 vs "
          "1.997)", **_TABLE1),
    claim("swiglu", "<", "relu", quote="SwiGLU beats the ReLU MLP at equal parameters (1.944 "
          "vs 1.997)", **_TABLE1),
    claim("geglu", "<", "gelu", quote="GEGLU beats the GELU MLP at equal parameters (1.942 vs "
          "1.983)", **_TABLE1),
    claim("swiglu", "<", "gelu", quote="SwiGLU beats the GELU MLP at equal parameters (1.944 "
          "vs 1.983)", **_TABLE1),
)
REGISTERED = "2026-12-06T05:08"


def get_config(arg: str | None = None):
    arm, scale = arm_and_scale(arg, ARMS, SCALES, BASELINE)
    config = base_config()
    if scale == "cpu":
        small_cpu(config)
    else:
        subword(config, d_model=768, num_layers=12, num_heads=12, steps=65_536, batch_size=128,
                seq_len=512, learning_rate=1e-3, warmup_steps=2000)
    if arm in ("relu", "gelu", "silu"):
        config.model.ffn.update(name="mlp", activation=arm)
    else:
        config.model.ffn.update(name=arm, width="match_mlp")
    return config
