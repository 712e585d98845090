"""Per-depth probes of a `TransformerLM` on one batch (the "instrument panel"): statistics by block
and by sublayer, as numpy arrays and floats that a report script turns into JSON and plots.
What else measures a model on a batch: `layer_gradients` (parameter gradients by layer),
`ablation` (losses with a head or blocks removed) and `step_memory` (a train step's compiled
memory), which share the conventions below.

Conventions shared by every function here:

- Tokens: `tokens_BxT1` is an int array B×(T+1), a train-step batch. The model reads
  tokens[:, :-1] (B×T); the loss is the next-token cross-entropy against tokens[:, 1:]
  (`train.step.next_token_loss`: mean over the B·T targets, in nats). MoE auxiliary losses are
  not part of it.
- Depth: blocks are numbered 0..L−1 in network order; with MoE interleaving (`model.moe.every`
  = k > 1) the stack is groups × k and block g·k + j is member j of group g. Boundary i = 0..L is
  the input of block i, boundary L the output of the last block (what the final norm reads).
  Sublayer index 0 is attention, 1 the FFN (`SUBLAYERS`).
- Residual mechanisms: every one but the reversible stack (`model.reversible=True`, which raises a
  ValueError). The probes read a mechanism only through the hooks of
  `arch.residual.ResidualMechanism` (L blocks; state_i the residual state at boundary i):

  hidden state h_i (B×T×D): `ResidualStream.hidden_state(state_i)`, what the final norm would
      read if the network stopped at boundary i; h_L is what it does read. A `single_stream`
      mechanism's state is x_i itself.
  gradient at boundary i: single stream: ∂loss/∂x_i. Others: ∂loss/∂u_i, with u_0 the embedding
      x⁰ (before `begin`) and u_i (i ≥ 1) the update F that block i−1's last sublayer writes:
      the total derivative, through every later read, write and the readout, of the loss w.r.t.
      what that write adds (where x_i = s + u_i, as for a plain sum, it is ∂loss/∂x_i).
  sublayer input s (the update ratio's denominator) and the sublayer norm: single stream: the
      stream before the write, and the mechanism's `norm` submodule (wherever it sits: a
      pre-norm of s, or a post-norm of the write). Others with a `norm` submodule: the input of
      that norm (the read's mixture). Others: s = h_i before the write; the norm is the one
      `probe_norm(state)` names (module with the gain `scale`, input rows), NaN if none.
- The model runs in the mode it is in (call `model.eval()` first for BatchNorm's running
  statistics) and is never modified. Statistics are computed in float32; NaN marks a quantity
  that does not exist (the FFN sublayer of a `model.use_ffn=False` block, the gain of a norm
  without one, the hidden activations of an MoE FFN).

How: `depth_profile` runs the model's own parts (embedding, position, `residual_stream.begin` /
`hidden_state` / `end`, and every sublayer through `Block.sublayer`, the block's own code),
scanning over the stacked block parameters as `arch/model.py` does, and adds zero perturbations
at the block boundaries (single stream) or, at `Block.sublayer`'s capture point (`tap`), to u_i
(the others), so that one `jax.value_and_grad` gives the gradient at every depth; readouts h_i
off the loss path (i < L) are taken from a stop-gradient copy of the state. The update F is read
at the same capture point; inputs of norms and of FFN down projections by wrapping those modules
in the probe's own merged copy of each block; attention probabilities are recorded by the token
mixer under `nnx.capture` of it (`TokenMixer.records_attention_weights`; softmax attention's in
`arch.attention.dot_product_attention`). The training path is untouched.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arch.attention import ATTENTION, AttentionWeights
from arch.layers import Dense
from arch.model import TransformerLM, interleaves_moe
from config.catalogue import SINGLE_STREAM, has
from config.derived import layer_attentions
from sharding.rules import STREAM, constrain
from train.step import next_token_loss

SUBLAYERS = ("attention", "ffn")
DEFAULT_SPARSITY_THRESHOLD = 1e-2
NORM_STATISTICS = ("input_mean", "input_variance", "input_rms", "gain_mean", "gain_std")


def require_probeable(cfg) -> None:
    """ValueError for the reversible stack, whose two coupled streams the probes do not walk,
    for looped depth, whose R passes they do not repeat (`train.instruments.early_exit`
    probes it by pass), for hybrid stacks, and for a token mixer that records no attention
    probabilities (Gated DeltaNet)."""
    if cfg.get("loop_count", 1) > 1:
        raise ValueError(f"model.loop_count={cfg.loop_count}: the probes walk one pass of the "
                         "block stack; use train.instruments.early_exit for looped depth")
    if cfg.reversible:
        raise ValueError("model.reversible=True: the probes walk the residual mechanisms of "
                         "arch/residual.py, not the reversible stack; probe the model with "
                         "model.reversible=False")
    silent = sorted({name for name in layer_attentions(cfg)
                     if not ATTENTION[name].records_attention_weights})
    if cfg.layer_pattern or silent:
        raise ValueError(f"model.layer_pattern / {', '.join(silent) or cfg.attention.name}: the "
                         "probes read attention probabilities in stacks of one kind "
                         "(`TokenMixer.records_attention_weights`); probe a model with "
                         "layer_pattern='' and a mixer that records them")


def _split_tokens(tokens_BxT1: jax.Array) -> tuple[jax.Array, jax.Array]:
    if tokens_BxT1.ndim != 2 or tokens_BxT1.shape[1] < 3:
        raise ValueError(f"tokens_BxT1 has shape {tuple(tokens_BxT1.shape)}: expected B×(T+1) "
                         "token ids with T ≥ 2 (inputs tokens[:, :-1], targets tokens[:, 1:])")
    return tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]


# The probe-only forward ---------------------------------------------------------------------------

class _InputTap:
    """Stands in for `module` in the probe's merged copy of a block: calls it and keeps the
    inputs it was called with (traced values, read within the same trace)."""

    def __init__(self, module):
        self.module, self.inputs = module, []

    def __call__(self, x, *args, **kwargs):
        self.inputs.append(x)
        return self.module(x, *args, **kwargs)


def _mean_square(x) -> jax.Array:
    return jnp.mean(jnp.square(x.astype(jnp.float32)))


def _norm_statistics(norm, x_BxTxD) -> dict[str, jax.Array]:
    """Per-token mean μ_t, variance σ²_t = mean_d (x − μ_t)² and RMS √(mean_d x²) of a norm's
    input, each averaged over the B·T tokens; the mean and (population) std of its gain `scale`
    over its entries, NaN for a norm without a gain."""
    x32 = x_BxTxD.astype(jnp.float32)
    mean_BxT = jnp.mean(x32, axis=-1)
    scale = getattr(norm, "scale", None)
    gain = (scale[...].astype(jnp.float32) if scale is not None
            else jnp.full((1,), jnp.nan, jnp.float32))
    return {"input_mean": jnp.mean(mean_BxT),
            "input_variance": jnp.mean(jnp.var(x32, axis=-1)),
            "input_rms": jnp.mean(jnp.sqrt(jnp.mean(x32**2, axis=-1))),
            "gain_mean": jnp.mean(gain), "gain_std": jnp.std(gain)}


def _head_similarity(weights_BxKxGxTxS) -> jax.Array:
    """H×H mean cosine between attention-probability rows of two heads, over the batch and the
    queries t ≥ 1 (query 0 attends only to itself in every head)."""
    b, k, g, t, s = weights_BxKxGxTxS.shape
    rows_BxHxTxS = weights_BxKxGxTxS.reshape(b, k * g, t, s)[:, :, 1:].astype(jnp.float32)
    rows_BxHxTxS = rows_BxHxTxS / jnp.linalg.norm(rows_BxHxTxS, axis=-1, keepdims=True)
    return jnp.einsum("bhts,bgts->hg", rows_BxHxTxS, rows_BxHxTxS) / (b * (t - 1))


def _rank_one_residual(x_BxTxD) -> jax.Array:
    """Mean over sequences of ‖X − 1x̄ᵀ‖_F / ‖X‖_F, X = one sequence's T×D matrix, x̄ its mean
    token (the Frobenius-optimal rank-1 matrix of the form 1xᵀ)."""
    x32 = x_BxTxD.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=1, keepdims=True)
    return jnp.mean(jnp.linalg.norm(centered, axis=(1, 2)) / jnp.linalg.norm(x32, axis=(1, 2)))


def _nan_sublayer(heads: int) -> dict:
    nan = jnp.float32(jnp.nan)
    return {"branch_rms": nan, "update_ratio": nan,
            "norm": dict.fromkeys(NORM_STATISTICS, nan),
            "head_similarity": jnp.full((heads, heads), jnp.nan, jnp.float32),
            "ffn_sparsity": nan, "ffn_dead_units": nan, "ffn_mean_abs": nan, "ffn_rms": nan}


def _readout(model: TransformerLM, state) -> jax.Array:
    """h of a residual state off the loss path (module docstring), B×T×D: the stream's
    `hidden_state` of a stop-gradient copy of the state."""
    return model.residual_stream.hidden_state(jax.lax.stop_gradient(state))


class _AttentionWeightsTap:
    """Stands in for a block's attention module: runs it under `nnx.capture` of its attention
    probabilities (`arch.attention.AttentionWeights`) and keeps them."""

    def __init__(self, attention):
        self.module, self.weights = attention, []

    def __call__(self, *args):
        output, captured = nnx.capture(self.module, AttentionWeights)(*args)
        self.weights.append(captured["attention_weights"][0])
        return output


class _UpdateTap:
    """The capture point of `Block.sublayer` (its `tap`): keeps the sublayer's update F and
    hands on F + `perturbation` (None: F unchanged)."""

    def __init__(self, perturbation_BxTxD=None):
        self.perturbation, self.updates = perturbation_BxTxD, []

    def __call__(self, update_BxTxD):
        self.updates.append(update_BxTxD)
        return update_BxTxD if self.perturbation is None else update_BxTxD + self.perturbation


def _probe_block(block, state, positions_BxT, rotate, threshold, heads: int, readout=None,
                 output_perturbation_BxTxD=None):
    """Run one block through the model's own `Block.sublayer`, with taps on its norm, attention
    and FFN down projection and at the sublayer's capture point, and measure it: returns (block
    output state, per-block statistics with a leading sublayer axis of 2). Single stream:
    `readout` and `output_perturbation_BxTxD` are None. Otherwise `readout` maps a state to its h
    and the perturbation is added to the update of the block's last sublayer (u_{i+1})."""
    per_sublayer = []
    last = "ffn" if block.use_ffn else "attention"
    for name in SUBLAYERS:
        if name == "ffn" and not block.use_ffn:
            per_sublayer.append(_nan_sublayer(heads))
            continue
        stats = _nan_sublayer(heads)
        residual = getattr(block, f"{name}_residual")
        norm = getattr(residual, "norm", None)  # None: `probe_norm` names it, if there is one
        if norm is not None:
            residual.norm = _InputTap(norm)
        module = getattr(block, name)
        if name == "attention":
            block.attention = _AttentionWeightsTap(module)
        elif isinstance(getattr(module, "down", None), Dense):  # not an MoE
            module.down = _InputTap(module.down)
        tap = _UpdateTap(output_perturbation_BxTxD if name == last else None)
        new_state, _ = block.sublayer(name, state, positions_BxT, rotate, None, tap)
        (update,) = tap.updates
        if name == "attention":
            (weights,), block.attention = block.attention.weights, module
            stats["head_similarity"] = _head_similarity(weights)
        elif isinstance(getattr(module, "down", None), _InputTap):
            (hidden,), module.down = module.down.inputs, module.down.module
            hidden = hidden.astype(jnp.float32)
            quiet = jnp.abs(hidden) < threshold
            stats.update(ffn_sparsity=jnp.mean(quiet),
                         ffn_dead_units=jnp.mean(jnp.all(quiet, axis=(0, 1))),
                         ffn_mean_abs=jnp.mean(jnp.abs(hidden)),
                         ffn_rms=jnp.sqrt(jnp.mean(hidden**2)))
        if norm is not None:
            (norm_input,), residual.norm = residual.norm.inputs, norm
            stats["norm"] = _norm_statistics(norm, norm_input)
            sublayer_input = state if readout is None else norm_input
        else:
            probed = residual.probe_norm(state)
            if probed is not None:
                stats["norm"] = _norm_statistics(*probed)
            sublayer_input = state if readout is None else readout(state)
        update32, s32 = update.astype(jnp.float32), sublayer_input.astype(jnp.float32)
        stats["branch_rms"] = jnp.sqrt(_mean_square(update32))
        stats["update_ratio"] = jnp.sqrt(jnp.mean(
            jnp.sum(update32**2, axis=-1) / jnp.sum(s32**2, axis=-1)))
        per_sublayer.append(stats)
        state = new_state
    return state, jax.tree.map(lambda *s: jnp.stack(s), *per_sublayer)


def _boundary_statistics(x_BxTxD) -> dict[str, jax.Array]:
    return {"hidden_rms": jnp.sqrt(_mean_square(x_BxTxD)),
            "rank_collapse": _rank_one_residual(x_BxTxD)}


def _walk(model: TransformerLM, tokens_BxT1, perturbations, threshold):
    """The probe-only forward: (loss, statistics). `perturbations` is (stack_shape × B×T×D,
    B×T×D), all zero, whose gradients are the gradients at the boundaries: single stream, added
    to each block's input and to the last block's output (∂loss/∂x_i); otherwise added to the
    update of each block's last sublayer and to the embedding (∂loss/∂u_i)."""
    cfg = model.cfg
    single = has("residual", cfg.residual.name, SINGLE_STREAM)
    inputs_BxT, targets_BxT = _split_tokens(tokens_BxT1)
    positions_BxT = jnp.broadcast_to(jnp.arange(inputs_BxT.shape[1]), inputs_BxT.shape)
    block_perturbations, other_perturbation = perturbations
    x_BxTxD = model.position.embed(model.embed(inputs_BxT), positions_BxT)
    if not single:
        x_BxTxD = x_BxTxD + other_perturbation  # u_0
    state = model.residual_stream.begin(constrain(x_BxTxD, STREAM))
    graphdef, layer_params, layer_states = nnx.split(model.blocks, nnx.Param, ...)
    grouped = interleaves_moe(cfg)
    readout = None if single else functools.partial(_readout, model)

    def run_unit(state, layer):
        params, states, unit_perturbations = layer
        unit = nnx.merge(graphdef, params, states)
        members = ([getattr(unit, f"block_{j}") for j in range(unit.size)] if grouped
                   else [unit])
        if not grouped:
            unit_perturbations = unit_perturbations[None]
        per_block = []
        for block, perturbation in zip(members, unit_perturbations, strict=True):
            if single:
                state = h_in = state + perturbation
            else:
                h_in = readout(state)
            boundary = _boundary_statistics(h_in)
            state, stats = _probe_block(block, state, positions_BxT, model.position.rotate,
                                        threshold, cfg.attention.num_heads, readout,
                                        None if single else perturbation)
            h_out = state if single else readout(state)
            h_in32, h_out32 = h_in.astype(jnp.float32), h_out.astype(jnp.float32)
            cosine = jnp.sum(h_in32 * h_out32, -1) / (
                jnp.linalg.norm(h_in32, axis=-1) * jnp.linalg.norm(h_out32, axis=-1))
            per_block.append({**stats, **boundary, "block_influence": 1 - jnp.mean(cosine)})
        return state, jax.tree.map(lambda *s: jnp.stack(s), *per_block)

    state, per_block = jax.lax.scan(run_unit, state,
                                    (layer_params, layer_states, block_perturbations))
    per_block = jax.tree.map(lambda s: s.reshape(cfg.num_layers, *s.shape[2:]), per_block)
    x_BxTxD = model.residual_stream.end(state)
    if single:
        x_BxTxD = x_BxTxD + other_perturbation
    final = {**_boundary_statistics(x_BxTxD), "norm": (
        _norm_statistics(model.final_norm, x_BxTxD) if model.final_norm is not None
        else dict.fromkeys(NORM_STATISTICS, jnp.float32(jnp.nan)))}
    loss = next_token_loss(model.logits_of_hidden(x_BxTxD), targets_BxT)
    return loss, (per_block, final)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _profile(graphdef, state, tokens_BxT1, threshold, gradients: bool):
    model = nnx.merge(graphdef, state)  # for its static attributes
    cfg, dtype = model.cfg, jnp.dtype(model.cfg.dtype)
    b, t = tokens_BxT1.shape[0], tokens_BxT1.shape[1] - 1
    zeros = (jnp.zeros((*model.stack_shape, b, t, cfg.d_model), dtype),
             jnp.zeros((b, t, cfg.d_model), dtype))

    def loss_fn(state, perturbations):
        # New Variables at this trace level: BatchNorm in training mode writes its statistics.
        model = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
        return _walk(model, tokens_BxT1, perturbations, threshold)

    if not gradients:
        loss, (per_block, final) = loss_fn(state, zeros)
        return loss, per_block, final, None
    (loss, (per_block, final)), (block_grads, other_grad) = jax.value_and_grad(
        loss_fn, argnums=1, has_aux=True)(state, zeros)
    block_grads = block_grads.reshape(cfg.num_layers, b, t, cfg.d_model)
    ordered = ([block_grads, other_grad[None]] if has("residual", cfg.residual.name, SINGLE_STREAM)
               else [other_grad[None], block_grads])  # boundaries 0..L
    grads = jnp.concatenate(ordered).astype(jnp.float32)
    gradient_rms = jnp.sqrt(jnp.mean(grads**2, axis=(1, 2, 3)))
    return loss, per_block, final, gradient_rms


def depth_profile(model: TransformerLM, tokens_BxT1: jax.Array, *,
                  sparsity_threshold: float = DEFAULT_SPARSITY_THRESHOLD,
                  gradients: bool = True) -> dict:
    """Per-depth statistics of one batch from one probe forward and backward pass (jitted; the
    compile is reused for models with the same graph; `gradients=False`: forward only, no
    gradient_rms). Every residual mechanism but the reversible stack. L blocks, H heads; h_i the
    hidden state at boundary i (B×T×D: the stream x_i for a single stream, the readout of the
    residual state otherwise; definitions by mechanism in the module docstring), F the output of
    a sublayer (B×T×D), RMS over all entries unless said.

    Returns a dict of numpy arrays (float64) and floats:
      loss              next-token cross-entropy of the batch (nats), equal to the model's own.
      hidden_rms        (L+1,) RMS of h_i over B·T·D.
      gradient_rms      (L+1,) RMS over B·T·D of ∂loss/∂x_i (single stream) or ∂loss/∂u_i (the
                        other mechanisms: u_i the embedding or the last update written before
                        boundary i, see the module docstring); loss per unit of hidden state;
                        the loss is a mean over B·T tokens, so entries carry a factor 1/(B·T).
      rank_collapse     (L+1,) res(h_i): mean over the B sequences of ‖X − 1x̄ᵀ‖_F / ‖X‖_F with
                        X the sequence's T×D matrix and x̄ its mean token, the Frobenius-optimal x
                        (Dong et al. 2021's distance from rank 1, in the Frobenius norm); 0 when
                        every token is the same vector.
      block_influence   (L,) BI_i = 1 − mean over the B·T tokens of cos(h_i,t, h_{i+1},t)
                        (ShortGPT, Men et al. 2024, eq. 1); 0 for a block that leaves h unchanged
                        (up to scale).
      branch_rms        (L, 2) RMS of each sublayer's F (attention, FFN).
      update_ratio      (L, 2) √(mean over tokens of ‖F_t‖² / ‖s_t‖²), ‖·‖ over D, s the
                        sublayer's input before its own normalization (single stream: the stream
                        the sublayer reads, before its write; others: module docstring): the RMS
                        over tokens of the update-to-input ratio.
      norms             {"attention", "ffn"}: dict of (L,) arrays, and {"final"}: dict of floats,
                        each with input_mean, input_variance, input_rms (per-token mean μ_t,
                        variance mean_d (x − μ_t)², RMS √(mean_d x²) of the norm's input,
                        averaged over tokens) and gain_mean, gain_std (mean and population std of
                        the norm's `scale` entries; NaN without a gain; ScaleNorm's is one
                        scalar). "attention"/"ffn" are the sublayer residual's norm (module
                        docstring): its input is what that norm reads (the stream s for a
                        pre-norm, s + F for a post-norm, a multi-stream read's mixture), or what
                        the mechanism's `probe_norm` names; NaN for a mechanism without a norm.
                        "final" reads h_L (NaN without one).
      ffn_sparsity      (L,) fraction of the FFN hidden activations a (what feeds the down
                        projection: φ(xW₁), or φ(xW) ⊙ xV for gated FFNs; B·T·d_ff values) with
                        |a| < `sparsity_threshold` (absolute, default 1e-2).
      ffn_dead_units    (L,) fraction of the d_ff hidden units j with |a_j| < `sparsity_threshold`
                        at every one of the B·T tokens: units never active on the batch (a
                        ReLU unit whose pre-activation is negative everywhere is one).
      ffn_mean_abs      (L,) mean |a|;  ffn_rms (L,) √(mean a²). NaN for MoE FFNs.
      head_similarity   (L, H, H) mean over the batch and over queries t ≥ 1 of the cosine
                        between two heads' attention-probability rows (over keys s ≤ t); the
                        diagonal is 1, 1 off it for heads that attend identically.
    """
    require_probeable(model.cfg)
    _split_tokens(tokens_BxT1)
    graphdef, state = nnx.split(model)
    loss, per_block, final, gradient_rms = jax.device_get(_profile(
        graphdef, state, jnp.asarray(tokens_BxT1), jnp.float32(sparsity_threshold), gradients))
    as_array = functools.partial(np.asarray, dtype=np.float64)
    per_block = jax.tree.map(as_array, per_block)
    profile = {
        "loss": float(loss),
        "hidden_rms": np.append(per_block["hidden_rms"], final["hidden_rms"]),
        "rank_collapse": np.append(per_block["rank_collapse"], final["rank_collapse"]),
        "block_influence": per_block["block_influence"],
        "branch_rms": per_block["branch_rms"],
        "update_ratio": per_block["update_ratio"],
        "norms": {"attention": {k: v[:, 0] for k, v in per_block["norm"].items()},
                  "ffn": {k: v[:, 1] for k, v in per_block["norm"].items()},
                  "final": {k: float(v) for k, v in final["norm"].items()}},
        "head_similarity": per_block["head_similarity"][:, 0],
    }
    for name in ("ffn_sparsity", "ffn_dead_units", "ffn_mean_abs", "ffn_rms"):
        profile[name] = per_block[name][:, 1]
    if gradients:
        profile["gradient_rms"] = as_array(gradient_rms)
    return profile
