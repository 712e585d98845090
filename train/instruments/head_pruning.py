"""Attention head pruning (Michel, Levy & Neubig 2019, "Are Sixteen Heads Really Better than
One?"): gradient-based head importance, iterative pruning by importance, and physical removal.

Head mask: ξ ∈ R^{L×H} multiplies each head's term of the attention output,
y = Σ_h ξ_h · o_h W_O,h (implemented as ξ_h times head h's H-slice of W_O, so ξ_h = 0 removes
the head exactly, as `ablation.head_ablation` does).

Importance (Michel et al. eq. 2, §4.1): I_h = E_x |∂L(x)/∂ξ_h| at the current mask, with x one
sequence of a calibration set (per-sequence gradients in one vmapped backward pass: L(x) is that
sequence's mean next-token loss); normalized per layer by the ℓ2 norm over that layer's heads
(§6.1, "we normalize the importance scores by layer"). Cost: one forward and backward per
calibration sequence.

Iterative pruning (§4.2, §6.1): repeat { compute I on the masked model; set ξ_h = 0 for the
least important still-kept heads } and record the loss after each round. The `structure` of a
round:
  "heads"        the round(step·L·H) least important heads anywhere (Michel's global pruning;
                 the result is a mask, physically removable only when it is GQA- and
                 layer-uniform, see `prune_heads`);
  "per_group"    in every layer and every KV group, its least important kept query head (one
                 head per group per round, so a round removes L·K heads);
  "whole_groups" in every layer, the KV group with the lowest summed importance of its kept
                 heads (its query heads and its key/value head).
The last two keep the mask physically removable: the stacked layers share one shape.

Physical removal (`prune_heads`): the query kernel D×H×P and its bias, the output kernel H×P×D
shrink to the kept heads; the key and value kernels D×K×P (and biases) to the KV groups that keep
a head. The layers are stacked and scanned (arch/model.py), so every layer must keep the same
number of groups and the same number of query heads in each kept group; any other mask is
refused in one line. The returned config says num_heads = K'·G', num_kv_heads = K',
head_dim = P (as before) and attention.width = H'·P. Only `attention.name="mha"`.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from arch.accounting import abstract_model
from arch.model import TransformerLM, interleaves_moe
from config.catalogue import HEAD_PRUNING, has, with_capability
from config.resolution import unresolved
from train.instruments.probes import _split_tokens
from train.instruments.timing import paired_ratio, time_interleaved
from train.step import build_program, next_token_loss, resolve_for_job

STRUCTURES = ("heads", "per_group", "whole_groups")
ATTENTION_PARAMS = {"query", "key", "value", "output"}


def require_head_prunable(cfg) -> None:
    """ValueError (one line) for a model whose heads this module cannot mask or remove."""
    if not has("attention", cfg.attention.name, HEAD_PRUNING):
        valid = ", ".join(repr(name) for name in with_capability("attention", HEAD_PRUNING))
        raise ValueError(f"model.attention.name={cfg.attention.name!r}: head pruning masks and "
                         f"removes heads of {valid} attention (query/key/value/output Dense)")
    if interleaves_moe(cfg):
        raise ValueError(f"model.moe.every={cfg.moe.every}: head pruning reads the stack of "
                         "single blocks; use model.moe.every=1")


def _apply_mask(model: TransformerLM, mask_LxH) -> None:
    kernel = model.blocks.attention.output.kernel  # L × H × P × D
    kernel[...] = kernel[...] * mask_LxH[:, :, None, None].astype(kernel.dtype)


def masked_model(model: TransformerLM, mask_LxH: np.ndarray) -> TransformerLM:
    """A copy of the model with head h of layer l scaled by mask[l, h] (0: removed)."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    _apply_mask(copy, jnp.asarray(mask_LxH, jnp.float32))
    return copy


def _masked_loss_fn(graphdef, state, mask_LxH, tokens_BxT1):
    # New Variables at this trace level (under grad/vmap the outer ones cannot be written).
    model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    _apply_mask(model, mask_LxH)
    inputs_BxT, targets_BxT = _split_tokens(tokens_BxT1)
    return next_token_loss(model(inputs_BxT), targets_BxT)


_masked_loss = jax.jit(_masked_loss_fn, static_argnums=0)


@functools.partial(jax.jit, static_argnums=0)
def _per_sequence_mask_gradients(graphdef, state, mask_LxH, tokens_BxT1):
    """∂L(x_b)/∂ξ for every sequence b: B×L×H."""
    def sequence_loss(mask, tokens_T1):
        return _masked_loss_fn(graphdef, state, mask, tokens_T1[None])
    return jax.vmap(jax.grad(sequence_loss), in_axes=(None, 0))(mask_LxH, tokens_BxT1)


def masked_loss(model: TransformerLM, mask_LxH: np.ndarray,
                batches: Sequence[np.ndarray]) -> float:
    """Mean over `batches` of the next-token loss of the masked model (nats)."""
    graphdef, state = nnx.split(model)
    mask = jnp.asarray(mask_LxH, jnp.float32)
    return float(np.mean([float(_masked_loss(graphdef, state, mask, jnp.asarray(b)))
                          for b in batches]))


def head_importance(model: TransformerLM, batches: Sequence[np.ndarray],
                    mask_LxH: np.ndarray | None = None, normalize: bool = True) -> np.ndarray:
    """I (L×H, float64): the mean over the sequences of `batches` of |∂L(x)/∂ξ_h| at the mask
    (default all ones), each layer's row divided by its ℓ2 norm when `normalize`."""
    require_head_prunable(model.cfg)
    cfg = model.cfg
    mask = jnp.asarray(np.ones((cfg.num_layers, cfg.attention.num_heads)) if mask_LxH is None
                       else mask_LxH, jnp.float32)
    graphdef, state = nnx.split(model)
    gradients = [np.abs(np.asarray(_per_sequence_mask_gradients(graphdef, state, mask,
                                                                jnp.asarray(b)), np.float64))
                 for b in batches]
    importance = np.concatenate(gradients).mean(axis=0)
    if normalize:
        norm = np.linalg.norm(importance, axis=1, keepdims=True)
        importance = importance / np.where(norm > 0, norm, 1.0)
    return importance


def _next_mask(importance_LxH, keep_LxH, structure: str, groups: int, count: int):
    keep = keep_LxH.copy()
    layers, heads = keep.shape
    if structure == "heads":
        scores = np.where(keep, importance_LxH, np.inf).ravel()
        for index in np.argsort(scores, kind="stable")[:count]:
            keep.flat[index] = False
        return keep
    per_group = heads // groups
    keep_LxKxG = keep.reshape(layers, groups, per_group)
    scores_LxKxG = np.where(keep_LxKxG, importance_LxH.reshape(layers, groups, per_group), np.inf)
    for layer in range(layers):
        if structure == "per_group":
            for group in range(groups):
                keep_LxKxG[layer, group, np.argmin(scores_LxKxG[layer, group])] = False
        else:
            alive = keep_LxKxG[layer].any(-1)
            sums = np.where(alive, np.where(keep_LxKxG[layer], scores_LxKxG[layer], 0).sum(-1),
                            np.inf)
            keep_LxKxG[layer, np.argmin(sums)] = False
    return keep_LxKxG.reshape(layers, heads)


def iterative_head_pruning(model: TransformerLM, calibration: Sequence[np.ndarray],
                           evaluation: Sequence[np.ndarray], *, structure: str = "heads",
                           step_fraction: float = 0.1, max_fraction: float = 0.9,
                           normalize: bool = True) -> list[dict]:
    """Michel et al.'s iterative pruning (module docstring) from the intact model: rounds of
    importance on `calibration` and removal, until the next round would prune more than
    `max_fraction` of the heads ("heads": `step_fraction` of all heads per round, at least one;
    "per_group": until one head per group is left; "whole_groups": until one group per layer).

    Returns one dict per point, the intact model first: {"fraction": heads pruned / L·H,
    "loss": mean loss on `evaluation`, "keep": L×H bool mask, "importance": L×H importance it
    was chosen from (None for the intact model)}."""
    require_head_prunable(model.cfg)
    if structure not in STRUCTURES:
        raise ValueError(f"structure={structure!r}: expected one of {STRUCTURES}")
    cfg = model.cfg
    layers, heads, groups = cfg.num_layers, cfg.attention.num_heads, cfg.attention.num_kv_heads
    keep = np.ones((layers, heads), bool)
    points = [{"fraction": 0.0, "loss": masked_loss(model, keep, evaluation), "keep": keep,
               "importance": None}]
    count = max(1, round(step_fraction * layers * heads))
    while True:
        if structure == "heads":
            removed = min(count, int(keep.sum()) - 1)
        elif structure == "per_group":
            removed = layers * groups if keep.reshape(layers, groups, -1).sum(-1).min() > 1 else 0
        else:
            removed = heads // groups * layers if keep.reshape(
                layers, groups, -1).any(-1).sum(-1).min() > 1 else 0
        if removed <= 0 or (layers * heads - keep.sum() + removed) / (layers * heads) > (
                max_fraction + 1e-9):
            return points
        importance = head_importance(model, calibration, keep, normalize)
        keep = _next_mask(importance, keep, structure, groups, removed)
        points.append({"fraction": 1 - keep.sum() / (layers * heads),
                       "loss": masked_loss(model, keep, evaluation), "keep": keep,
                       "importance": importance})


# Physical removal ---------------------------------------------------------------------------------

def _kept_indices(keep_LxH: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(query head indices L×H', KV head indices L×K') of a removable mask, or ValueError."""
    layers, heads = keep_LxH.shape
    counts_LxK = keep_LxH.reshape(layers, groups, heads // groups).sum(-1)
    if (counts_LxK.sum(-1) == 0).any():
        raise ValueError(f"keep mask removes every head of layer "
                         f"{int(np.argmax(counts_LxK.sum(-1) == 0))}: a block keeps at least one")
    kept_groups = (counts_LxK > 0).sum(-1)
    nonzero = counts_LxK[counts_LxK > 0]
    if len(set(kept_groups.tolist())) > 1 or len(set(nonzero.tolist())) > 1:
        raise ValueError(f"keep mask keeps {counts_LxK.tolist()} query heads per (layer, KV group)"
                         ": stacked layers need the same number of kept KV groups in every layer"
                         " and the same number of heads in every kept group (prune with "
                         "structure='per_group' or 'whole_groups')")
    query = np.stack([np.flatnonzero(row) for row in keep_LxH])
    kv = np.stack([np.flatnonzero(row) for row in counts_LxK > 0])
    return query, kv


def prune_heads(model: TransformerLM, keep_LxH: np.ndarray
                ) -> tuple[ml_collections.ConfigDict, TransformerLM]:
    """(model config, model) with the heads `keep[l, h] = False` physically removed (module
    docstring); every other parameter and state shared in value. Equal to `masked_model(model,
    keep)` (the tests check the logits)."""
    cfg = model.cfg
    require_head_prunable(cfg)
    keep_LxH = np.asarray(keep_LxH, bool)
    layers, heads, groups = cfg.num_layers, cfg.attention.num_heads, cfg.attention.num_kv_heads
    if keep_LxH.shape != (layers, heads):
        raise ValueError(f"keep mask has shape {keep_LxH.shape}: expected (num_layers, num_heads)"
                         f" = {(layers, heads)}")
    names = set(nnx.to_pure_dict(nnx.state(model.blocks.attention)))
    if names != ATTENTION_PARAMS:
        raise ValueError(f"attention holds {sorted(names)}: head pruning removes heads of "
                         f"{sorted(ATTENTION_PARAMS)} only")
    query_LxH, kv_LxK = _kept_indices(keep_LxH, groups)
    state = jax.tree.map(lambda x: x, nnx.state(model))
    attention = state["blocks"]["attention"]

    def take(variable, index, axis):
        value = variable[...]
        index = jnp.asarray(index).reshape(index.shape[0], *(1,) * (axis - 1), index.shape[1],
                                           *(1,) * (value.ndim - axis - 1))
        variable.set_value(jnp.take_along_axis(value, index, axis=axis))

    take(attention["query"]["kernel"], query_LxH, 2)   # L × D × H × P
    take(attention["output"]["kernel"], query_LxH, 1)  # L × H × P × D
    for name in ("key", "value"):
        take(attention[name]["kernel"], kv_LxK, 2)     # L × D × K × P
    for name, index in (("query", query_LxH), ("key", kv_LxK), ("value", kv_LxK)):
        if "bias" in attention[name]:
            take(attention[name]["bias"], index, 1)    # L × H × P
    pruned_cfg = ml_collections.ConfigDict(cfg.to_dict())
    pruned_cfg.attention.num_heads = int(query_LxH.shape[1])
    pruned_cfg.attention.num_kv_heads = int(kv_LxK.shape[1])
    pruned_cfg.attention.head_dim = int(cfg.attention.head_dim)
    pruned_cfg.attention.width = int(query_LxH.shape[1] * cfg.attention.head_dim)
    graphdef = nnx.graphdef(abstract_model(pruned_cfg))
    return pruned_cfg, nnx.merge(graphdef, state)


# Speed ----------------------------------------------------------------------------------------

def step_time_ratios(config, pruned_model_cfg, *, steps: int = 20, block: int = 5,
                     decode_batch: int = 1) -> dict:
    """Train-step and decode-step time of the pruned model over the intact one, measured
    interleaved in one run (`train.instruments.timing`: ABBA blocks, median of per-round
    ratios). Train step: `config`'s full step (batch_size × seq_len, AdamW) from a fresh init of
    each model config. Decode step: one token for `decode_batch` sequences against a KV cache of
    seq_len positions, written at position seq_len/2. Returns {"train_ratio", "decode_ratio",
    "train_s", "decode_s": {"intact", "pruned"} median seconds}."""
    runners, decoders = {}, {}
    for label, model_cfg in (("intact", config.model), ("pruned", pruned_model_cfg)):
        full = unresolved(config)
        full.model = unresolved(model_cfg)
        program = build_program(resolve_for_job(full))
        state = {"train": program.init(full.seed)}
        batch = program.put_batch(np.zeros((full.batch_size, full.seq_len + 1), np.int32))

        def train_step(program=program, state=state, batch=batch):
            state["train"], metrics = program.train_step(state["train"], batch)
            jax.block_until_ready(metrics["loss"])

        runners[label] = train_step
        model = nnx.merge(program.graphdef,  # copies: the train step donates its state
                          *jax.tree.map(jnp.copy, (state["train"]["params"],
                                                   state["train"]["model_state"])))
        graphdef, model_state = nnx.split(model)
        cache = model.init_cache(decode_batch, full.seq_len)
        token_Bx1 = jnp.zeros((decode_batch, 1), jnp.int32)
        position_Bx1 = jnp.full((decode_batch, 1), full.seq_len // 2, jnp.int32)

        @functools.partial(jax.jit, static_argnums=0)
        def decode(graphdef, model_state, token_Bx1, position_Bx1, cache):
            return nnx.merge(graphdef, model_state).decode(token_Bx1, position_Bx1, cache)

        def decode_step(graphdef=graphdef, model_state=model_state, cache=cache,
                        token_Bx1=token_Bx1, position_Bx1=position_Bx1, decode=decode,
                        mesh=program.mesh):
            with jax.set_mesh(mesh):
                jax.block_until_ready(decode(graphdef, model_state, token_Bx1, position_Bx1,
                                             cache))

        decoders[label] = decode_step
    train_times = time_interleaved(runners, steps, block)
    decode_times = time_interleaved(decoders, steps * 5, block * 5)
    return {"train_ratio": paired_ratio(train_times, "pruned", "intact", block),
            "decode_ratio": paired_ratio(decode_times, "pruned", "intact", block * 5),
            "train_s": {k: statistics.median(v) for k, v in train_times.items()},
            "decode_s": {k: statistics.median(v) for k, v in decode_times.items()}}
