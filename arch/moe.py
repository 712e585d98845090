"""Mixture-of-experts FFN, registered in `FFNS` as "moe" (so `model.ffn.name="moe"` puts it in every
block). Token-choice top-k routing with GShard-style capacity dispatch, optional shared experts,
and the Switch load-balancing and ST-MoE router z-loss auxiliary losses.

The auxiliary losses live in the module as `AuxLoss` variables (overwritten on every forward
pass); the train step adds every `AuxLoss` leaf of the model to the cross-entropy. The fraction of
dropped assignments is a `DroppedFraction` variable (a metric, never a loss). Both come out of the
model's layer scan stacked over layers, readable with `nnx.state(model, AuxLoss)`.

Expert parallelism: the stacked expert weights carry the logical axis "experts" (→ mesh axis
`expert`). Outside this layer the batch is split over data×fsdp×expert ("act_batch"); tokens are
dispatched into (B, E, C, d) where they live, then constrained to ("act_expert_batch",
"act_experts", ...): batch over data×fsdp only, experts over `expert`. GSPMD turns that change of
sharding into an all-to-all (and the reverse one after the experts).

Interleaving dense and MoE blocks (MoE every k-th layer) needs heterogeneous layers in the
model's scan and is not implemented here: `model.ffn.name="moe"` makes every block's FFN an MoE.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from arch.dropout import apply as dropout
from arch.ffn import FFNS, activation
from arch.init import group_init, truncated_normal
from arch.layers import Dense, param
from config import catalogue
from sharding.rules import constrain

_LOCAL = ("act_batch", None, None, "act_embed")  # (B, E, C, d) where the tokens live
_DISPATCHED = ("act_expert_batch", "act_experts", None, "act_embed")  # where the experts live
_DISPATCHED_HIDDEN = ("act_expert_batch", "act_experts", None, "act_mlp")


class AuxLoss(nnx.Variable):
    """A float32 scalar loss term, overwritten on every forward pass; the train step adds the
    sum of every `AuxLoss` in the model to the training objective (not to evaluation)."""


class DroppedFraction(nnx.Variable):
    """The fraction of the B·T·k routing assignments that found their expert full in the last
    forward pass (a metric, not a loss)."""


def _scalar(kind: type[nnx.Variable]) -> nnx.Variable:
    # Shape () with no logical names: stacked over layers it has shape (L,), replicated.
    return kind(jnp.zeros((), jnp.float32), out_sharding=(), eager_sharding=False)


def _router_init(fan_in: int, fan_out: int):
    """Router W_r: truncated normal with variance 1/d (fan_in = d)."""
    return truncated_normal(fan_in**-0.5)


def _with_width(cfg, d_ff: int) -> ml_collections.ConfigDict:
    """A copy of `cfg` with another `ffn.d_ff` (the shared experts' dense FFN of width s·f)."""
    copy = ml_collections.ConfigDict(cfg.to_dict())
    copy.ffn.d_ff = d_ff
    return copy


def route(logits_BxTxE: jax.Array, top_k: int, capacity_per_expert: int, renormalize: bool):
    """Token-choice top-k routing with capacity (GShard, Lepikhin et al. 2020, §2.2 / Alg. 1).

    p = softmax(logits); each token picks its k most probable experts; gate g = top-k p,
    renormalized to Σ g = 1 when `renormalize` (Mixtral) else raw (Switch/GShard).
    Slot assignment, per group (batch row): the B·T·k assignments are placed in order of (choice
    rank, then position): first-come-first-served by position within each choice rank, all first
    choices before any second choice. A token that finds its expert full is dropped for that
    choice: its contribution from that expert is zero and the residual stream carries it
    unchanged.

    Returns (probs_BxTxE, choices_BxTxKxE one-hot before capacity, dispatch_BxTxExC ∈ {0, 1},
    combine_BxTxExC = gate on the kept slots), all float32.
    """
    B, T, E = logits_BxTxE.shape
    probs_BxTxE = jax.nn.softmax(logits_BxTxE, axis=-1)
    top_BxTxK, experts_BxTxK = jax.lax.top_k(probs_BxTxE, top_k)
    gates_BxTxK = top_BxTxK / top_BxTxK.sum(-1, keepdims=True) if renormalize else top_BxTxK
    choices_BxTxKxE = jax.nn.one_hot(experts_BxTxK, E, dtype=jnp.int32)
    # Running count per expert in (rank, position) order: rank-major over the k·T assignments.
    ordered_BxKTxE = choices_BxTxKxE.transpose(0, 2, 1, 3).reshape(B, top_k * T, E)
    slot_BxKTxE = jnp.cumsum(ordered_BxKTxE, axis=1) - 1
    slot_BxTxKxE = slot_BxKTxE.reshape(B, top_k, T, E).transpose(0, 2, 1, 3)
    slot_BxTxK = (slot_BxTxKxE * choices_BxTxKxE).sum(-1)
    kept_BxTxK = slot_BxTxK < capacity_per_expert
    slots_BxTxKxC = jax.nn.one_hot(slot_BxTxK, capacity_per_expert) * kept_BxTxK[..., None]
    choices_BxTxKxE = choices_BxTxKxE.astype(jnp.float32)
    dispatch_BxTxExC = jnp.einsum("btke,btkc->btec", choices_BxTxKxE, slots_BxTxKxC)
    combine_BxTxExC = jnp.einsum("btke,btkc->btec", choices_BxTxKxE * gates_BxTxK[..., None],
                                 slots_BxTxKxC)
    return probs_BxTxE, choices_BxTxKxE, dispatch_BxTxExC, combine_BxTxExC


def balance_loss(probs_BxTxE: jax.Array, choices_BxTxKxE: jax.Array) -> jax.Array:
    """Switch Transformer load-balancing loss without its coefficient (Fedus et al. 2022,
    eqs. 4–6): E · Σ_e f_e · P_e, f_e = fraction of the B·T·k top-k assignments that chose e
    (before capacity), P_e = mean router probability of e. Equals 1 when f and P are uniform."""
    experts = probs_BxTxE.shape[-1]
    f_E = choices_BxTxKxE.mean((0, 1, 2))
    p_E = probs_BxTxE.mean((0, 1))
    return experts * jnp.sum(f_E * p_E)


def z_loss(logits_BxTxE: jax.Array) -> jax.Array:
    """Router z-loss without its coefficient (ST-MoE, Zoph et al. 2022, eq. 5):
    mean over tokens of (log Σ_e exp(logit_e))²."""
    return jnp.mean(jax.nn.logsumexp(logits_BxTxE, axis=-1) ** 2)


class RoutedExperts(nnx.Module):
    """E expert FFNs with stacked weights: gated, y_e = (φ(x W_e) ⊙ x V_e) W₂_e, when
    `model.moe.expert_ffn` has 3 projections (its record in `config.catalogue`; φ = its
    `gate_activation`), else
    y_e = φ(x W_e) W₂_e with φ = `model.ffn.activation`. W_e, V_e: (E, d, f) with logical axes
    ("experts", "embed", "mlp"); W₂_e: (E, f, d), ("experts", "mlp", "embed").
    Initialization: `model.init` groups ffn_input (W, V; fan_in = d) and ffn_output (W₂;
    fan_in = f), as the dense FFNs (per expert, Dense-like fans)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        E, d, f = cfg.moe.experts, cfg.d_model, cfg.moe.d_ff
        expert_ffn = FFNS[cfg.moe.expert_ffn]
        self.gated = catalogue.record("ffn", cfg.moe.expert_ffn).projections == 3
        self.activation = activation(cfg, expert_ffn.gate_activation if self.gated else None)
        input_init = group_init(cfg, "ffn_input")(d, f)
        inputs = ("experts", "embed", "mlp")
        matrix = dict(matrix=(1, 1))  # one d×f (f×d) map per expert
        self.gate = param(rngs, input_init, (E, d, f), inputs, **matrix) if self.gated else None
        self.up = param(rngs, input_init, (E, d, f), inputs, **matrix)
        self.down = param(rngs, group_init(cfg, "ffn_output")(f, d), (E, f, d),
                          ("experts", "mlp", "embed"), **matrix)
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x_BxExCxD: jax.Array) -> jax.Array:
        x = x_BxExCxD.astype(self.dtype)
        hidden_BxExCxF = jnp.einsum("becd,edf->becf", x, self.up[...].astype(self.dtype))
        if self.gated:
            gate_BxExCxF = jnp.einsum("becd,edf->becf", x, self.gate[...].astype(self.dtype))
            hidden_BxExCxF = self.activation(gate_BxExCxF) * hidden_BxExCxF
        else:
            hidden_BxExCxF = self.activation(hidden_BxExCxF)
        hidden_BxExCxF = dropout(hidden_BxExCxF, "ffn_hidden")  # training only (arch/dropout.py)
        hidden_BxExCxF = constrain(hidden_BxExCxF, _DISPATCHED_HIDDEN)
        return jnp.einsum("becf,efd->becd", hidden_BxExCxF, self.down[...].astype(self.dtype))


@FFNS.register("moe")
class MixtureOfExperts(nnx.Module):
    """Token-choice top-k mixture of experts (Shazeer et al. 2017; GShard, Lepikhin et al. 2020
    §2.2; Switch, Fedus et al. 2022; Mixtral, Jiang et al. 2024):

        logits = x W_r (float32),  p = softmax(logits),  gates g = top-k of p
                 (renormalized to Σ g = 1 when `model.moe.renormalize`, else raw)
        y = Σ_{e ∈ top-k(x), kept} g_e · FFN_e(x)  +  FFN_shared(x)

    E = `model.moe.experts`, k = `model.moe.top_k`, expert width f = `model.moe.d_ff`, expert FFN
    kind `model.moe.expert_ffn` (see `RoutedExperts`).

    Dispatch (`route`): groups are batch rows (T tokens each), capacity
    C = min(⌈`moe.capacity_factor`·k·T/E⌉, T) slots per expert and group; first-come-first-served
    by position within each choice rank (all first choices, in position order, before any second
    choice); a token that finds its expert full is dropped for that choice: its contribution from
    that expert is zero and the residual stream carries it unchanged. Tokens move through one-hot
    dispatch/combine tensors (B, T, E, C) and einsums. `model.moe.dropless=True`: C = T, every
    token fits (the exact top-k mixture) at O(B·T·E·T) memory for those tensors. Causality: with
    a finite capacity, a later token's first choice can take the slot an earlier token's second
    choice would have had, so which assignments are dropped depends on later tokens (as in GShard);
    dropless routing is causal.

    Shared experts (DeepSeekMoE, Dai et al. 2024 §3.2): s = `model.moe.shared_experts` always-on
    experts, implemented as one dense `moe.expert_ffn` FFN of width s·f added to the output.

    Auxiliary losses, overwritten in `AuxLoss` variables on each call:
    `balance_loss` = α · E · Σ_e f_e P_e (Switch eqs. 4–6; α = `model.moe.balance_coef`) and
    `z_loss` = β · mean(logsumexp(logits)²) (ST-MoE eq. 5; β = `model.moe.z_coef`);
    `dropped_fraction` (a `DroppedFraction`) = dropped / (B·T·k) assignments.

    Initialization: router W_r (d × E) truncated normal with variance 1/d (its own scheme, not a
    `model.init` group); experts and shared experts as the dense FFNs (`model.init` groups
    ffn_input / ffn_output).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.router = Dense((d,), (cfg.moe.experts,), ("embed",), (None,), rngs=rngs,
                            dtype=jnp.float32, init=_router_init)
        self.routed_experts = RoutedExperts(cfg, rngs=rngs)
        shared_width = cfg.moe.shared_experts * cfg.moe.d_ff
        self.shared_experts = (FFNS[cfg.moe.expert_ffn](_with_width(cfg, shared_width), rngs=rngs)
                               if shared_width else None)
        self.top_k, self.renormalize = cfg.moe.top_k, cfg.moe.renormalize
        self.dropless, self.capacity_factor = cfg.moe.dropless, cfg.moe.capacity_factor
        self.experts = cfg.moe.experts
        self.balance_coef, self.z_coef = cfg.moe.balance_coef, cfg.moe.z_coef
        self.balance_loss = _scalar(AuxLoss)
        self.z_loss = _scalar(AuxLoss)
        self.dropped_fraction = _scalar(DroppedFraction)

    def capacity(self, seq_len: int) -> int:
        """Slots per expert and group: C = min(⌈capacity_factor·k·T/E⌉, T) (GShard §2.2; more
        than T slots are never used, since a token picks k distinct experts); dropless: C = T."""
        if self.dropless:
            return seq_len
        needed = math.ceil(self.capacity_factor * self.top_k * seq_len / self.experts)
        return min(needed, seq_len)

    def dispatch(self, x_BxTxD: jax.Array):
        """Router logits and the `route` outputs for x (exposed for tests and probes)."""
        logits_BxTxE = self.router(x_BxTxD.astype(jnp.float32))
        routed = route(logits_BxTxE, self.top_k, self.capacity(x_BxTxD.shape[1]),
                       self.renormalize)
        return logits_BxTxE, *routed

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        logits_BxTxE, probs_BxTxE, choices_BxTxKxE, dispatch_BxTxExC, combine_BxTxExC = (
            self.dispatch(x_BxTxD))
        self.balance_loss[...] = self.balance_coef * balance_loss(probs_BxTxE, choices_BxTxKxE)
        self.z_loss[...] = self.z_coef * z_loss(logits_BxTxE)
        assignments = choices_BxTxKxE.shape[0] * choices_BxTxKxE.shape[1] * self.top_k
        self.dropped_fraction[...] = 1.0 - dispatch_BxTxExC.sum() / assignments

        dtype = x_BxTxD.dtype
        # Dispatch where the tokens are (batch over data×fsdp×expert), then reshard to experts
        # over `expert` (an all-to-all), run the experts, and reshard back before combining.
        local_BxExCxD = constrain(
            jnp.einsum("btec,btd->becd", dispatch_BxTxExC.astype(dtype), x_BxTxD), _LOCAL)
        expert_outputs_BxExCxD = constrain(
            self.routed_experts(constrain(local_BxExCxD, _DISPATCHED)), _DISPATCHED)
        y_BxTxD = jnp.einsum("btec,becd->btd", combine_BxTxExC.astype(dtype),
                             constrain(expert_outputs_BxExCxD.astype(dtype), _LOCAL))
        if self.shared_experts is not None:
            y_BxTxD = y_BxTxD + self.shared_experts(x_BxTxD).astype(dtype)
        return y_BxTxD
