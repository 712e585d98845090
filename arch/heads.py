"""Output heads: final hidden state → vocabulary scores. Registry: `HEADS[name](cfg, rngs=...)`,
called as `head(x_BxTxD, embedding) -> BxTxV`. What the model, the loss, accounting and the
softmax-bottleneck math ask of a head is declared on `OutputHead`; a new head is its file (or
class here), its test and its record in `config.catalogue`.

A head returns either logits or normalized log-probabilities: the loss
(`optax.softmax_cross_entropy_with_integer_labels`) applies log_softmax, which leaves normalized
log-probabilities unchanged, so both are correct scores for training and sampling. Heads that
return log-probabilities say so.

A head whose scores are one softmax of a d-dimensional context (`rank_bounded`, the default) has
a log-probability matrix of rank ≤ d + 1 (the softmax bottleneck, `arch.bottleneck`); `mos` and
`sigsoftmax` are not so bounded.

Config: `model.head` names the head; `model.head.bias` adds an output bias b ∈ R^V (zeros, logical
axis `vocab`) to every head; `model.head.mos_components` (K) and `model.head.mos_tied` configure
`mos` and `moc`.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from arch.init import group_init
from arch.layers import Dense, Embedding, param
from arch.registry import Registry

HEADS = Registry("head")


class OutputHead(nnx.Module):
    """The base class of the output heads in `HEADS`, and the class that declares everything the
    framework asks of one, so that no caller names a head. Subclasses implement `__call__`;
    every other hook has the default documented on it.

        build        `__init__(cfg, *, rngs)`: `cfg` the `model` section, `model.head` its
                     options (rules in `config.model_rules` and its record, `config.catalogue`)
        scores       `__call__(x_BxTxD, embedding) -> B×T×V`, from the final norm's output and
                     the model's token `Embedding` (a tied head multiplies by its table): logits
                     or normalized log-probabilities, which the cross-entropy loss, sampling and
                     distillation treat alike (log_softmax leaves log-probabilities unchanged)
        loss terms   the training loss is the cross-entropy of these scores; a head adds a term of
                     its own by holding an `arch.moe.AuxLoss` variable that its forward pass
                     overwrites (the train step adds every one, as for MoE's balancing losses)
        training-only modules
                     multi-token prediction (`model.head.mtp_depth`, arch/mtp.py) is built by the
                     model beside the head, runs only in the training loss
                     (`TransformerLM.multi_token_logits`) and reads every depth's scores through
                     this same head; accounting counts its parameters as component "mtp" and its
                     FLOPs in training only
        bottleneck   `rank_bounded`: whether the log-probability matrix over contexts has rank
                     ≤ d + 1, one softmax of a d-dimensional context (`arch.bottleneck`)
        accounting   `reused_matmul_parameters(cfg)`: weights a token multiplies beyond each
                     Dense kernel once; parameters are measured from the built module
                     (component "head"; a tied table counts as "embedding")
        sharding     parameters carry logical axis names ("vocab" over `tensor`, "embed" over
                     `fsdp`); the model pins the scores to (act_batch, act_seq, act_vocab)
    """

    rank_bounded: ClassVar[bool] = True

    def __call__(self, x_BxTxD: jax.Array, embedding: Embedding) -> jax.Array:
        raise NotImplementedError(f"{type(self).__name__} implements no scores")

    @classmethod
    def reused_matmul_parameters(cls, cfg) -> int:
        """Weights a token multiplies beyond each Dense kernel once (FLOP accounting). Default
        0: the head's matmuls are its own Dense kernels."""
        return 0


def _output_bias(cfg, rngs: nnx.Rngs) -> nnx.Param | None:
    """b ∈ R^V, zero-initialized, logical axis `vocab`; None unless `model.head.bias`."""
    return param(rngs, nnx.initializers.zeros, (cfg.vocab_size,), ("vocab",)) if cfg.head.bias \
        else None


@HEADS.register("tied")
class TiedHead(OutputHead):
    """Tied head (Press & Wolf 2017, "Using the Output Embedding to Improve Language Models"):
    logits = x Eᵀ (+ b) with E the input embedding. No parameters besides the optional bias b
    (`model.head.bias`, zero-initialized)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.bias = _output_bias(cfg, rngs)

    @staticmethod
    def reused_matmul_parameters(cfg) -> int:
        return cfg.vocab_size * cfg.d_model  # E, used again as the output projection

    def __call__(self, x_BxTxD: jax.Array, embedding: Embedding) -> jax.Array:
        logits_BxTxV = embedding.attend(x_BxTxD)
        if self.bias is not None:
            logits_BxTxV = logits_BxTxV + self.bias[...].astype(logits_BxTxV.dtype)
        return logits_BxTxV


@HEADS.register("untied")
class UntiedHead(OutputHead):
    """Untied head: logits = x W_out (+ b), W_out ∈ R^{d×V} initialized by `model.init.head`
    (default variance 1/d), b ∈ R^V zero-initialized when `model.head.bias`."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.output = Dense((cfg.d_model,), (cfg.vocab_size,), ("embed",), ("vocab",), rngs=rngs,
                            dtype=jnp.dtype(cfg.dtype), use_bias=cfg.head.bias,
                            init=group_init(cfg, "head"))

    def __call__(self, x_BxTxD: jax.Array, embedding: Embedding) -> jax.Array:
        del embedding
        return self.output(x_BxTxD)


@HEADS.register("sigsoftmax")
class SigSoftmaxHead(TiedHead):
    """Sigsoftmax (Kanai, Fujiwara, Yamanaka & Adachi 2018, "Sigsoftmax: Reanalysis of the
    Softmax Bottleneck", NeurIPS, eq. 8): with the tied head's logits z = x Eᵀ (+ b),

        p(v | x) = exp(z_v) σ(z_v) / Σ_w exp(z_w) σ(z_w),
        log p    = log_softmax(z + log σ(z)),

    computed in float32 with σ in log space (`jax.nn.log_sigmoid`). log σ is not linear in z, so
    the log-probability matrix over contexts is not bounded by rank d + 1 as a softmax's is, at
    no extra parameters (the tied head's: the embedding, an optional bias). Returns normalized
    log-probabilities. Cost: one log-sigmoid per vocabulary entry."""

    rank_bounded: ClassVar[bool] = False

    def __call__(self, x_BxTxD: jax.Array, embedding: Embedding) -> jax.Array:
        z_BxTxV = super().__call__(x_BxTxD, embedding).astype(jnp.float32)
        return jax.nn.log_softmax(z_BxTxV + jax.nn.log_sigmoid(z_BxTxV), axis=-1)


class _MixtureHead(OutputHead):
    """Parameters shared by `mos` and `moc` (Yang et al. 2018, "Breaking the Softmax Bottleneck:
    A High-Rank RNN Language Model", ICLR, §3.2–3.3), with K = `model.head.mos_components`:

        π_k = softmax_k(h W_π)        W_π ∈ R^{d×K}    (mixing weights)
        h_k = tanh(h W_k)             W_k ∈ R^{d×d}    (one context per component)
        scores_k = h_k E_outᵀ (+ b)   E_out ∈ R^{V×d}

    E_out is the input embedding when `model.head.mos_tied` (the paper ties it), else an own d×V
    matrix; b is the optional `model.head.bias`, shared by the components. No biases inside π or
    h_k (as in the paper's equations). Initialization: W_π, W_k and an untied E_out follow
    `model.init.head` (default: variance 1/fan_in = 1/d); b = 0. Logical axes: W_π (embed,
    head_mixture), W_k (embed, head_mixture, head_context) — the context width is sharded over
    `tensor` like an MLP hidden layer.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        d, k, v = cfg.d_model, cfg.head.mos_components, cfg.vocab_size
        self.dtype = jnp.dtype(cfg.dtype)
        init = group_init(cfg, "head")
        self.mixing = Dense((d,), (k,), ("embed",), ("head_mixture",), rngs=rngs, dtype=self.dtype,
                            init=init)
        self.contexts = Dense((d,), (k, d), ("embed",), ("head_mixture", "head_context"),
                              rngs=rngs, dtype=self.dtype, init=init)
        self.output = (None if cfg.head.mos_tied else Dense((d,), (v,), ("embed",), ("vocab",),
                                                       rngs=rngs, dtype=self.dtype, init=init))
        self.bias = _output_bias(cfg, rngs)

    def log_mixing_weights(self, x_BxTxD: jax.Array) -> jax.Array:
        """log π_k, float32, [B, T, K]."""
        return jax.nn.log_softmax(self.mixing(x_BxTxD).astype(jnp.float32), axis=-1)

    def component_contexts(self, x_BxTxD: jax.Array) -> jax.Array:
        """h_k = tanh(h W_k), compute dtype, [B, T, K, d]."""
        return jnp.tanh(self.contexts(x_BxTxD))

    def project(self, h_BxTx___xD: jax.Array, embedding: Embedding) -> jax.Array:
        """h E_outᵀ (+ b) over the last axis of a [B, T, ..., d] array, in the compute dtype.
        Tied: through `embedding.attend` (the tied head's own projection), with the middle axes
        folded into the sequence axis."""
        if self.output is None:
            batch, *middle, d = h_BxTx___xD.shape
            h_BxNxD = h_BxTx___xD.astype(self.dtype).reshape(batch, -1, d)
            scores = embedding.attend(h_BxNxD).reshape(batch, *middle, -1)
        else:
            scores = self.output(h_BxTx___xD)
        if self.bias is not None:
            scores = scores + self.bias[...].astype(scores.dtype)
        return scores


@HEADS.register("mos")
class MixtureOfSoftmaxes(_MixtureHead):
    """Mixture of Softmaxes (Yang et al. 2018, §3.2, the MoS equation):

        p(v | h) = Σ_k π_k softmax(h_k E_outᵀ)_v,

    computed stably in log space:

        log p = logsumexp_k(log π_k + log_softmax(h_k E_outᵀ)).

    Each component is normalized separately, so the log-probability matrix is not limited to rank
    d + 1 (the softmax bottleneck). Returns normalized log-probabilities (float32), not logits;
    the cross-entropy loss is unchanged by them (log_softmax is idempotent on log-probabilities).
    Parameters and initialization: see `_MixtureHead`. Cost: K vocabulary projections per token.
    """

    rank_bounded: ClassVar[bool] = False

    @staticmethod
    def reused_matmul_parameters(cfg) -> int:
        # E_out's kernel counts once
        projections = cfg.head.mos_components - (0 if cfg.head.mos_tied else 1)
        return projections * cfg.vocab_size * cfg.d_model

    def __call__(self, x_BxTxD: jax.Array, embedding: Embedding) -> jax.Array:
        log_pi_BxTxK = self.log_mixing_weights(x_BxTxD)
        scores_BxTxKxV = self.project(self.component_contexts(x_BxTxD), embedding)
        log_p_BxTxKxV = jax.nn.log_softmax(scores_BxTxKxV.astype(jnp.float32), axis=-1)
        return jax.nn.logsumexp(log_pi_BxTxK[..., None] + log_p_BxTxKxV, axis=-2)


@HEADS.register("moc")
class MixtureOfContexts(_MixtureHead):
    """Mixture of Contexts, the low-rank baseline of Yang et al. 2018 (§3.3, "MoC"): mix the
    contexts first, then take ONE softmax,

        h̄ = Σ_k π_k h_k,    logits = h̄ E_outᵀ (+ b).

    Same parameters and initialization as `mos` (see `_MixtureHead`), so comparing the two isolates
    the non-linearity of mixing probabilities; being a single softmax of a d-dimensional context,
    its log-probability matrix has rank ≤ d + 1 like the plain heads. Returns logits.
    """

    @staticmethod
    def reused_matmul_parameters(cfg) -> int:
        return cfg.vocab_size * cfg.d_model if cfg.head.mos_tied else 0

    def __call__(self, x_BxTxD: jax.Array, embedding: Embedding) -> jax.Array:
        pi_BxTxK = jnp.exp(self.log_mixing_weights(x_BxTxD))
        h_BxTxKxD = self.component_contexts(x_BxTxD)
        mixed_BxTxD = jnp.einsum("btk,btkd->btd", pi_BxTxK, h_BxTxKxD.astype(jnp.float32))
        return self.project(mixed_BxTxD.astype(self.dtype), embedding)
