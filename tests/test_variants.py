"""Every block variant trains on the embedded corpus, and sharding does not change the numbers.

Variants are grouped into a few combined configurations so that each registered choice is covered
at least once without compiling one program per choice; each residual mechanism rides with a few
zoo variants, so the combinations are also composition tests. A residual mechanism registered
later, and not listed in a combination, gets a variant of its own (`<name>-alone`).
"""

import jax
import numpy as np
import pytest

from arch.attention import ATTENTION
from arch.ffn import ACTIVATIONS, FFNS
from arch.heads import HEADS
from arch.init import INITS
from arch.norms import NORMS
from arch.residual import RESIDUALS
from config import resolve
from sharding.mesh import make_mesh
from tests.helpers import tiny_config
from train.data import in_memory
from train.step import TrainProgram

VARIANTS = {
    "postnorm-scalenorm-geglu-untied-layerscale-window-mtp-loop": dict(
        residual="postnorm", norm="scalenorm", ffn="geglu", head="untied", head__bias=True,
        norm__final=False, branch_scale="layerscale", attention__window=8,  # window < seq 16
        head__mtp_depth=2, loop_count=2, loop_inject=True),
    "deepnorm-layernorm-reglu-mos": dict(residual="deepnorm", norm="layernorm", ffn="reglu",
                                         head="mos", norm__final=False,
                                         init=dict(value="deepnorm", attention_output="deepnorm",
                                                   ffn_input="deepnorm", ffn_output="deepnorm")),
    "mhc-dyt-glu-moc-learned-bert": dict(residual="mhc", norm="dyt", ffn="glu", head="moc",
                                         position="learned", init=dict(default="bert")),
    "gated-residual-gatednorm-leaky-fixnorm-depth-scaled": dict(
        residual="gated_residual", gated_residual__mixing=True, gated_residual__channelwise=False,
        norm="gatednorm",
        ffn="mlp", ffn__activation="leaky_relu", fixnorm=True,
        init=dict(attention_output="depth_scaled", ffn_output="depth_scaled")),
    "block-attnres-causal-batchnorm-mla-tanh": dict(
        residual="block_attnres", attnres__block_size=3, norm="causal_batchnorm",
        attention="mla", ffn="mlp", ffn__activation="tanh", mla__kv_rank=16, mla__rope_dim=8),
    "attnres-heads-batchnorm-hardtanh-xavier": dict(residual="attnres", attnres__heads=2,
                                                    norm="batchnorm", ffn="mlp",
                                                    ffn__activation="hardtanh",
                                                    init=dict(default="xavier")),
    "noskip-none-sigmoid-sigsoftmax-sinusoidal": dict(residual="noskip", norm="none", ffn="mlp",
                                                      ffn__activation="sigmoid",
                                                      head="sigsoftmax", position="sinusoidal"),
    "hc-differential-relu-zero-outputs": dict(
        residual="hc", attention="differential", ffn="mlp", ffn__activation="relu",
        init=dict(attention_output="zeros", ffn_output="zeros")),
    "width-moe-every-2nd-shared-mlp-silu-hybrid-LA-dropout": dict(
        residual="width", ffn="moe", moe__every=2, moe__experts=4, moe__shared_experts=1,
        moe__expert_ffn="mlp", ffn__activation="silu", layer_pattern="LA", deltanet__chunk=4,
        # every dropout site on: masks do not depend on the sharding (arch/dropout.py)
        dropout=dict(embedding=0.1, attention_probs=0.1, attention_output=0.1, ffn_hidden=0.1,
                     residual=0.1)),
}

# A residual mechanism or token mixer no combination above rides with trains alone, with the
# defaults: every registered mechanism and mixer is covered without editing this file.
VARIANTS.update({f"{name}-alone": dict(residual=name) for name in RESIDUALS
                 if name != "prenorm" and name not in {v["residual"] for v in VARIANTS.values()}})
_MIXERS = ({v.get("attention") for v in VARIANTS.values()}
           | {"gated_deltanet" for v in VARIANTS.values() if "L" in v.get("layer_pattern", "")})
VARIANTS.update({f"{name}-alone": dict(attention=name) for name in ATTENTION
                 if name != "mha" and name not in _MIXERS})


def test_variants_cover_every_registered_choice():
    used = {field: {v.get(field) for v in VARIANTS.values()} for field in
            ("attention", "norm", "residual", "ffn", "head")}
    used["attention"] |= {"gated_deltanet" for v in VARIANTS.values()
                          if "L" in v.get("layer_pattern", "")}
    used["activation"] = {v.get("ffn__activation") for v in VARIANTS.values()}
    used["init"] = {s for v in VARIANTS.values() for s in v.get("init", {}).values()}
    defaults = {"attention": "mha", "norm": "rmsnorm", "residual": "prenorm", "ffn": "swiglu",
                "head": "tied", "activation": "gelu", "init": "fan_in"}
    for field, registry in (("attention", ATTENTION), ("norm", NORMS), ("residual", RESIDUALS),
                            ("ffn", FFNS), ("activation", ACTIVATIONS), ("head", HEADS),
                            ("init", INITS)):
        missing = set(registry) - used[field] - {defaults[field]}
        assert not missing, (field, missing)


def train_losses(devices: int, mesh, model: dict, steps: int = 20) -> list[float]:
    config = tiny_config(**model)
    config.steps = steps
    config.optimizer.update(learning_rate=1e-2, warmup_steps=2)
    config.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    config = resolve(config, devices)
    program = TrainProgram(config, make_mesh(config, jax.devices()[:devices]))
    corpus = in_memory.load({"name": "kjv"}, "train")
    state, losses = program.init(0), []
    for step in range(steps):
        tokens = corpus.batch(step, 8, 16, seed=0)
        state, metrics = program.train_step(state, program.put_batch(tokens))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.slow
def test_variant_learns_and_sharding_changes_nothing(name):
    single = train_losses(1, (1, 1, 1), VARIANTS[name])
    sharded = train_losses(8, (2, 2, 2), VARIANTS[name])
    assert np.mean(single[-5:]) < np.mean(single[:5]) - 0.5, single
    np.testing.assert_allclose(sharded, single, rtol=2e-4)
