"""Multi-stream residuals: Hyper-Connections ("hc"), manifold-constrained Hyper-Connections
("mhc") and the simple width baseline ("width"). Registered in `RESIDUALS`.

The residual state is n = `model.residual.streams` streams H = (h_1 … h_n), stored stacked
n×B×T×D in the compute dtype, plus an int32 sublayer counter k (0, 1, 2, … over the 2L
sublayers, attention then FFN of each block; L of them with `model.use_ffn=False`) that the layer
scan carries: per-sublayer parameters are built under `nnx.vmap`, so a sublayer learns its own
position only from the counter. Every sublayer reads h = norm(Σ_m a_m h_m) (a Pre-Norm read of a
mixture of the streams, `model.norm`) and writes the update back into the streams; the
mechanisms differ in the read weights a, the write strengths b and the stream-mixing matrix M:

    hc     h_i ← Σ_j M_ij h_j + b_i F(h),   a, b, M static + s·tanh(projection of norm'd streams)
    mhc    h_i ← Σ_j M_ij h_j + b_i F(h),   a = σ(·), b = 2σ(·), M = Sinkhorn(exp(·))
    width  h_{k mod n} ← h_{k mod n} + F(h), a learned, no mixing

Mixing coefficients, sigmoids and Sinkhorn iterations are computed in float32, and the weighted
sums of streams are formed in float32 and cast back to the stream dtype. Every sublayer records
(`arch.residual.record`) "read_weights" a (B×T×n), "write_strengths" b (B×T×n) and, for hc and mhc,
"mixing_matrix" M (B×T×n×n, M[i, j] = weight of old stream j in new stream i); mhc also
"sinkhorn_iterations" and "sinkhorn_column_error" (`ManifoldHyperConnection`).

Mixing parameters (`arch.residual.MixingParam`, kept out of weight decay: their initialization
is not 0): hc's `static_read`, `static_mixing`, `static_write`, `width_scale`, `depth_scale`; mhc's
`read_bias`, `write_bias`, `mixing_bias`, `read_scale`, `write_scale`, `mixing_scale`; width's
`branch_weights`. The dynamic projections (`read_projection`, `mixing_projection`,
`write_projection`) are ordinary weights.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arch.kernels.sinkhorn import sinkhorn
from arch.layers import param
from arch.norms import make_norm
from arch.residual import (
    RESIDUALS,
    MixingParam,
    ResidualIO,
    ResidualMechanism,
    ResidualStream,
    ResidualTraffic,
    record,
    sublayers_per_block,
)

# mhc: the logit that makes a sigmoid read ≈ one-hot and Sinkhorn's mixing ≈ identity at
# initialization: σ(4) = 0.982, σ(−4) = 0.018; diagonal of Sinkhorn(exp(4·I)) = e⁴/(e⁴ + n − 1).
MHC_INIT_LOGIT = 4.0


class StreamState(NamedTuple):
    """The residual state of the multi-stream mechanisms: the streams and the sublayer counter."""

    streams_NxBxTxD: jax.Array
    sublayer: jax.Array  # int32 scalar: index of the next sublayer to run


def _hyper_io(cfg) -> ResidualIO:
    """hc and mhc with n streams (Xie et al. 2025, "mHC", the I/O table of its efficiency
    section): compute the coefficients: read nd; apply read weights: read nd, write d; apply
    write strengths: read d, write nd; apply the mixing matrix: read nd, write nd; merge: read
    2nd, write nd → (8n + 2)d (34d at n = 4), plus 2n² + 4n scalars (the n×n matrix and 2n
    coefficients, read and written)."""
    n, T = cfg.residual.streams, ResidualTraffic
    items = (T("compute the coefficients", n, 0), T("apply the read weights", n, 1),
             T("apply the write strengths", 1, n), T("apply the mixing matrix", n, n),
             T("merge", 2 * n, n))
    return ResidualIO(items, scalars=2 * n * n + 4 * n)


def _shift_read_offsets(cfg, blocks_state, kept, name: str, scale: float) -> None:
    """Pruning hc and mhc: sublayer k's read carries an offset that follows k, e_{k mod n} (mhc:
    c·(2e_{k mod n} − 1), c = `MHC_INIT_LOGIT`), added to the parameter `name` (hc:
    `static_read`, mhc: `read_bias`). A kept sublayer moves from k to k'; adding
    `scale`·(e_{k mod n} − e_{k' mod n}) (hc: 1, mhc: 2c) to its parameter keeps its read
    weights (to float rounding)."""
    n, per_block = cfg.residual.streams, sublayers_per_block(cfg)
    old, new = np.asarray(kept), np.arange(len(kept))
    for j, residual in enumerate(("attention_residual", "ffn_residual")[:per_block]):
        shift_LxN = scale * (np.eye(n)[(old * per_block + j) % n]
                             - np.eye(n)[(new * per_block + j) % n])
        variable = blocks_state[residual][name]
        variable[...] = variable[...] + jnp.asarray(shift_LxN, variable.dtype)


def _combine(weights_BxTxN: jax.Array, streams_NxBxTxD: jax.Array) -> jax.Array:
    """Σ_m a_m h_m in float32, cast back to the stream dtype."""
    mixed = jnp.einsum("btn,nbtd->btd", weights_BxTxN, streams_NxBxTxD.astype(jnp.float32))
    return mixed.astype(streams_NxBxTxD.dtype)


def _mix_and_write(mixing_BxTxNxN: jax.Array, write_BxTxN: jax.Array,
                   streams_NxBxTxD: jax.Array, update_BxTxD: jax.Array) -> jax.Array:
    """h_i ← Σ_j M_ij h_j + b_i F(h), in float32, cast back to the stream dtype."""
    streams32 = streams_NxBxTxD.astype(jnp.float32)
    mixed = jnp.einsum("btij,jbtd->ibtd", mixing_BxTxNxN, streams32)
    written = jnp.einsum("bti,btd->ibtd", write_BxTxN, update_BxTxD.astype(jnp.float32))
    return (mixed + written).astype(streams_NxBxTxD.dtype)


def _normalize_again(norm: nnx.Module, x: jax.Array) -> jax.Array:
    """norm(x), leaving the norm's non-parameter state (BatchNorm running statistics) unchanged:
    a write recomputes the normalization its read already did, which must not count twice."""
    saved = nnx.to_pure_dict(nnx.state(norm, nnx.Not(nnx.Param)))  # values, not references
    y = norm(x)
    nnx.update(norm, saved)
    return y


class CopiedStreams(ResidualStream):
    """Model-level part of hc and mhc: the embedding copied into each of the n streams; the final
    norm reads the sum of the streams, as in Zhu et al. 2024 (the last hidden matrix summed over
    its n rows before the final norm and the unembedding)."""

    def __init__(self, streams: int):
        self.streams = streams

    def begin(self, x_BxTxD: jax.Array) -> StreamState:
        return StreamState(jnp.broadcast_to(x_BxTxD, (self.streams, *x_BxTxD.shape)),
                           jnp.zeros((), jnp.int32))

    def end(self, state: StreamState) -> jax.Array:
        streams = state.streams_NxBxTxD
        return streams.astype(jnp.float32).sum(0).astype(streams.dtype)


class SeparateBranches(ResidualStream):
    """Model-level part of width: the embedding in branch 0, the other branches zero; the final
    norm reads the sum of the branches (so the sum is the Pre-Norm stream)."""

    def __init__(self, streams: int):
        self.streams = streams

    def begin(self, x_BxTxD: jax.Array) -> StreamState:
        zeros = jnp.zeros((self.streams - 1, *x_BxTxD.shape), x_BxTxD.dtype)
        return StreamState(jnp.concatenate([x_BxTxD[None], zeros]), jnp.zeros((), jnp.int32))

    def end(self, state: StreamState) -> jax.Array:
        streams = state.streams_NxBxTxD
        return streams.astype(jnp.float32).sum(0).astype(streams.dtype)


class _CopiedStreamsMechanism(ResidualMechanism):
    """What HC and mHC share: n copies of the embedding as the state (`CopiedStreams`), and their
    residual I/O and history (`_hyper_io`; the n streams)."""

    @classmethod
    def stream(cls, cfg, *, execution=None, rngs: nnx.Rngs) -> nnx.Module:
        return CopiedStreams(cfg.residual.streams)

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        return _hyper_io(cfg)

    @classmethod
    def residual_history(cls, cfg) -> int:
        """The n streams."""
        return cfg.residual.streams


@RESIDUALS.register("hc")
class HyperConnection(_CopiedStreamsMechanism):
    """Hyper-Connections (Zhu et al. 2024, "Hyper-Connections", arXiv 2409.19606; §2.1 static,
    §2.2 dynamic, §2.3 initialization, Appendix J Algorithm 2) with n = `model.residual.streams`
    streams H ∈ R^{n×d}. In the paper's orientation (A_m ∈ R^n reads, A_r ∈ R^{n×n} mixes,
    B ∈ R^n writes), one sublayer F is

        h = norm(A_mᵀ H),    H ← A_rᵀ H + Bᵀ F(h)

    i.e. read weights a = A_m, mixing matrix M = A_rᵀ, write strengths b = B. Dynamic HC
    (`model.residual.dynamic=True`) adds input-dependent terms computed from each stream
    normalized on its own, H̄ = norm(H) (`model.norm`, one norm shared by the streams):

        A_m(H) = s_α ⊙ tanh(H̄ W_m) + A_m,   A_r(H) = s_α ⊙ tanh(H̄ W_r) + A_r,
        B(H) = s_β ⊙ tanh(H̄ W_β)ᵀ + B,

    W_m ∈ R^d (`read_projection`), W_r ∈ R^{d×n} (`mixing_projection`), W_β ∈ R^d
    (`write_projection`); s_α (`width_scale`, the width connections A_m, A_r) and s_β
    (`depth_scale`, the depth connection B) are learned scalars. Row i of A_r(H) is computed from
    stream i, so the coefficients vary per token.

    Initialization (§2.3): sublayer k starts as Pre-Norm, A_m = e_{k mod n}, A_r = I, B = 1;
    W_m = W_r = W_β = 0; s_α = s_β = `model.hyper.dynamic_scale` (the paper's 0.01). The streams
    start as copies of the embedding and are summed at the end (`CopiedStreams`), so at
    initialization every stream equals the Pre-Norm stream and the final norm reads n times it.
    The sublayer index k is known only at run time (the layer scan carries it), so the read
    weight is stored as an offset: A_m = `static_read` + e_{k mod n}, `static_read` initialized
    to 0 (the same function and gradients as a parameter initialized to e_{k mod n}).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        n, d = cfg.residual.streams, cfg.d_model
        self.streams = n
        self.dynamic = cfg.residual.dynamic
        self.norm = make_norm(cfg, rngs=rngs)  # the sublayer's Pre-Norm
        self.static_read = param(rngs, nnx.initializers.zeros, (n,), (None,), MixingParam)
        self.static_mixing = param(rngs, lambda key, shape, dtype: jnp.eye(n, dtype=dtype),
                                   (n, n), (None, None), MixingParam)
        self.static_write = param(rngs, nnx.initializers.ones, (n,), (None,), MixingParam)
        if self.dynamic:
            scale = nnx.initializers.constant(cfg.hyper.dynamic_scale)
            self.dynamic_norm = make_norm(cfg, rngs=rngs)
            self.read_projection = param(rngs, nnx.initializers.zeros, (d,), ("embed",))
            self.mixing_projection = param(rngs, nnx.initializers.zeros, (d, n), ("embed", None))
            self.write_projection = param(rngs, nnx.initializers.zeros, (d,), ("embed",))
            self.width_scale = param(rngs, scale, (1,), (None,), MixingParam)
            self.depth_scale = param(rngs, scale, (1,), (None,), MixingParam)

    @classmethod
    def prune(cls, cfg, state, kept) -> None:
        _shift_read_offsets(cfg, state["blocks"], kept, "static_read", 1.0)

    def _normalized_streams(self, streams_NxBxTxD, *, again: bool = False) -> jax.Array:
        """H̄ in float32: every stream normalized over d (as a batch of n·B sequences)."""
        n, b, t, d = streams_NxBxTxD.shape
        flat = streams_NxBxTxD.reshape(n * b, t, d)
        normed = _normalize_again(self.dynamic_norm, flat) if again else self.dynamic_norm(flat)
        return normed.reshape(n, b, t, d).astype(jnp.float32)

    def read(self, state: StreamState) -> jax.Array:
        streams = state.streams_NxBxTxD
        n, b, t, _ = streams.shape
        read_BxTxN = jnp.broadcast_to(
            self.static_read[...] + jax.nn.one_hot(state.sublayer % n, n, dtype=jnp.float32),
            (b, t, n))
        if self.dynamic:
            normed = self._normalized_streams(streams)
            read_BxTxN = read_BxTxN + self.width_scale[...] * jnp.tanh(
                jnp.einsum("nbtd,d->btn", normed, self.read_projection[...]))
        record(self, "read_weights", read_BxTxN)
        return self.norm(_combine(read_BxTxN, streams))

    def write(self, state: StreamState, update_BxTxD: jax.Array,
              read_context=None) -> StreamState:
        streams = state.streams_NxBxTxD
        n, b, t, _ = streams.shape
        source_to_stream_BxTxNxN = jnp.broadcast_to(self.static_mixing[...], (b, t, n, n))  # A_r
        write_BxTxN = jnp.broadcast_to(self.static_write[...], (b, t, n))
        if self.dynamic:
            normed = self._normalized_streams(streams, again=True)
            source_to_stream_BxTxNxN = source_to_stream_BxTxNxN + self.width_scale[...] * jnp.tanh(
                jnp.einsum("nbtd,dm->btnm", normed, self.mixing_projection[...]))
            write_BxTxN = write_BxTxN + self.depth_scale[...] * jnp.tanh(
                jnp.einsum("nbtd,d->btn", normed, self.write_projection[...]))
        mixing_BxTxNxN = jnp.swapaxes(source_to_stream_BxTxNxN, -1, -2)  # M = A_rᵀ
        record(self, "mixing_matrix", mixing_BxTxNxN)
        record(self, "write_strengths", write_BxTxN)
        return StreamState(_mix_and_write(mixing_BxTxNxN, write_BxTxN, streams, update_BxTxD),
                           state.sublayer + 1)


@RESIDUALS.register("mhc")
class ManifoldHyperConnection(_CopiedStreamsMechanism):
    """Manifold-constrained Hyper-Connections (Xie et al. 2025, DeepSeek-AI, "mHC:
    Manifold-Constrained Hyper-Connections", arXiv 2512.24880, §4 "Parameterization and Manifold
    Projection"). With the n streams x_l ∈ R^{n×d} (`model.residual.streams`), one sublayer F is

        x_{l+1} = H_res x_l + H_postᵀ F(norm(H_pre x_l)),

    H_pre, H_post ∈ R^{1×n}, H_res ∈ R^{n×n}, from the flattened streams normalized as one vector,
    x̃ = norm(vec(x_l)) ∈ R^{nd} (`model.norm` over all n·d features; the paper's RMSNorm):

        H̃_pre = α_pre · (x̃ φ_pre) + b_pre,   H̃_post = α_post · (x̃ φ_post) + b_post,
        H̃_res = α_res · mat(x̃ φ_res) + b_res,
        H_pre = σ(H̃_pre),   H_post = 2σ(H̃_post),   H_res = Sinkhorn-Knopp(H̃_res)

    So the read weights lie in (0, 1), the write strengths in (0, 2), and H_res is doubly
    stochastic: its rows sum to 1 (to float rounding), its columns to 1 within
    `model.hyper.sinkhorn_tolerance` (max_j |Σ_i H_ij − 1|, default 10⁻³), unless a matrix needs
    more than `model.hyper.sinkhorn_iters` steps (default 20, enough for i.i.d. logits of std
    up to about 6; the recorded column error says when it falls short). [ours] The paper runs
    t_max = 20 Sinkhorn–Knopp iterations, which leave trained matrices' columns far from 1
    (docs/performance.md#mhcs-sinkhorn-column-error); we compute the same projection, the
    unique doubly-stochastic diag(u) exp(H̃_res) diag(v), to the tolerance by safeguarded
    Newton steps (`arch.kernels.sinkhorn`), differentiated implicitly. Each sublayer records
    "sinkhorn_iterations" and "sinkhorn_column_error" per token (B×T; one value with
    `residual.dynamic=False`). As it is doubly stochastic, its product over depth stays so, and
    the mixing neither amplifies nor attenuates the mean of the streams. φ_pre, φ_post ∈
    R^{nd×n}, φ_res ∈ R^{nd×n²} (`read_projection`, `write_projection`, `mixing_projection`), α
    (`read_scale`, `write_scale`, `mixing_scale`), b (`read_bias`, `write_bias`,
    `mixing_bias`).
    `model.residual.dynamic=False`: the static variant, H̃ = b.

    Initialization: the gating factors α = `model.hyper.dynamic_scale` (the paper's 0.01); the
    paper does not fix φ and b, and we choose HC's Pre-Norm initialization (Zhu et al. 2024,
    §2.3) through mHC's maps: φ = 0; b_post = 0, so H_post = 2σ(0) = 1; b_res = c·I, so H_res is
    near the identity (diagonal e^c/(e^c + n − 1) = 0.95 for n = 4); and a read that prefers
    stream k mod n at sublayer k, b_pre = ±c (+c for stream k mod n, −c elsewhere: weights 0.98
    and 0.02), c = `MHC_INIT_LOGIT` = 4. The ±c read offset follows the carried sublayer counter
    and is added to `read_bias` (initialized to 0), as in `HyperConnection`; it breaks the
    symmetry between the streams, which otherwise would stay identical copies forever. As all
    streams start equal and H_res has unit row sums, every stream equals the Pre-Norm stream at
    initialization, and the read is a multiple of it: the model equals Pre-Norm only because the
    read norm is scale-invariant (RMSNorm, LayerNorm; not with a norm that keeps the scale).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        n, d = cfg.residual.streams, cfg.d_model
        self.streams = n
        self.dynamic = cfg.residual.dynamic
        self.sinkhorn_iterations = cfg.hyper.sinkhorn_iters
        self.sinkhorn_tolerance = cfg.hyper.sinkhorn_tolerance
        self.norm = make_norm(cfg, rngs=rngs)  # the sublayer's Pre-Norm
        self.read_bias = param(rngs, nnx.initializers.zeros, (n,), (None,), MixingParam)
        self.write_bias = param(rngs, nnx.initializers.zeros, (n,), (None,), MixingParam)
        self.mixing_bias = param(
            rngs, lambda key, shape, dtype: MHC_INIT_LOGIT * jnp.eye(n, dtype=dtype),
            (n, n), (None, None), MixingParam)
        if self.dynamic:
            zeros = nnx.initializers.zeros
            scale = nnx.initializers.constant(cfg.hyper.dynamic_scale)
            self.dynamic_norm = make_norm(cfg, dim=n * d, rngs=rngs)
            self.read_projection = param(rngs, zeros, (n, d, n), (None, "embed", None))
            self.write_projection = param(rngs, zeros, (n, d, n), (None, "embed", None))
            self.mixing_projection = param(rngs, zeros, (n, d, n, n),
                                           (None, "embed", None, None))
            self.read_scale = param(rngs, scale, (1,), (None,), MixingParam)
            self.write_scale = param(rngs, scale, (1,), (None,), MixingParam)
            self.mixing_scale = param(rngs, scale, (1,), (None,), MixingParam)

    @classmethod
    def prune(cls, cfg, state, kept) -> None:
        _shift_read_offsets(cfg, state["blocks"], kept, "read_bias", 2.0 * MHC_INIT_LOGIT)

    def _normalized_streams(self, streams_NxBxTxD, *, again: bool = False) -> jax.Array:
        """x̃ = norm(vec(x_l)) in float32, shaped B×T×n×d."""
        n, b, t, d = streams_NxBxTxD.shape
        flat = jnp.moveaxis(streams_NxBxTxD, 0, 2).reshape(b, t, n * d)
        normed = _normalize_again(self.dynamic_norm, flat) if again else self.dynamic_norm(flat)
        return normed.reshape(b, t, n, d).astype(jnp.float32)

    def read(self, state: StreamState) -> jax.Array:
        streams = state.streams_NxBxTxD
        n, b, t, _ = streams.shape
        stream_preference = 2 * jax.nn.one_hot(state.sublayer % n, n, dtype=jnp.float32) - 1
        logits_BxTxN = jnp.broadcast_to(
            self.read_bias[...] + MHC_INIT_LOGIT * stream_preference, (b, t, n))
        if self.dynamic:
            normed = self._normalized_streams(streams)
            logits_BxTxN = logits_BxTxN + self.read_scale[...] * jnp.einsum(
                "btnd,ndk->btk", normed, self.read_projection[...])
        read_BxTxN = jax.nn.sigmoid(logits_BxTxN)
        record(self, "read_weights", read_BxTxN)
        return self.norm(_combine(read_BxTxN, streams))

    def write(self, state: StreamState, update_BxTxD: jax.Array,
              read_context=None) -> StreamState:
        streams = state.streams_NxBxTxD
        n, b, t, _ = streams.shape
        write_logits_BxTxN = jnp.broadcast_to(self.write_bias[...], (b, t, n))
        mixing_logits_BxTxNxN = jnp.broadcast_to(self.mixing_bias[...], (b, t, n, n))
        if self.dynamic:
            normed = self._normalized_streams(streams, again=True)
            write_logits_BxTxN = write_logits_BxTxN + self.write_scale[...] * jnp.einsum(
                "btnd,ndk->btk", normed, self.write_projection[...])
            mixing_logits_BxTxNxN = mixing_logits_BxTxNxN + self.mixing_scale[...] * jnp.einsum(
                "btnd,ndij->btij", normed, self.mixing_projection[...])
            projection = sinkhorn(mixing_logits_BxTxNxN, self.sinkhorn_iterations,
                                  self.sinkhorn_tolerance)
            mixing_BxTxNxN = projection.matrix
        else:  # one matrix for every token
            projection = sinkhorn(self.mixing_bias[...], self.sinkhorn_iterations,
                                  self.sinkhorn_tolerance)
            mixing_BxTxNxN = jnp.broadcast_to(projection.matrix, (b, t, n, n))
        write_BxTxN = 2 * jax.nn.sigmoid(write_logits_BxTxN)
        record(self, "mixing_matrix", mixing_BxTxNxN)
        record(self, "sinkhorn_iterations", projection.iterations)
        record(self, "sinkhorn_column_error", projection.column_error)
        record(self, "write_strengths", write_BxTxN)
        return StreamState(_mix_and_write(mixing_BxTxNxN, write_BxTxN, streams, update_BxTxD),
                           state.sublayer + 1)


@RESIDUALS.register("width")
class WidthBaseline(ResidualMechanism):
    """The simple width baseline: n = `model.residual.streams` branches and no
    mixing between them. Sublayer k reads a learned scalar mixture of the branches and adds its
    update to one branch, in round-robin order:

        h = norm(Σ_m a_m x_m),    x_{k mod n} ← x_{k mod n} + F(h),

    a ∈ R^n (`branch_weights`) per sublayer. It separates what a wider residual state buys from
    what HC's learned mixing and write strengths buy.

    Initialization: a = 1; the embedding starts in branch 0, the other branches at 0, and the
    final norm reads the sum of the branches (`SeparateBranches`). So at initialization
    Σ_m x_m is exactly the Pre-Norm stream (the same terms summed in another order) and the
    network equals the Pre-Norm model.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.streams = cfg.residual.streams
        self.norm = make_norm(cfg, rngs=rngs)  # the sublayer's Pre-Norm
        self.branch_weights = param(rngs, nnx.initializers.ones, (self.streams,), (None,),
                                    MixingParam)

    @classmethod
    def stream(cls, cfg, *, execution=None, rngs: nnx.Rngs) -> nnx.Module:
        return SeparateBranches(cfg.residual.streams)

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """Read nd, write d (the mixed read); read d (output) + read d (the target branch),
        write d → (n + 4)d."""
        n, T = cfg.residual.streams, ResidualTraffic
        return ResidualIO((T("mix the read", n, 1), T("read the sublayer output", 1, 0),
                           T("update the target branch", 1, 1)))

    @classmethod
    def residual_history(cls, cfg) -> int:
        """The n branches."""
        return cfg.residual.streams

    @classmethod
    def check_prunable(cls, cfg, kept, drop) -> None:
        """Sublayer k writes into branch k mod n: a kept sublayer that moves from k to k' must
        keep its branch, k − k' ≡ 0 (mod n)."""
        n, per_block = cfg.residual.streams, sublayers_per_block(cfg)
        if any((old - new) * per_block % n for new, old in enumerate(kept)):
            raise ValueError(
                f"model.residual.name='width': dropping blocks {list(drop)} moves the round-robin "
                f"write target (branch k mod n, n = model.residual.streams={n}) of later "
                f"sublayers; drop blocks whose removal shifts k ({per_block} per block) by a "
                "multiple of n, e.g. the last blocks")

    def read(self, state: StreamState) -> jax.Array:
        branches = state.streams_NxBxTxD
        n, b, t, _ = branches.shape
        read_BxTxN = jnp.broadcast_to(self.branch_weights[...], (b, t, n))
        record(self, "read_weights", read_BxTxN)
        return self.norm(_combine(read_BxTxN, branches))

    def write(self, state: StreamState, update_BxTxD: jax.Array,
              read_context=None) -> StreamState:
        branches = state.streams_NxBxTxD
        n, b, t, _ = branches.shape
        target = state.sublayer % n
        record(self, "write_strengths",
               jnp.broadcast_to(jax.nn.one_hot(target, n, dtype=jnp.float32), (b, t, n)))
        return StreamState(branches.at[target].add(update_BxTxD.astype(branches.dtype)),
                           state.sublayer + 1)
