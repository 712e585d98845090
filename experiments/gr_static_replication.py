"""The Gated Residual's static gate term, replicated on fresh seeds: does learning it matter?

Source: the Qwen team's Gated Residual report, design notes: the static gate term "adds no
useful gain" (experiments/gated_residual_table.py, whose docstring gives the provenance).

What came before (docs/results/gated_residual_table/README.md): `gr_frozen_static`, the Gated
Residual with its static gate logits kept at their initial values (the same model as `gr` at
initialization, only the term's learning removed), ended −0.0005 [−0.0077, +0.0067] from `gr`
over seeds 0–3, inconclusive against the registered margin 0.005 (TOST p = 0.071 at n = 4).
That family stays as it was; this file registers a new one, on seeds 10–21, never used by that
study.

The power plan (registered before any run, from the ablation's seeds 0–3):

    python scripts/study_report.py --root docs/results/gated_residual_table --plan

gives a paired SD of 0.0045 for gr_frozen_static − gr; alone in its family (α = 0.05), the
TOST at the margin 0.005 with a true Δ of 0 needs n = 9 for 80% power. n = 12 is registered:
the SD comes from 4 seeds, so the plan is itself uncertain.

Rates, per arm: both arms are tuned in this root before the replication's seeds (the
ablation's tuning covered `gr`, which picked the shared 3e-3, but not `gr_frozen_static`), over
the same grid, tuning seed 100, on the tail of the train split.

The arms' configs are the ablation's (`cpu` scale: d = 128, 8 layers, 600 steps of batch 16 ×
128 bytes), with the layer scan unrolled as its tuned runs had it.

Commands (results: docs/results/gr_static_replication/; from a clean checkout at a commit on
main; not run yet):

    python scripts/sweep.py --study experiments/gr_static_replication.py \\
        --root runs/gr_static_replication --tune
    python scripts/sweep.py --study experiments/gr_static_replication.py \\
        --root runs/gr_static_replication --tuned
    python scripts/study_report.py --root runs/gr_static_replication/tuned

Hardware: one CPU core per run; 10 tuning runs and 24 replication runs.
"""

from experiments import gated_residual_table
from experiments.common import arm_and_scale, claim

ARMS = ("gr", "gr_frozen_static")
BASELINE = "gr"
SEEDS = tuple(range(10, 22))  # fresh: the ablation used 0–3 and tuned at 100
SCALES = ("cpu", "paper")
TARGET = gated_residual_table.TARGET  # the paper scale is gated_residual_table's (docs/pods.md)
TUNING = dict(rates=(7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2), seed=100)
CLAIMS = (
    claim("gr_frozen_static", "≈", "gr", margin=0.005,  # gated_residual_table's margin
          quote="the static gate term adds no useful gain (its learning removed)",
          source="Qwen Gated Residual report, design notes (table not cited)",
          family="GR static term, replication", n=12),
)
REGISTERED = "2026-12-07T21:25"


def get_config(arg: str | None = None):
    arm, scale = arm_and_scale(arg, ARMS, SCALES, BASELINE)
    config = gated_residual_table.get_config(f"{arm},{scale}")
    if scale == "cpu":
        config.execution.scan_unroll = 8
    return config
