"""Token mixers: softmax attention and its variants, and the protocol every mixer implements.
Registry: `ATTENTION[name](cfg, execution=..., rngs=...)` (the model section and the `execution`
section: kernel, tile, sequence attention; default `execution_config()`); called as
`attention(x_BxTxD, positions_BxT, rotate, cache) -> (y_BxTxD, cache)`. What the model, the decode
cache, accounting and the probes ask of a mixer is declared on `TokenMixer`; a new mixer is its
module (imported by name in `arch/__init__.py`), its test and its record in `config.catalogue`.

Shapes: B batch, T query positions, S key positions, D = d_model, H query heads, K key/value
heads (H = K·G, G queries per KV head), P head width; MLA adds C (the key/value latent), C' (the
query latent), N / R / V (per-head non-rotary, rotary and value widths).
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from arch.dropout import active_rate
from arch.dropout import apply as dropout
from arch.init import group_init
from arch.kernels.attention_implementations import (
    allowed_mask,
    blocked_attention,
    choose_implementation,
    cudnn_attention,
    splash_attention,
)
from arch.layers import Dense
from arch.norms import RMSNorm
from arch.registry import Registry
from arch.residual import is_capturing, record
from config.defaults import execution_config
from sharding.rules import constrain
from sharding.sequence import ring_attention, sequence_shards

ATTENTION = Registry("attention")


class TokenMixer(nnx.Module):
    """The base class of the token mixers in `ATTENTION`, and the class that declares everything
    the framework asks of one, so that the model, the decode cache, accounting, the probes and
    the sharding rules name no mixer. Subclasses implement `__call__`, `cache_shapes` and
    `score_flops_per_token`; every other hook has the default documented on it.

        build        `__init__(cfg, *, execution=None, rngs)`: `cfg` the `model` section (the
                     mixer's options: `model.attention`, or a section of its own such as
                     `model.mamba2`, with its rules in its record, `config.catalogue`),
                     `execution` the `execution` section (kernel, tile, sequence attention)
        forward      `__call__(x_BxTxD, positions_BxT, rotate, cache=None) -> (y_BxTxD, cache)`:
                     `rotate` is the position module's hook for queries and keys; training passes
                     no cache and gets None back, decoding passes the layer's cache and gets it
                     updated (the block's positions continue the cached ones)
        cache        `cache_shapes(cfg, batch, length)`, and the record's `recurrent_decoding`
                     capability (`config.catalogue`: a recurrent state of constant size;
                     without it, a KV cache that grows with the sequence),
                     `float32_cache` (entries kept in float32 whatever the compute dtype),
                     `init_cache` (zeros; `SoftmaxAttention` adds a sliding window's slot
                     positions), `cache_bytes`
        accounting   `score_flops_per_token(cfg, seq_len)`: forward FLOPs per token beyond the
                     Dense projections, which accounting counts from the built model's kernels
                     (`arch.accounting`); parameters are measured from the built module
                     (component "attention")
        probes       `records_attention_weights`: under `nnx.capture(mixer, AttentionWeights)` the
                     forward records "attention_weights", B×K×G×T×S probabilities over
                     `attention.num_heads` = K·G heads (default False: the probes refuse a stack
                     with this mixer); head ablation zeroes H-slices of a Dense `output` whose
                     kernel is H×…×D
        sharding     parameters carry logical axis names of `sharding.rules.LOGICAL_RULES` ("heads"
                     and "kv_heads" over `tensor`, "embed" over `fsdp`), activations are pinned with
                     `sharding.rules.constrain`; the mesh rules (`config.resolve`) check the head
                     counts against `mesh.tensor`
    """

    # Cache entries kept in float32 whatever the compute dtype (a recurrent state).
    float32_cache: ClassVar[tuple[str, ...]] = ()
    # Whether the forward records the attention probabilities for the probes (see above).
    records_attention_weights: ClassVar[bool] = False

    def __call__(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, rotate,
                 cache: dict | None = None) -> tuple[jax.Array, dict | None]:
        raise NotImplementedError(f"{type(self).__name__} implements no forward pass")

    @classmethod
    def cache_shapes(cls, cfg, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        """The shape of each cache entry of one layer for `batch` sequences of `length`
        positions."""
        raise NotImplementedError(f"{cls.__name__} declares no cache shapes")

    @classmethod
    def init_cache(cls, cfg, batch: int, length: int, dtype=jnp.float32,
                   stack: tuple[int, ...] = ()) -> dict[str, jax.Array]:
        """One layer's zeroed cache with leading `stack` axes (the stacked layers), in `dtype`
        but for the `float32_cache` entries."""
        return {name: jnp.zeros((*stack, *shape),
                                jnp.float32 if name in cls.float32_cache else dtype)
                for name, shape in cls.cache_shapes(cfg, batch, length).items()}

    @classmethod
    def cache_bytes(cls, cfg, dtype, length: int = 1) -> int:
        """Bytes of one layer's cache for one sequence of `length` positions: the entries of
        `cache_shapes` at `dtype`'s itemsize, the `float32_cache` entries at 4."""
        itemsize = jnp.dtype(dtype).itemsize
        return sum(math.prod(shape) * (4 if name in cls.float32_cache else itemsize)
                   for name, shape in cls.cache_shapes(cfg, 1, length).items())

    @classmethod
    def score_flops_per_token(cls, cfg, seq_len: int) -> float:
        """Forward FLOPs per token beyond the Dense projections, averaged over a causal sequence
        of `seq_len` positions (attention scores and mixing, a recurrence's state updates)."""
        raise NotImplementedError(f"{cls.__name__} declares no score FLOPs")


def causal_mask(query_positions_BxT: jax.Array, key_positions_BxS: jax.Array,
                window: int = 0) -> jax.Array:
    """Additive mask M[b, t, s] = 0 where key s is at or before query t (and, with a window
    W > 0, pos_t − pos_s < W: the band of the W most recent positions), −∞ otherwise."""
    allowed = allowed_mask(query_positions_BxT, key_positions_BxS, window)
    return jnp.where(allowed, 0.0, -jnp.inf).astype(jnp.float32)


# A ring-buffer slot not yet written holds this position: after every query, so always masked.
EMPTY_SLOT = jnp.iinfo(jnp.int32).max


def cache_slots(cfg, length: int) -> int:
    """Positions a KV cache for `length` positions holds: `length`, or with `attention.window`
    W > 0 only min(length, W), a ring buffer (`write_cache`): O(W) memory however long the
    generation."""
    window = cfg.attention.window
    return min(length, window) if window else length


def mean_visible_keys(seq_len: int, window: int = 0) -> float:
    """Keys a query sees, averaged over positions t = 0..T−1 of causal attention: min(t + 1, W)
    (W = ∞ without a window), i.e. (T + 1)/2 for T ≤ W, else (W(W + 1)/2 + (T − W)·W)/T."""
    if not window or seq_len <= window:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def write_cache(cache: dict, new: dict, positions_BxT: jax.Array,
                window: int = 0) -> tuple[dict, jax.Array, dict]:
    """Write a block's cached arrays into `cache` and return what the block attends to:
    (arrays B×S×… by name, their key positions B×S, the updated cache).

    `new` holds each cached array of the block's T positions (B×T×…), named as in `cache`.
    Without a window the cache has a slot per position: the block lands at slots t₀..t₀+T−1
    and attends to all S slots (the mask hides those after each query).
    With a window W (`attention.window`) the cache is a ring of R = min(length, W) slots
    (`cache_slots`) plus "position" (B×R int32, `EMPTY_SLOT` where unwritten): position t is
    stored at slot t mod R with t itself, so the band mask reads true positions. The last
    min(T, R) positions of the block are written. A single token (decoding) writes first and
    attends to the R slots (the slot it overwrites held t − W, outside its window); a longer
    block (prefill) attends to the R slots as they were plus its own T positions, since its
    early queries need keys its later positions overwrite: R + T keys, for this block only."""
    if not window:
        start = positions_BxT[0, 0]
        written = {name: jax.lax.dynamic_update_slice(
            cache[name], x.astype(cache[name].dtype), (0, start) + (0,) * (x.ndim - 2))
            for name, x in new.items()}
        length = next(iter(written.values())).shape[:2]
        return written, jnp.broadcast_to(jnp.arange(length[1]), length), written
    slots = cache["position"].shape[1]
    length = positions_BxT.shape[1]
    kept = min(length, slots)
    slot_K = positions_BxT[0, -kept:] % slots
    written = {name: cache[name].at[:, slot_K].set(x[:, -kept:].astype(cache[name].dtype),
                                                    unique_indices=True)
               for name, x in new.items()}
    written["position"] = cache["position"].at[:, slot_K].set(
        positions_BxT[:, -kept:].astype(jnp.int32), unique_indices=True)
    if length == 1:
        return {name: written[name] for name in new}, written["position"], written
    attended = {name: jnp.concatenate([cache[name], x.astype(cache[name].dtype)], axis=1)
                for name, x in new.items()}
    key_positions_BxS = jnp.concatenate(
        [cache["position"], positions_BxT.astype(jnp.int32)], axis=1)
    return attended, key_positions_BxS, written


class AttentionWeights(nnx.Intermediate):
    """Attention probabilities, recorded only under `nnx.capture(model, AttentionWeights)` (the
    probes); an ordinary `nnx.capture(model, nnx.Intermediate)` leaves them out (B×H×T×S per
    layer is large)."""


def dot_product_attention(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, mask_BxTxS,
                          scale: float | None = None, recorder: nnx.Module | None = None):
    """softmax(QKᵀ·scale + M)V, with the H query heads grouped over the K key/value heads.

    `scale` defaults to 1/√P (P the query/key width); values may have another width V.
    Scores and softmax in float32; the weighted sum in the inputs' dtype. The probabilities
    (B×K×G×T×S, head h = k·G + g) are recorded on `recorder` as "attention_weights", kind
    `AttentionWeights` (probes).
    """
    b, t, h, p = q_BxTxHxP.shape
    k = k_BxSxKxP.shape[2]
    # Without grouping (H = K) the group axis is left out rather than kept at size 1: XLA:CPU
    # reduces an array with a size-1 axis slower (docs/performance.md, "Reductions with a size-1
    # axis"). `g` names the group axis in the einsums where there is one.
    g, group = ("g", ("act_heads",)) if h != k else ("", ())
    q_BxTxKxGxP = q_BxTxHxP.reshape(b, t, k, h // k, p) if g else q_BxTxHxP
    scores_BxKxGxTxS = jnp.einsum(
        f"btk{g}p,bskp->bk{g}ts", q_BxTxKxGxP, k_BxSxKxP, preferred_element_type=jnp.float32)
    scores_BxKxGxTxS = (scores_BxKxGxTxS / jnp.sqrt(jnp.float32(p)) if scale is None
                        else scores_BxKxGxTxS * jnp.float32(scale))
    # Pinned so that sequence × tensor parallelism keeps queries and heads sharded in the backward
    # pass too (the G query heads of a KV head take `tensor` when K does not divide: MQA).
    mask = mask_BxTxS[:, None, None] if g else mask_BxTxS[:, None]
    scores_BxKxGxTxS = constrain(scores_BxKxGxTxS + mask,
                                 ("act_batch", "act_kv_heads", *group, "act_seq", None))
    weights = jax.nn.softmax(scores_BxKxGxTxS, axis=-1).astype(v_BxSxKxV.dtype)
    if recorder is not None:  # a no-op outside nnx.capture
        record(recorder, "attention_weights", weights if g else weights[:, :, None],
               AttentionWeights)
    weights = dropout(weights, "attention_probs")  # identity outside training (arch/dropout.py)
    out_BxTxKxGxV = constrain(jnp.einsum(f"bk{g}ts,bskv->btk{g}v", weights, v_BxSxKxV),
                              ("act_batch", "act_seq", "act_kv_heads", *group, None))
    return out_BxTxKxGxV.reshape(b, t, h, v_BxSxKxV.shape[-1])


def attend(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT, key_positions_BxS, *,
           implementation: str = "xla", chunk: int = 128, scale: float | None = None,
           window: int = 0, in_order: bool = False,
           recorder: nnx.Module | None = None) -> jax.Array:
    """Causal attention softmax(QKᵀ·scale + M)V by `implementation`
    (`execution.attention_implementation`; `arch.kernels.attention_implementations`): `xla`
    (explicit scores, `dot_product_attention`), `blocked` (online softmax over `chunk`-position
    tiles, O(T·chunk) memory), `cudnn`, `splash`, or `auto` (`choose_implementation`: the
    fastest exact path for the backend and shape). All are the same function;
    tests/test_attention_implementations.py checks it.
    `window` W > 0: sliding-window attention, M also hides keys W or more positions back
    (`arch.kernels.attention_implementations.allowed_mask`).

    `in_order`: query i and key i are at position i (no KV cache, no sequence shards: the train
    step's positions are then 0..T−1). `cudnn` then uses its built-in causal mask and `splash`
    runs at all; both read causality from the array order, so a caller passing other positions
    without a cache must choose `xla` or `blocked`, which read the positions.
    Under `nnx.capture` of `recorder` (the probes) the explicit path runs, so that the
    probabilities exist to be recorded."""
    if recorder is not None and is_capturing(recorder):
        implementation = "xla"
    if active_rate("attention_probs") > 0:  # training with attention dropout (arch/dropout.py)
        if implementation not in ("auto", "xla"):
            raise ValueError("model.dropout.attention_probs needs the explicit probabilities; "
                             f"execution.attention_implementation={implementation!r} has none "
                             "(use 'xla' or 'auto')")
        implementation = "xla"
    name = choose_implementation(
        implementation, backend=jax.default_backend(), query_len=q_BxTxHxP.shape[1],
        key_len=k_BxSxKxP.shape[1], dtype=q_BxTxHxP.dtype, key_width=k_BxSxKxP.shape[-1],
        value_width=v_BxSxKxV.shape[-1], in_order=in_order)
    if name == "blocked":
        return blocked_attention(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT,
                                 key_positions_BxS, scale=scale, chunk=chunk, window=window)
    if name == "cudnn":
        return cudnn_attention(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, query_positions_BxT,
                               key_positions_BxS, scale=scale, window=window, in_order=in_order)
    if name == "splash":
        return splash_attention(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV, scale=scale, window=window,
                                block=chunk)
    return dot_product_attention(q_BxTxHxP, k_BxSxKxP, v_BxSxKxV,
                                 causal_mask(query_positions_BxT, key_positions_BxS, window),
                                 scale=scale, recorder=recorder)


class SoftmaxAttention(TokenMixer):
    """What the softmax-attention mixers share: they record their probabilities for the probes,
    and with `attention.window` W > 0 their KV cache is a ring of min(length, W) slots, with
    "position" (B×R int32, `EMPTY_SLOT` until written; `write_cache`) beside the entries of
    `cache_shapes`."""

    records_attention_weights = True

    @classmethod
    def init_cache(cls, cfg, batch: int, length: int, dtype=jnp.float32,
                   stack: tuple[int, ...] = ()) -> dict[str, jax.Array]:
        cache = super().init_cache(cfg, batch, length, dtype, stack)
        if cfg.attention.window:
            cache["position"] = jnp.full((*stack, batch, cache_slots(cfg, length)), EMPTY_SLOT,
                                         jnp.int32)
        return cache


@ATTENTION.register("mha")
class MultiHeadAttention(SoftmaxAttention):
    """Multi-head attention with H query and K key/value heads (Vaswani et al. 2017 §3.2;
    GQA: Ainslie et al. 2023; MQA: Shazeer 2019): MHA is K = H, MQA is K = 1, GQA between.

    q = x W_Q (d → H×P), k = x W_K, v = x W_V (d → K×P); head j reads KV head ⌊j/G⌋;
    y = concat_j softmax(q_j k_⌊j/G⌋ᵀ/√P + M) v_⌊j/G⌋ · W_O (H×P → d), M the causal mask.
    H·P may differ from d (`attention.width`). With `model.linear_bias` each of the four
    projections adds a bias (x W + b; GPT-2, Radford et al. 2019), zero-initialized.
    Initialization: `model.init` groups query, key, value and attention_output (default: variance
    1/fan_in for all four).

    KV cache: {"key", "value"} of shape B×S_max×K×P; an input block at positions t₀..t₀+T−1
    writes its keys/values at those slots and attends to every slot at or before its position.

    Sliding window (`attention.window` W > 0; Beltagy et al. 2020, "Longformer"; Mistral, Jiang
    et al. 2023): M also hides keys W or more positions back, so a token sees the W most recent
    positions, itself included. The KV cache is then a ring buffer of min(S_max, W) slots with
    their positions (`write_cache`): O(W) memory per sequence. Cost: score FLOPs
    4·H·P·min(t + 1, W) at position t (the `blocked`, `cudnn` and `splash` kernels skip masked
    tiles; `xla` computes and masks all T × S scores).

    Sequence parallelism (`sharding/sequence.py`): queries stay sharded over `sequence`; keys and
    values are all-gathered (`execution.sequence_attention="all_gather"`) or, without a KV cache,
    rotated around the ring (`"ring"`, which records no attention weights). With a KV cache
    (decoding) the cache is gathered like the keys, whatever the setting.
    """

    def __init__(self, cfg, *, execution=None, rngs: nnx.Rngs):
        attention = cfg.attention
        d, h, k, p = cfg.d_model, attention.num_heads, attention.num_kv_heads, attention.head_dim
        dtype, bias = jnp.dtype(cfg.dtype), cfg.linear_bias
        self.query = Dense((d,), (h, p), ("embed",), ("heads", "head_dim"), rngs=rngs, dtype=dtype,
                           use_bias=bias, init=group_init(cfg, "query"))
        self.key = Dense((d,), (k, p), ("embed",), ("kv_heads", "head_dim"), rngs=rngs, dtype=dtype,
                         use_bias=bias, init=group_init(cfg, "key"))
        self.value = Dense((d,), (k, p), ("embed",), ("kv_heads", "head_dim"), rngs=rngs,
                           dtype=dtype, use_bias=bias, init=group_init(cfg, "value"))
        self.output = Dense((h, p), (d,), ("heads", "head_dim"), ("embed",), rngs=rngs, dtype=dtype,
                            use_bias=bias, init=group_init(cfg, "attention_output"))
        execution = execution or execution_config()
        self.ring = execution.sequence_attention == "ring"
        self.implementation = execution.attention_implementation
        self.chunk = execution.attention_chunk
        self.window = cfg.attention.window

    @staticmethod
    def score_flops_per_token(cfg, seq_len: int) -> float:
        """Forward FLOPs of QKᵀ and AV per token, causal: position t attends to t + 1 keys (with
        a window W, min(t + 1, W)), so 4·H·P·(t + 1) averages to 2·H·P·(T + 1) over t = 0..T−1
        (`mean_visible_keys`)."""
        return (4 * cfg.attention.num_heads * cfg.attention.head_dim
                * mean_visible_keys(seq_len, cfg.attention.window))

    @staticmethod
    def cache_shapes(cfg, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        shape = (batch, cache_slots(cfg, length), cfg.attention.num_kv_heads,
                 cfg.attention.head_dim)
        return {"key": shape, "value": shape}

    def __call__(self, x_BxTxD, positions_BxT, rotate, cache=None):
        q = constrain(rotate(self.query(x_BxTxD), positions_BxT),
                      ("act_batch", "act_seq", "act_heads", None))
        k = constrain(rotate(self.key(x_BxTxD), positions_BxT),
                      ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(self.value(x_BxTxD), ("act_batch", "act_seq", "act_kv_heads", None))
        key_positions_BxS = positions_BxT
        if cache is not None:
            attended, key_positions_BxS, cache = write_cache(
                cache, {"key": k, "value": v}, positions_BxT, self.window)
            k, v = attended["key"], attended["value"]
        elif self.ring and sequence_shards() > 1:
            return self.output(ring_attention(q, k, v, positions_BxT, window=self.window)), cache
        gathered = ("act_batch", None, "act_kv_heads", None)  # all of the sequence on every shard
        k, v = constrain(k, gathered), constrain(v, gathered)
        out = attend(q, k.astype(q.dtype), v.astype(q.dtype), positions_BxT, key_positions_BxS,
                     implementation=self.implementation, chunk=self.chunk, window=self.window,
                     recorder=self, in_order=cache is None and sequence_shards() == 1)
        return self.output(out), cache


@ATTENTION.register("mla")
class MultiHeadLatentAttention(SoftmaxAttention):
    """Multi-head Latent Attention (DeepSeek-AI 2024, "DeepSeek-V2", §2.1.2–2.1.3, eqs. 9–19).

    Keys and values of all H heads are read from one shared per-token latent c_KV (width C =
    `mla.kv_rank`), so the KV cache holds C + R numbers per token instead of MHA's 2·H·P:

        c_KV = RMSNorm(x W_DKV)                  d → C                          (eq. 9)
        k^C = c_KV W_UK,  v = c_KV W_UV          C → H×N,  C → H×V              (eqs. 10–11)
        c_Q = RMSNorm(x W_DQ)                    d → C'   (C' = `mla.q_rank`)   (eq. 12)
        q^C = c_Q W_UQ,  q^R = RoPE(c_Q W_QR)    C' → H×N,  C' → H×R            (eqs. 13–14)
        k^R = RoPE(x W_KR)                       d → R, ONE head shared by all  (eq. 15)
        q_i = [q^C_i; q^R_i],  k_i = [k^C_i; k^R]                               (eqs. 16–17)
        o_i = softmax(q_i k_iᵀ / √(N + R) + M) v_i;  y = [o_1; …; o_H] W_O      (eqs. 18–19)

    N = `mla.nope_dim`, R = `mla.rope_dim`, V = `mla.v_dim` (N and V default to
    `attention.head_dim`).
    With `mla.q_rank` = 0 the query is full-rank: c_Q = x (no W_DQ, no norm), W_UQ: d → H×N and
    W_QR: d → H×R, together the d → H×(N + R) projection of eq. 16's q. The RMSNorms on the
    latents (gain 1, `norm.eps`) are not in the paper's equations but are in the released
    DeepSeek-V2 model (`kv_a_layernorm`, `q_a_layernorm`) and are kept here.
    `attention.num_kv_heads` is not used: every head has its own k^C, v, up-projected from the
    latent.

    Positions: "RoPE" is the `rotate` hook the model passes in, applied only to q^R and k^R (the
    decoupled rotary parts; the latent parts never see positions, which is what lets W_UK be
    absorbed). Any position scheme is accepted: with `position.name="rope"` it rotates (R must be
    even); with "none" or "learned" `rotate` is the identity and k^R is a plain shared key part.

    Initialization: `model.init` groups query (W_DQ, W_UQ, W_QR), key (W_DKV, W_UK, W_KR), value
    (W_UV) and attention_output (W_O), default variance 1/fan_in; norm gains 1.

    Sequence parallelism: keys and values (after up-projection) are all-gathered over `sequence`;
    `execution.sequence_attention="ring"` is not available for MLA (`config.resolve` rejects it).

    KV cache: {"latent": B×S_max×C, "rope_key": B×S_max×R}, the normalized c_KV and the rotated
    k^R. An input block at positions t₀..t₀+T−1 writes its slots and attends to every slot at or
    before its position. `attention.window` W > 0 bands the mask as in MHA and makes the cache
    a ring of min(S_max, W) slots (`write_cache`). By default keys and values are up-projected
    from the cached latent (the simple way). With `mla.absorb=True`, cached attention runs in
    the latent space instead (DeepSeek-V2 §2.1.2, "absorbed" inference): q̃_i = W_UK,i q^C_i,
    scores (q̃_i·c_KV + q^R_i·k^R)/√(N + R), i.e. MQA with one key/value head [c_KV; k^R] / c_KV
    of width C + R / C, and o_i = W_UV,iᵀ (Σ_s w_is c_KV,s); mathematically equal to the simple
    way.
    """

    def __init__(self, cfg, *, execution=None, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.attention.num_heads
        c, c_q, r = cfg.mla.kv_rank, cfg.mla.q_rank, cfg.mla.rope_dim
        n, v = cfg.mla.nope_dim, cfg.mla.v_dim
        dtype = jnp.dtype(cfg.dtype)
        self.absorb = bool(cfg.mla.absorb)
        if c_q:
            self.query_down = Dense((d,), (c_q,), ("embed",), ("q_latent",), rngs=rngs, dtype=dtype,
                                    init=group_init(cfg, "query"))
            self.query_norm = RMSNorm(c_q, eps=cfg.norm.eps, rngs=rngs)
            q_in, q_axis = c_q, "q_latent"
        else:
            self.query_down = self.query_norm = None
            q_in, q_axis = d, "embed"
        self.query_up = Dense((q_in,), (h, n), (q_axis,), ("heads", "head_dim"), rngs=rngs,
                              dtype=dtype, init=group_init(cfg, "query"))
        self.query_rope = Dense((q_in,), (h, r), (q_axis,), ("heads", "head_dim"), rngs=rngs,
                                dtype=dtype, init=group_init(cfg, "query"))
        self.kv_down = Dense((d,), (c,), ("embed",), ("kv_latent",), rngs=rngs, dtype=dtype,
                             init=group_init(cfg, "key"))
        self.kv_norm = RMSNorm(c, eps=cfg.norm.eps, rngs=rngs)
        self.key_up = Dense((c,), (h, n), ("kv_latent",), ("heads", "head_dim"), rngs=rngs,
                            dtype=dtype, init=group_init(cfg, "key"))
        self.value_up = Dense((c,), (h, v), ("kv_latent",), ("heads", "head_dim"), rngs=rngs,
                              dtype=dtype, init=group_init(cfg, "value"))
        self.key_rope = Dense((d,), (r,), ("embed",), ("head_dim",), rngs=rngs, dtype=dtype,
                              init=group_init(cfg, "key"))
        self.output = Dense((h, v), (d,), ("heads", "head_dim"), ("embed",), rngs=rngs, dtype=dtype,
                            init=group_init(cfg, "attention_output"))
        self.scale = (n + r) ** -0.5
        execution = execution or execution_config()
        self.implementation = execution.attention_implementation
        self.chunk = execution.attention_chunk
        self.window = cfg.attention.window

    @staticmethod
    def score_flops_per_token(cfg, seq_len: int) -> float:
        """Causal QKᵀ over N + R features and AV over V: H·(N + R + V)·(T + 1) on average
        (2·H·(N + R + V)·`mean_visible_keys`, which a window W bounds by W)."""
        width = cfg.mla.nope_dim + cfg.mla.rope_dim + cfg.mla.v_dim
        return (2 * cfg.attention.num_heads * width
                * mean_visible_keys(seq_len, cfg.attention.window))

    @staticmethod
    def cache_shapes(cfg, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        slots = cache_slots(cfg, length)
        return {"latent": (batch, slots, cfg.mla.kv_rank),
                "rope_key": (batch, slots, cfg.mla.rope_dim)}

    def __call__(self, x_BxTxD, positions_BxT, rotate, cache=None):
        if self.query_down is None:
            query_in = x_BxTxD
        else:
            query_in = self.query_norm(self.query_down(x_BxTxD))
        q_nope_BxTxHxN = self.query_up(query_in)
        q_rope_BxTxHxR = rotate(self.query_rope(query_in), positions_BxT)
        latent_BxSxC = constrain(self.kv_norm(self.kv_down(x_BxTxD)),
                                 ("act_batch", "act_seq", None))
        rope_key_BxSxR = rotate(self.key_rope(x_BxTxD)[:, :, None], positions_BxT)[:, :, 0]
        key_positions_BxS = positions_BxT
        if cache is not None:
            attended, key_positions_BxS, cache = write_cache(
                cache, {"latent": latent_BxSxC, "rope_key": rope_key_BxSxR}, positions_BxT,
                self.window)
            latent_BxSxC = attended["latent"].astype(x_BxTxD.dtype)
            rope_key_BxSxR = attended["rope_key"].astype(x_BxTxD.dtype)
        positions = (positions_BxT, key_positions_BxS)
        if cache is not None and self.absorb:
            out_BxTxHxV = self._absorbed(q_nope_BxTxHxN, q_rope_BxTxHxR, latent_BxSxC,
                                         rope_key_BxSxR, positions)
        else:
            heads = ("act_batch", "act_seq", "act_heads", None)
            key_nope_BxSxHxN = self.key_up(latent_BxSxC)
            b, s, h, _ = key_nope_BxSxHxN.shape
            rope_key_BxSxHxR = jnp.broadcast_to(rope_key_BxSxR[:, :, None],
                                                (b, s, h, rope_key_BxSxR.shape[-1]))
            gathered = ("act_batch", None, "act_heads", None)  # sequence parallelism: all keys
            q = constrain(jnp.concatenate([q_nope_BxTxHxN, q_rope_BxTxHxR], -1), heads)
            k = constrain(constrain(jnp.concatenate([key_nope_BxSxHxN, rope_key_BxSxHxR], -1),
                                    heads), gathered)
            v = constrain(constrain(self.value_up(latent_BxSxC), heads), gathered)
            out_BxTxHxV = attend(q, k, v, *positions, implementation=self.implementation,
                                 chunk=self.chunk, scale=self.scale, window=self.window,
                                 recorder=self, in_order=cache is None and sequence_shards() == 1)
        return self.output(out_BxTxHxV), cache

    def _absorbed(self, q_nope_BxTxHxN, q_rope_BxTxHxR, latent_BxSxC, rope_key_BxSxR,
                  positions):
        """Attention in the latent space: W_UK folded into the query, W_UV applied after."""
        dtype = q_nope_BxTxHxN.dtype
        q_latent_BxTxHxC = jnp.einsum("bthn,chn->bthc", q_nope_BxTxHxN,
                                      self.key_up.kernel[...].astype(dtype))
        q = jnp.concatenate([q_latent_BxTxHxC, q_rope_BxTxHxR], -1)
        k_BxSx1xCR = jnp.concatenate([latent_BxSxC, rope_key_BxSxR], -1)[:, :, None]
        out_BxTxHxC = attend(q, k_BxSx1xCR, latent_BxSxC[:, :, None], *positions,
                             implementation=self.implementation, chunk=self.chunk,
                             scale=self.scale, window=self.window)
        return jnp.einsum("bthc,chv->bthv", out_BxTxHxC, self.value_up.kernel[...].astype(dtype))
