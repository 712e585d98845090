"""Initialization schemes, chosen per parameter group. Registry: `INITS[name](cfg, fan_in, fan_out)`
returns an initializer `(key, shape, dtype) -> array`; `group_init(cfg, group)` binds the config.

`model.init` names a scheme for each group (None: `model.init.default`):

    embedding          token embedding rows (fan_in = d: each row is a d-vector)
    query, key, value  attention input projections (MLA: latent and up-projections by role)
    attention_output   the attention output projection W_O
    ffn_input          W₁ (and the gate) of the FFN
    ffn_output         W₂ of the FFN
    head               the untied output projection and the MoS/MoC mixture weights

Parameters outside these groups (norm gains and biases, GatedNorm's gate, learned positions) keep
the initialization their own docstrings state.
"""

from __future__ import annotations

import functools

import jax

from arch.registry import Registry
from config.defaults import INIT_GROUPS

INITS = Registry("init")
GROUPS = INIT_GROUPS  # config.defaults: the names a config may set


# Standard deviation of a unit normal truncated to [−2, 2]: dividing by it makes the truncated
# distribution's variance exactly the one stated (as jax.nn.initializers.variance_scaling does).
_TRUNCATED_STD = 0.87962566103423978


def truncated_normal(std: float):
    """Normal truncated at ±2 standard deviations, rescaled so that its std is exactly `std`."""
    scale = std / _TRUNCATED_STD
    return lambda key, shape, dtype: scale * jax.random.truncated_normal(key, -2.0, 2.0, shape,
                                                                           dtype)


@INITS.register("fan_in")
def width_scaled(cfg, fan_in: int, fan_out: int):
    """Width-scaled (LeCun et al. 1998; "variance 1/fan_in"): std = 1/√fan_in. The default."""
    return truncated_normal(fan_in**-0.5)


@INITS.register("bert")
def bert_normal(cfg, fan_in: int, fan_out: int):
    """BERT/GPT-2 style (Devlin et al. 2019, appendix; Radford et al. 2019): std = 0.02."""
    return truncated_normal(0.02)


@INITS.register("depth_scaled")
def depth_scaled(cfg, fan_in: int, fan_out: int):
    """Width-scaled, divided by √(2L) for L blocks (GPT-2 §2.3; Shoeybi et al. 2019 "Megatron-LM"
    §3: residual-branch outputs scaled by 1/√(number of residual layers)): std = 1/√(2L·fan_in).
    Meant for `attention_output` and `ffn_output`."""
    return truncated_normal((2 * cfg.num_layers * fan_in) ** -0.5)


@INITS.register("xavier")
def xavier_normal(cfg, fan_in: int, fan_out: int):
    """Xavier/Glorot normal (Glorot & Bengio 2010, eq. 16): std = √(2 / (fan_in + fan_out))."""
    return truncated_normal((2.0 / (fan_in + fan_out)) ** 0.5)


@INITS.register("deepnorm")
def deepnorm_xavier(cfg, fan_in: int, fan_out: int):
    """DeepNet's scaled Xavier (Wang et al. 2022, Table 1, decoder-only, M blocks): Xavier normal
    with gain β = (8M)^{-1/4}. Meant for `value`, `attention_output`, `ffn_input` and
    `ffn_output`; Q and K keep gain 1 (see `experiments.common.use_deepnorm`)."""
    beta = (8 * cfg.num_layers) ** -0.25
    return truncated_normal(beta * (2.0 / (fan_in + fan_out)) ** 0.5)


@INITS.register("zeros")
def all_zeros(cfg, fan_in: int, fan_out: int):
    """All zeros, e.g. for output projections so every block starts as the identity."""
    return jax.nn.initializers.zeros


def group_init(cfg, group: str):
    """The scheme `model.init` assigns to `group`, as `(fan_in, fan_out) -> initializer` (the
    form `arch.layers.Dense` takes)."""
    name = cfg.init[group] if cfg.init[group] is not None else cfg.init.default
    return functools.partial(INITS[name], cfg)
