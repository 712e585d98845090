"""Dropout (Srivastava et al. 2014, "Dropout: A Simple Way to Prevent Neural Networks from
Overfitting"), inverted: y = m ⊙ x / (1 − p), m_i ~ Bernoulli(1 − p) independently, so that
E[y] = x and evaluation needs no rescaling. Sites (`model.dropout.<site>`, each its own rate p):

- `embedding`: x⁰ = position.embed(E[tokens]), before the first block;
- `attention_probs`: the softmax probabilities A (B×K×G×T×S) before A·V (Vaswani et al. 2017
  §5.4 "attention dropout"; explicit-scores `xla` kernel only);
- `attention_output`: the attention sublayer's output u = attention(h), before the residual write;
- `ffn_hidden`: the FFN's hidden activations φ(xW) (gated: φ(xW) ⊙ xV), before W₂ (fairseq's
  "activation dropout"); also the MoE experts' hidden activations;
- `residual`: every sublayer's update u before `write` (Vaswani et al. §5.4 "residual
  dropout"), after `attention_output` on the attention sublayer (independent masks, so the
  attention output is kept with probability (1 − p_attention_output)(1 − p_residual)).

Keys are pure functions of (seed, step, accumulation microbatch) and, inside the model, of
(layer, sublayer, site): `train_key(seed, step, microbatch)` gives the model's key, which
`model(tokens, positions, dropout_key=key)` takes; the layer scan receives one key per scan unit
as a scanned input (`layer_keys`), and `Dropout.at` folds in the rest. Nothing is drawn from a
stateful counter (`nnx.Rngs`), so a resumed or re-sharded run draws the same masks as an
uninterrupted one, and a reversible block's backward pass, or any recomputation (remat, the
AttnRes block scan), replays the masks of the forward pass.

Sharding: a mask is `jax.random.bernoulli(key, 1 − p, x.shape)` of the whole logical array, a
function of (key, shape) alone, whatever the sharding (JAX's semantics); with
`jax_threefry_partitionable` (the default since JAX 0.5) each device draws only its own shard,
without communication. The flag changes which bits a key gives, so a run must resume with the
same setting. Masks are drawn in the tokens' array order, which is why sequence parallelism
(striped order) and the pipeline (per-microbatch arrays) refuse dropout (`config.resolve`).

Sites inside sublayer modules (attention probabilities, FFN hidden) read the sublayer's
`Dropout` from a context that `Block.sublayer` sets around the module call (`active`), so the
attention and FFN registries keep their call signatures; outside that context, and whenever no
key is given (evaluation, generation), dropout is the identity and adds nothing to the jaxpr.

No parameters. Cost: one random bit-draw and a select per element at each active site, in
training only.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from config.model_rules import DROPOUT_SITES as SITES

# The stream a model's keys are drawn from, folded into jax.random.key(seed): far from the small
# counters nnx.Rngs folds in for initialization, so masks and initial weights are unrelated.
_DROPOUT_STREAM = 0x44524F50  # "DROP"
_EMBEDDING, _LAYERS = 0, 1  # what the model key folds in first: the embedding site, or layers
_SUBLAYERS = {"attention": 0, "ffn": 1}


def rates(cfg) -> dict[str, float]:
    """The rate of every site from the `model` section ({} when it has no `dropout` section)."""
    section = cfg.get("dropout") if hasattr(cfg, "get") else None
    return {site: float(section[site]) for site in SITES} if section is not None else {}


def enabled(cfg) -> bool:
    """Whether any site of `cfg` (the `model` section) has a positive rate."""
    return any(rate > 0 for rate in rates(cfg).values())


def train_key(seed, step, microbatch=0) -> jax.Array:
    """The model's dropout key for training step `step` (accumulation microbatch `microbatch`):
    fold_in(fold_in(fold_in(key(seed), DROPOUT_STREAM), step), microbatch). Traceable."""
    key = jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM)
    return jax.random.fold_in(jax.random.fold_in(key, step), microbatch)


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    """Inverted dropout: m ⊙ x / (1 − rate), m ~ Bernoulli(1 − rate) per element, in x's dtype.
    `rate` is a Python float in [0, 1); 0 returns x itself."""
    if rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


@dataclasses.dataclass(frozen=True)
class Dropout:
    """Rates by site (static) and a key (traced): `dropout(x, site)` masks x with the key folded
    with the site's index. `at(*indices)` folds indices into the key (layer, sublayer, block of a
    group); `layer_keys(units)` the per-unit key data the layer scan carries, `from_key_data`
    rebuilds one from it."""

    site_rates: tuple[tuple[str, float], ...]
    key: jax.Array

    @classmethod
    def for_model(cls, cfg, key: jax.Array | None) -> Dropout | None:
        """The model-level dropout of `cfg` (the `model` section) with `key`; None (no dropout,
        nothing traced) when the key is None or every rate is 0."""
        if key is None or not enabled(cfg):
            return None
        return cls(tuple(rates(cfg).items()), key)

    def rate(self, site: str) -> float:
        return dict(self.site_rates)[site]

    def at(self, *indices) -> Dropout:
        key = self.key
        for index in indices:
            key = jax.random.fold_in(key, index)
        return dataclasses.replace(self, key=key)

    def __call__(self, x: jax.Array, site: str) -> jax.Array:
        return dropout(x, self.rate(site), jax.random.fold_in(self.key, SITES.index(site)))

    def embedding(self, x_BxTxD: jax.Array) -> jax.Array:
        return self.at(_EMBEDDING)(x_BxTxD, "embedding")

    def layer_keys(self, units: int) -> jax.Array:
        """Raw key data of scan unit l = 0..units−1: fold_in(fold_in(key, LAYERS), l), stacked
        (uint32, scanned alongside the stacked parameters)."""
        layers = jax.random.fold_in(self.key, _LAYERS)
        return jax.vmap(lambda unit: jax.random.key_data(jax.random.fold_in(layers, unit)))(
            jnp.arange(units))

    def from_key_data(self, key_data: jax.Array) -> Dropout:
        return dataclasses.replace(self, key=jax.random.wrap_key_data(key_data))

    def sublayer(self, name: str) -> Dropout:
        """The dropout of sublayer `name` ("attention" or "ffn") of a block."""
        return self.at(_SUBLAYERS[name])

    def output(self, update_BxTxD: jax.Array, name: str) -> jax.Array:
        """A sublayer's update before the residual write: `attention_output` (the attention
        sublayer only), then `residual`."""
        if name == "attention":
            update_BxTxD = self(update_BxTxD, "attention_output")
        return self(update_BxTxD, "residual")


_ACTIVE: contextvars.ContextVar[Dropout | None] = contextvars.ContextVar("dropout", default=None)


@contextlib.contextmanager
def active(sublayer_dropout: Dropout | None) -> Iterator[None]:
    """Within the block: the sublayer's `Dropout` for the sites inside its modules (`apply`)."""
    token = _ACTIVE.set(sublayer_dropout)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def apply(x: jax.Array, site: str) -> jax.Array:
    """Dropout at `site` inside a sublayer module: masked under `active` with a positive rate,
    else x itself."""
    current = _ACTIVE.get()
    return x if current is None else current(x, site)


def active_rate(site: str) -> float:
    """The rate `apply(x, site)` would use now (0 outside `active`)."""
    current = _ACTIVE.get()
    return 0.0 if current is None else current.rate(site)
