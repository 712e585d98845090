"""The price of reversible blocks: activation memory O(1) in depth for about one extra forward.

Papers: Gomez et al. 2017, "The Reversible Residual Network" (NeurIPS; arXiv 1707.04585), and
Kitaev, Kaiser & Levskaya 2020, "Reformer" (ICLR; arXiv 2001.04451), §3. Claims: a reversible
network recomputes each block's input from its output in the backward pass, so activations for
the backward pass no longer grow with depth; the price is recomputing each block's forward,
"roughly 33% more compute" (a backward pass is about two forwards), and RevNet measured up to
~50% more time. The alternative that trades the same way is whole-block rematerialization.

Arms (Pre-Norm; the same parameters and initialization in all three, arch/reversible.py):
ordinary (the baseline), reversible (`model.reversible=True`), remat (the ordinary stack with
`execution.remat="full"`). Exactness (the custom backward equals autodiff of the same
coupling) is tests/test_reversible.py.

Measures (`scripts/bench.py`, one run each; docs/results/reversible/):
- compiled scratch memory of the train step at 2 and 16 layers, for each arm
  (`--depth_memory 2,16`: temp bytes at 16 layers over 2);
- step time of reversible against ordinary and against remat, timed interleaved in one run
  (`--compare`).

Registered claims: none, and so no REGISTERED. The papers' claims are about memory and step
time, measured by `scripts/bench.py` (docs/results/reversible/bench_*.json, one run each, no
seeds), not final validation loss; no training runs of this study are committed.

Scales:
- `cpu` (default): `experiments.common.small_cpu` at 8 layers (d = 64, batch 32 × 64 bytes).
- `paper`: d = 1024, 24 layers, 16 heads on subword shards at 4,096 tokens, 20,000 steps of
  64 sequences (Reformer's enwik8 model is 12 layers at 64K tokens); one accelerator host.

Commands:
    for arm in ordinary reversible remat; do
        python scripts/bench.py --config experiments/reversible.py:$arm --steps 10 \\
            --depth_memory 2,16 --json; done
    python scripts/bench.py --config experiments/reversible.py:reversible --steps 40 \\
        --compare "model.reversible=False;model.reversible=False,execution.remat=full" --json
    python scripts/sweep.py --study experiments/reversible.py --root runs/reversible
"""

from experiments.common import arm_and_scale, base_config, small_cpu, subword

ARMS = ("ordinary", "reversible", "remat")
BASELINE = "ordinary"
SEEDS = (0, 1, 2)
SCALES = ("cpu", "paper")
TARGET = "v5p-32"  # the paper scale's pod (scripts/dry_run.py --all, docs/pods.md)


def get_config(arg: str | None = None):
    arm, scale = arm_and_scale(arg, ARMS, SCALES, BASELINE)
    config = base_config()
    if scale == "cpu":
        small_cpu(config)
        config.model.num_layers = 8
    else:
        subword(config, d_model=1024, num_layers=24, num_heads=16, steps=20_000, batch_size=64,
                seq_len=4096, learning_rate=3e-4, warmup_steps=1000)
    config.model.reversible = arm == "reversible"
    config.execution.remat = "full" if arm == "remat" else "none"
    return config
