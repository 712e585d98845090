"""Losses of edited models: one attention head removed (head ablation), blocks removed (ShortGPT).

`head_ablation` zeroes each head's slice of the attention output projection in turn;
`prune_blocks` returns the model without some blocks, `prune_by_influence` chooses them by Block
Influence (`probes.depth_profile`), `batch_loss` evaluates either. Tokens, depth and the loss
follow the conventions of `train.instruments.probes`; the models are never modified.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from arch.accounting import abstract_model
from arch.layers import Dense
from arch.model import TransformerLM, interleaves_moe
from arch.residual import RESIDUALS
from train.instruments.probes import _split_tokens, depth_profile, require_probeable
from train.step import next_token_loss


def _stacked_blocks(model: TransformerLM) -> list:
    """The stacked Block modules of the model: [model.blocks] (leading axis: layers), or the k
    members of the stacked BlockGroup (leading axis: groups; member j holds blocks g·k + j)."""
    if interleaves_moe(model.cfg):
        return [getattr(model.blocks, f"block_{j}") for j in range(model.cfg.moe.every)]
    return [model.blocks]


@functools.partial(jax.jit, static_argnums=0)
def _loss_with_heads(graphdef, state, tokens_BxT1, keep_LxH):
    """Loss with each head's slice of the attention output projection W_O multiplied by
    keep[layer, head] (0: that head's contribution removed exactly)."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    members = _stacked_blocks(model)
    keep_GxKxH = keep_LxH.reshape(cfg.num_layers // len(members), len(members),
                                  cfg.attention.num_heads)
    for j, block in enumerate(members):  # kernel: stacked × H × P × D (P = V for mla)
        output = block.attention.output
        if not isinstance(output, Dense):  # a quantized run's (arch/quantized.py)
            output.keep_input_blocks(keep_GxKxH[:, j])
            continue
        output.kernel[...] = output.kernel[...] * keep_GxKxH[:, j, :, None, None]
    inputs_BxT, targets_BxT = _split_tokens(tokens_BxT1)
    return next_token_loss(model(inputs_BxT), targets_BxT)


def head_ablation(model: TransformerLM, tokens_BxT1: jax.Array) -> dict:
    """Loss change when one attention head is removed, for every head of every block.

    Head h of block l is removed by zeroing its H-slice of the attention output projection W_O
    (kernel H×P×D for mha, H×V×D for mla), which removes exactly its term o_h W_O,h from the
    attention output y = Σ_h o_h W_O,h. Any residual mechanism (the model's own forward runs).
    Returns {"loss": float, the intact model's loss; "loss_change": (L, H) numpy array,
    loss without that head − loss (nats)}. One jitted forward per head, compiled once.
    """
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    tokens_BxT1 = jnp.asarray(tokens_BxT1)
    keep_LxH = np.ones((cfg.num_layers, cfg.attention.num_heads), np.float32)
    loss = float(_loss_with_heads(graphdef, state, tokens_BxT1, keep_LxH))
    change_LxH = np.zeros((cfg.num_layers, cfg.attention.num_heads))
    for layer, head in np.ndindex(*change_LxH.shape):
        keep_LxH[layer, head] = 0.0
        change_LxH[layer, head] = float(
            _loss_with_heads(graphdef, state, tokens_BxT1, keep_LxH)) - loss
        keep_LxH[layer, head] = 1.0
    return {"loss": loss, "loss_change": change_LxH}


# Block pruning (ShortGPT) -------------------------------------------------------------------------

def prune_blocks(model: TransformerLM, drop: Sequence[int]
                 ) -> tuple[ml_collections.ConfigDict, TransformerLM]:
    """(model config, model) with the blocks `drop` (network-order indices) removed: num_layers
    − len(drop) blocks holding the remaining blocks' parameters and state in order; embedding,
    final norm, head and the residual stream's model-level parameters shared in value. The
    residual mechanism first says whether the kept blocks can compute what they did
    (`ResidualMechanism.check_prunable`: e.g. a constant that depends on the depth, a write
    target that follows the sublayer index, a grouping of sublayers into blocks), then adjusts
    what follows the sublayer index or the depth (`ResidualMechanism.prune`: read offsets,
    rows and columns of depth tables), so that every kept sublayer reads as before.

    Also ValueError for the reversible stack and MoE interleaving (groups would break)."""
    cfg = model.cfg
    require_probeable(cfg)
    if interleaves_moe(cfg):
        raise ValueError(f"model.moe.every={cfg.moe.every}: pruning single blocks breaks the "
                         "dense/MoE groups; prune a model with model.moe.every=1")
    drop = sorted({int(i) for i in drop})
    if any(not 0 <= i < cfg.num_layers for i in drop) or len(drop) >= cfg.num_layers:
        raise ValueError(f"drop={drop}: expected distinct block indices in 0..{cfg.num_layers - 1}"
                         f" leaving at least one of the {cfg.num_layers} blocks")
    kept = [i for i in range(cfg.num_layers) if i not in drop]
    mechanism = RESIDUALS[cfg.residual.name]
    mechanism.check_prunable(cfg, kept, drop)
    pruned_cfg = ml_collections.ConfigDict(cfg.to_dict())
    pruned_cfg.num_layers = cfg.num_layers - len(drop)
    state = nnx.state(model)
    state = jax.tree.map(lambda x: x, state)  # new Variables: the models share no mutable state
    graphdef = nnx.graphdef(abstract_model(pruned_cfg))
    state["blocks"] = jax.tree.map(lambda x: x[jnp.asarray(kept)], state["blocks"])
    mechanism.prune(cfg, state, kept)
    return pruned_cfg, nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnums=0)
def _loss(graphdef, state, tokens_BxT1):
    inputs_BxT, targets_BxT = _split_tokens(tokens_BxT1)
    return next_token_loss(nnx.merge(graphdef, state)(inputs_BxT), targets_BxT)


def batch_loss(model: TransformerLM, tokens_BxT1: jax.Array) -> float:
    """Next-token cross-entropy of the model on the batch (nats; jitted forward)."""
    graphdef, state = nnx.split(model)
    return float(_loss(graphdef, state, jnp.asarray(tokens_BxT1)))


def prune_by_influence(model: TransformerLM, tokens_BxT1: jax.Array, num_drop: int,
                       eval_tokens_BxT1: jax.Array | None = None,
                       block_influence: np.ndarray | None = None) -> dict:
    """ShortGPT's layer removal (Men et al. 2024, §3): Block Influence of every block on
    `tokens_BxT1` (the calibration batch), remove the `num_drop` blocks with the lowest BI (ties
    to the shallower block), and evaluate the loss before and after on `eval_tokens_BxT1`
    (default: the calibration batch). `block_influence`: the calibration batch's BI when the
    caller already has it (`depth_profile(model, tokens_BxT1)["block_influence"]`), not
    recomputed.

    Returns {"block_influence": (L,) array, "dropped": sorted list of block indices,
    "num_layers": blocks left, "loss_before": float, "loss_after": float}; rebuild the pruned
    model with `prune_blocks(model, result["dropped"])`.
    """
    influence = (depth_profile(model, tokens_BxT1, gradients=False)["block_influence"]
                 if block_influence is None else np.asarray(block_influence))
    dropped = sorted(int(i) for i in np.argsort(influence, kind="stable")[:num_drop])
    pruned_cfg, pruned = prune_blocks(model, dropped)
    eval_tokens_BxT1 = tokens_BxT1 if eval_tokens_BxT1 is None else eval_tokens_BxT1
    return {"block_influence": influence, "dropped": dropped,
            "num_layers": pruned_cfg.num_layers, "loss_before": batch_loss(model, eval_tokens_BxT1),
            "loss_after": batch_loss(pruned, eval_tokens_BxT1)}
