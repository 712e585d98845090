"""Sequence (context) parallelism over the `sequence` mesh axis.

Activations' token axis (logical `act_seq`, `sharding/rules.py`) is split into S = mesh.sequence
contiguous shards. Everything but attention is per token, so only attention needs the other
shards' keys and values; `execution.sequence_attention` chooses how it gets them:

- "all_gather" (default): queries stay sharded, keys and values are all-gathered over `sequence`
  (a sharding constraint in `arch/attention.py`; XLA inserts the all-gather, and its transpose, a
  reduce-scatter, in the backward pass). Every shard then scores its T/S queries against all T
  keys.
- "ring" (`ring_attention`): keys and values travel around the `sequence` axis with
  `jax.lax.ppermute` inside a `jax.shard_map` that is manual over `sequence` only (batch and heads
  stay automatically sharded), and each shard folds every visiting block into an online softmax
  (Liu et al. 2023, "Ring Attention with Blockwise Transformers", Alg. 1; Milakov & Gimelshein
  2018 for the running max and normalizer). No shard ever holds more than 2·T/S keys/values.

Causal load balancing (the "zigzag" layout of Llama 3 context parallelism; Brandon et al. 2023,
"Striped Attention", is the token-level variant): with tokens in order, shard S−1 has about 2S−1
times the causal query-key pairs of shard 0. The sequence is cut into 2S chunks of c = T/(2S)
tokens and shard i gets chunks i and 2S−1−i (`stripe_order`): together they hold
c²·(2S−1) + c·(c + 1) causal pairs, the same on every shard. Only attention that skips masked
blocks (the ring) turns that into equal time; the all-gather path computes all T/S × T scores of
its shard and masks them, so striping changes nothing for it but costs nothing either (a
permutation of token ids).

The permutation happens ONCE, in the train step (`train/step.py` calls `stripe_batch`): input
tokens, their positions and the targets are permuted alike, so the model sees tokens in striped
order with their true positions (RoPE, learned positions and the causal mask read
`positions_BxT`, never the array index), its logits come out in striped order next to equally
striped targets, and the mean cross-entropy, a sum over positions, is unchanged. Nothing is
un-permuted. The model itself is correct in ANY token order: striping only balances the work.

Ring attention splits each shard's queries and keys in two halves (the two stripes) and skips a
half-by-half block with `lax.cond` when its every key comes after its every query; with the
striped layout that leaves 3 of 4 blocks on the first step and exactly 2 of 4 on each of the S − 1
later ones, on every shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

AXIS = "sequence"


def sequence_shards() -> int:
    """Size of the `sequence` axis of the mesh being traced under (1 outside a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or AXIS not in mesh.shape else mesh.shape[AXIS]


def stripe_order(seq_len: int, shards: int) -> np.ndarray:
    """The striped token order: position order[j] goes to slot j of the permuted sequence.

    With c = seq_len / (2·shards), shard i (slots i·2c … (i+1)·2c − 1) holds the positions of
    chunks i and 2·shards − 1 − i. One shard: the identity. `np.argsort(order)` inverts it.
    """
    if seq_len % (2 * shards) and shards > 1:
        raise ValueError(f"seq_len={seq_len} is not divisible by 2 × {shards} sequence shards")
    if shards == 1:
        return np.arange(seq_len)
    chunks = np.arange(seq_len).reshape(2 * shards, seq_len // (2 * shards))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]])
                           for i in range(shards)])


def stripe_batch(tokens_BxT1: jax.Array, shards: int):
    """(inputs_BxT, targets_BxT, positions_BxT) of a next-token batch of T + 1 tokens, each
    permuted by `stripe_order(T, shards)`: targets[:, j] is still the token after inputs[:, j],
    whose position is positions[:, j]. One shard: plain shifted inputs and targets, positions
    0 … T − 1."""
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    batch, length = inputs_BxT.shape
    order = stripe_order(length, shards)
    if shards > 1:
        inputs_BxT, targets_BxT = inputs_BxT[:, order], targets_BxT[:, order]
    return inputs_BxT, targets_BxT, jnp.broadcast_to(jnp.asarray(order), (batch, length))


def _block_scores(q_BxTxKxGxP, k_BxSxKxP, query_positions_BxT, key_positions_BxS, scale,
                  window: int = 0):
    """Scaled scores B×K×G×T×S (float32), −∞ where the key comes after the query (or, with a
    window W > 0, W or more positions before it)."""
    scores = jnp.einsum("btkgp,bskp->bkgts", q_BxTxKxGxP, k_BxSxKxP,
                        preferred_element_type=jnp.float32) * jnp.float32(scale)
    distance_BxTxS = query_positions_BxT[:, :, None] - key_positions_BxS[:, None, :]
    allowed_BxTxS = distance_BxTxS >= 0
    if window:
        allowed_BxTxS &= distance_BxTxS < window
    return jnp.where(allowed_BxTxS[:, None, None], scores, -jnp.inf)


def _fold(state, q_BxTxKxGxP, query_positions_BxT, k_BxSxKxP, v_BxSxKxV, key_positions_BxS,
          scale, window: int = 0):
    """Online-softmax update of (m, l, o) = (running max B×K×G×T, normalizer, unnormalized output
    B×K×G×T×V, float32) with one key/value block of scores x_s and values v_s:
        m' = max(m, max_s x_s),  l' = e^{m−m'} l + Σ_s e^{x_s−m'},
        o' = e^{m−m'} o + Σ_s e^{x_s−m'} v_s;  the attention output is o/l after the last block.
    m must already be finite (it is: a query always sees itself in the first block). The max is
    held out of autodiff; it cancels in o/l. A block with every score masked leaves the state
    as it was."""
    running_max, normalizer, output = state
    scores = _block_scores(q_BxTxKxGxP, k_BxSxKxP, query_positions_BxT, key_positions_BxS, scale,
                           window)
    new_max = jax.lax.stop_gradient(jnp.maximum(running_max, scores.max(-1)))
    keep = jnp.exp(running_max - new_max)
    weights = jnp.exp(scores - new_max[..., None])
    output = output * keep[..., None] + jnp.einsum(
        "bkgts,bskv->bkgtv", weights.astype(v_BxSxKxV.dtype), v_BxSxKxV,
        preferred_element_type=jnp.float32)
    return new_max, normalizer * keep + weights.sum(-1), output


def _start(q_BxTxKxGxP, query_positions_BxT, k_BxSxKxP, v_BxSxKxV, key_positions_BxS, scale,
           window: int = 0):
    """(m, l, o) of one block alone (every query must see at least one key in it)."""
    scores = _block_scores(q_BxTxKxGxP, k_BxSxKxP, query_positions_BxT, key_positions_BxS, scale,
                           window)
    running_max = jax.lax.stop_gradient(scores.max(-1))
    weights = jnp.exp(scores - running_max[..., None])
    output = jnp.einsum("bkgts,bskv->bkgtv", weights.astype(v_BxSxKxV.dtype), v_BxSxKxV,
                        preferred_element_type=jnp.float32)
    return running_max, weights.sum(-1), output


def any_causal_pair(key_positions, query_positions, window: int = 0) -> jax.Array:
    """Whether some key is at or before some query and, with a window W > 0, the latest key is
    within W of the earliest query (else ring attention skips the block, all masked)."""
    visible = jnp.min(key_positions) <= jnp.max(query_positions)
    if window:
        visible &= jnp.max(key_positions) > jnp.min(query_positions) - window
    return visible


def _halves(x):
    """Split the (local) token axis 1 into its two stripes: a pair of arrays."""
    half = x.shape[1] // 2
    return x[:, :half], x[:, half:]


def _ring_shard(q_BxTxHxP, k_BxTxKxP, v_BxTxKxV, positions_BxT, *, scale: float,
                window: int = 0):
    """One shard's ring attention (inside shard_map, manual over `sequence`): T here is the
    shard's 2c tokens, two stripes of c."""
    shards = jax.lax.axis_size(AXIS)
    b, t, h, p = q_BxTxHxP.shape
    kv_heads = k_BxTxKxP.shape[2]
    queries = _halves(q_BxTxHxP.reshape(b, t, kv_heads, h // kv_heads, p))
    query_positions = _halves(positions_BxT)

    def stripes(k_BxSxKxP, v_BxSxKxV, key_positions_BxS):
        """The two stripes of a key/value block, each (keys, values, key positions)."""
        return tuple(zip(_halves(k_BxSxKxP), _halves(v_BxSxKxV), _halves(key_positions_BxS),
                         strict=True))

    def fold_if_needed(state, half: int, stripe):
        """Fold a key stripe into query stripe `half`'s state, unless every key comes after every
        query: then the block is skipped (not computed)."""
        k, v, key_positions = stripe
        return jax.lax.cond(
            any_causal_pair(key_positions, query_positions[half], window),
            lambda s: _fold(s, queries[half], query_positions[half], k, v, key_positions, scale,
                            window),
            lambda s: s, state)

    # This shard's own block: the diagonal stripe pairs start the states (a query always sees
    # itself, so the running max is finite from here on), then the two cross pairs.
    own = stripes(k_BxTxKxP, v_BxTxKxV, positions_BxT)
    states = [_start(queries[i], query_positions[i], *own[i], scale, window) for i in range(2)]
    states = [fold_if_needed(states[0], 0, own[1]), fold_if_needed(states[1], 1, own[0])]

    permutation = [(j, (j + 1) % shards) for j in range(shards)]

    def visit(carry, _):
        """Receive the previous shard's block and fold its stripes into both query stripes."""
        block, states = carry
        block = tuple(jax.lax.ppermute(x, AXIS, permutation) for x in block)
        for half in range(2):
            for stripe in stripes(*block):
                states[half] = fold_if_needed(states[half], half, stripe)
        return (block, states), None

    (_, states), _ = jax.lax.scan(visit, ((k_BxTxKxP, v_BxTxKxV, positions_BxT), states), None,
                                  length=shards - 1)
    outputs = [output / normalizer[..., None] for _, normalizer, output in states]
    out_BxKxGxTxV = jnp.concatenate(outputs, axis=3)
    out_BxTxKxGxV = out_BxKxGxTxV.transpose(0, 3, 1, 2, 4).astype(v_BxTxKxV.dtype)
    return out_BxTxKxGxV.reshape(b, t, h, v_BxTxKxV.shape[-1])


def ring_attention(q_BxTxHxP, k_BxTxKxP, v_BxTxKxV, positions_BxT, scale: float | None = None,
                   window: int = 0):
    """Causal softmax(QKᵀ·scale + M)V over the whole sequence, with the token axis sharded over
    `sequence` and keys/values rotated around it (module docstring); `window` W > 0 bands M to
    the W most recent positions, and blocks wholly outside the band are skipped. Same contract as
    `arch.attention.dot_product_attention` (H query heads grouped over K key/value heads, scale
    1/√P by default, M from the positions, float32 scores) without recording the weights; must
    run under a mesh whose `sequence` axis divides T into shards of even length."""
    shards, length = sequence_shards(), q_BxTxHxP.shape[1]
    if length % (2 * shards):
        raise ValueError(f"ring attention over {length} tokens is invalid: the length must be "
                         f"divisible by 2 × {shards} sequence shards (two stripes per shard)")
    scale = q_BxTxHxP.shape[-1] ** -0.5 if scale is None else scale
    tokens = PartitionSpec(None, AXIS)
    shard = jax.shard_map(lambda q, k, v, positions: _ring_shard(q, k, v, positions, scale=scale,
                                                                  window=window),
                          in_specs=(tokens,) * 4, out_specs=tokens, axis_names={AXIS})
    return shard(q_BxTxHxP, k_BxTxKxP, v_BxTxKxV, positions_BxT)
