"""Quickstart: a 4-layer byte-level LM on the King James Bible, about three minutes on 2 CPU cores.

What it is for: the default run that shows the whole spine working (data → sharded training →
checkpoints → evaluation → a generated sample) and a model that visibly learns: validation loss
falls far below the corpus's byte-unigram entropy (≈ 3.0 nats) and the sample reads like KJV.

Run:
    pip install -e . && python -m train --config experiments/quickstart.py --workdir runs/quickstart
Hardware: any; sized for a 2-core CPU.
"""

from experiments.common import base_config


def get_config(arg: str | None = None):
    del arg
    config = base_config()
    config.steps = 300
    config.batch_size = 16
    config.seq_len = 128
    config.eval_every = 100
    config.checkpoint_every = 100
    config.model.d_model = 192
    config.model.num_layers = 4
    config.model.attention.num_heads = 6
    config.model.attention.num_kv_heads = 2
    config.optimizer.warmup_steps = 30
    return config
