"""Gated Residual (GR) on GatedNorm ("gated_residual", registered in `RESIDUALS`).

Source: the Qwen3.8-Next architecture report, §2.2 ("Gated Residual", built on GatedNorm,
`arch.norms.GatedNorm`). We only have the issue's summary of that section; what it specifies and
what this file chooses are marked [spec] and [ours] below.

The residual state is n = `model.residual.streams` branches x_1 … x_n [spec], stored stacked
n×B×T×D in `model.gated_residual.state_dtype`. Every attention and FFN sublayer has its own GR
module, which replaces the sublayer's pre-norm [spec] (so `model.norm` is not used by the reads; the
final norm still is):

    n̂_m = g_m ⊙ x_m / sqrt(mean(x_m²) + ε)                      each branch normalized, own gain
    z   = [n̂_1 … n̂_n] W_down                          (n·D → r, r = model.gated_residual.rank)
    G   = σ(b_read + z W_read)  ∈ (0,1)^{n×D}   (n×1 if not channelwise)          read gates
    h   = Σ_m G_m ⊙ n̂_m                                          sublayer input (not a softmax)
    s   = 2σ(b_write + z W_write) ∈ (0,2)^{n×D} (n×1 if not channelwise)    write strengths
    x_m ← x_m + s_m ⊙ F(h)                                        (with mixing: Σ_k M_mk x_k + …)

The static term of a gate is its logit bias, b_read or b_write (n×D, or n×1 if not
channelwise; input-independent, it carries the initialization below); the dynamic term is
z W_read or z W_write. Ablation switches (the report's Tables 5–6 ablate these [spec]; their
exact form here is [ours]; each default is the mechanism above, bit for bit):
- `gated_residual.channelwise_read=False`: G_m = σ(b_read,m + z W_read,m) is one scalar per branch
  and token, b_read ∈ R^{n×1}, W_read ∈ R^{r×n×1}; h = Σ_m G_m n̂_m.
  `gated_residual.channelwise_write=False`: likewise s_m is one scalar per branch and token. Each
  defaults to None, which follows `gated_residual.channelwise` (the switch for both).
- `gated_residual.static=False`: no b_read, b_write: G = σ(z W_read), s = 2σ(z W_write), so at z = 0
  every G_m = 1/2 and every s_m = 1 (h = (n/2)·RMSNorm(x) while the branches are equal). Needs
  `residual.dynamic=True`. [ours] W_read and W_write are then initialized N(0, 1/r) (truncated
  normal, fan-in r), not zero: zero up-projections would start every branch at the same gates
  and give them equal gradients, so the branches would stay copies of one stream forever.
  So this switch changes the initialization as well as removing the static term.
- `gated_residual.static_frozen=True`: b_read and b_write keep their initial values (the
  forward pass reads them through `jax.lax.stop_gradient`, so their gradient is 0); everything
  else, initialization included, is the full GR, so the model equals it at initialization and
  only the static term's learning is removed (`static=False` also changes the initialization,
  above). The parameters stay, the same tree as GR's; with a zero gradient AdamW leaves them
  unchanged bit for bit as long as they get no weight decay (biases get none unless
  `optimizer.decay_biases=True`). Needs `gated_residual.static`. Cost: none beyond GR.
- `gated_residual.init="random"`: b_write[m, c] ~ U(logit(1/(2n)), logit(1 − 1/(2n))) i.i.d. per
  branch (and channel, if the writes are channelwise), the range of the graded logits, i.e. s ∈
  (1/n, 2 − 1/n); drawn with the `rngs.params()` key of that parameter, so a seed reproduces it
  and every other parameter is the same as with "graded". Needs `gated_residual.static`. The
  design notes' final GR uses this standard random initialization (the study's `gr` arm);
  "graded", the model's default, is the variant (experiments/gated_residual_table.py).
- `gated_residual.read_top_k=k` (1 ≤ k ≤ n; 0: off): per token, the branches are ranked by their
  read gate (its mean over channels, if channelwise; ties to the lower index) and the gates of all
  but the k largest are set to 0: h = Σ_{m ∈ top-k} G_m ⊙ n̂_m (no renormalization; gradient through
  the kept gates only). The gates are still computed from all n branches and the read is applied
  densely, so the residual I/O accounting is unchanged (a gathering kernel would read kd, not nd,
  to apply the gates).

[spec]: n branches normalized independently, each with its own gain; read gates in (0,1) per branch
and per channel, predicted low-rank from all branches (not pooled first); read weights are not a
softmax and need not sum to one; write strengths in (0,2) per branch; no branch-mixing matrix; GR
replaces the pre-norm, one GR module per sublayer; ablations: channel-specific vs scalar reads and
writes (`model.gated_residual.channelwise`, or each alone: `gated_residual.channelwise_read`,
`gated_residual.channelwise_write`), a branch-mixing operator added back
(`model.gated_residual.mixing`), static vs dynamic gates (`model.residual.dynamic`), the static term
removed (`model.gated_residual.static`; [ours]: or kept untrained,
`model.gated_residual.static_frozen`), random or graded initialization
(`model.gated_residual.init`), top-k reads (`model.gated_residual.read_top_k`); an FP8 residual
state (`model.gated_residual.state_dtype`).

[ours]:
- Dynamic part. W_down (truncated normal, variance 1/(n·D)) is shared by the read gates and the
  write strengths (HC/mHC also predict every dynamic weight from the sublayer's input); W_read and
  W_write are zero-initialized as GatedNorm's up-projection, so the gates start at their static
  values and the up-projections get gradient from the first step (with `gated_residual.static=False`
  they are random: above). `residual.dynamic=False`: no W_down/W_read/W_write, G = σ(b_read) and
  s = 2σ(b_write).
- Initialization. g_m = 1. b_read = logit(1/n), so G_m = 1/n and Σ_m G_m = 1: while the branches
  are equal, h = RMSNorm(x) exactly as a Pre-Norm read (no GatedNorm-style 1/2 factor). b_write is
  graded over the branches, s_m = (2m + 1)/n for m = 0 … n−1 (n = 4: 0.25, 0.75, 1.25, 1.75),
  mean 1. Why: with equal strengths every branch stays a copy of the Pre-Norm stream and, the
  model being symmetric in the branches, so do their gradients: the n branches would never
  differ. Graded strengths break the symmetry without a layer index: at initialization branch m is
  x⁰ + s_m·Σ(updates), from embedding-dominated (small s_m) to update-dominated (large s_m), and
  the branch mean is the Pre-Norm stream x⁰ + Σ(updates). (Alternatives we did not take: HC's
  one-hot read of branch l mod n, which needs a sublayer counter; random static parts.)
- Mixing (`gated_residual.mixing=True`): a static n×n matrix M = I + Δ per sublayer, Δ
  zero-initialized and unconstrained (HC's static A_r, not mHC's doubly-stochastic projection);
  weight decay on Δ pulls M toward the identity (no mixing).
- begin: the embedding copied into every branch. end: the mean of the branches (the final norm
  is scale-invariant, so the mean and HC's sum differ only with `norm.final=False`, where the
  mean keeps the scale of one stream).
- State dtype. "float32" (default) or "bfloat16": the branches are cast. "float8_e4m3fn": each
  branch row x_m[b, t, :] is stored as FP8 values times a power-of-two scale 2^e, the smallest with
  max|x|/2^e ≤ 448 (the largest finite e4m3fn value): nothing overflows, the scaling itself is
  exact, and a stored value differs from x by at most 2⁻⁴·|x| (3 mantissa bits) or, far below the
  row maximum, by half the subnormal step, 2⁻¹⁰·2^e. The state holds the FP8 payload (1 byte per
  value) and the float32 scales (4 bytes per row of D): (D + 4)/(2D) of a bfloat16 state.
  Its accuracy against the float32 state is bounded in tests/test_gated_residual.py (measured:
  docs/performance.md#gated-residuals-fp8-state); because a last-bit difference can flip an FP8
  rounding, a sharded run matches one device only to that accuracy, not to float32 rounding.
  Gradients: in JAX the cotangent of an FP8 leaf is FP8, and an unscaled FP8 cotangent underflows
  (residual-stream gradients are ≪ 2⁻⁹), so `load_fp8`/`store_fp8` have custom VJPs: the
  gradient w.r.t. the branches is stored the same way, FP8 with a per-row power-of-two scale, and
  that scale travels back in the cotangent slot of the float32 scales (which therefore does not
  hold ∂L/∂scale). For that, each stored state must be loaded exactly once per sublayer:
  `read_with_context` returns its loaded branches and gate summary with h, and `Block` hands
  them to `write`, which reuses them (`write` alone loads the state itself).

Recorded (`arch.residual.record`): "read_gates" G (after the top-k cut) and "write_strengths"
s, both B×T×n×W (W = D if that gate is channelwise, else 1); "mixing_matrix" M (n×n) with
`gated_residual.mixing`. Recorded as `arch.residual.PathTerm` (only for a caller that captures that
kind: the path decomposition, `train.instruments.gr_paths`): "read_inverse_rms" 1/sqrt(mean(x_m²) +
ε) (B×T×n×1), "branch_gains" g (n×D), "read" h before its cast to `model.dtype` (B×T×D),
"sublayer_output" F(h) (B×T×D, float32), and, from the stream's `begin`, "embedding" x⁰ (B×T×D,
float32).

Parameters: `scale` (the branch gains g, n×D; a norm gain, kept out of weight decay by name),
`read_gate.bias` and `write_gate.bias` (static logits, kept out as biases; absent with
`gated_residual.static=False`, untrained with `gated_residual.static_frozen`),
`gate_down.kernel`, `read_gate.up.kernel`, `write_gate.up.kernel` (dynamic projections, decayed
like GatedNorm's) and `mixing` (Δ, decayed toward M = I). Per sublayer:
nD + nDr·dyn + Σ_{read, write} (nW·static + rnW·dyn) + n²·mixing, W = D or 1 per gate
(`arch.accounting.added_parameters` measures it from the built model, less the Pre-Norm gain d
that GR replaces).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from arch.layers import Dense, param
from arch.residual import (
    RESIDUALS,
    PathTerm,
    ResidualIO,
    ResidualMechanism,
    ResidualStream,
    ResidualTraffic,
    record,
)

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448


def power_of_two_scale(x: jax.Array) -> jax.Array:
    """Per row (last axis): the smallest 2^e with max|x|/2^e ≤ 448, shape x.shape[:-1] + (1,),
    float32. Rows of zeros get a tiny normal scale (their payload is 0)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    _, exponent = jnp.frexp(jnp.maximum(amax, 1e-30) / FP8_MAX)  # amax/448 = m·2^e, m ∈ [½, 1)
    return jnp.ldexp(jnp.ones_like(amax), exponent)


def _quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    scale = power_of_two_scale(x)
    return (x.astype(jnp.float32) / scale).astype(FP8), scale


@jax.custom_vjp
def store_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x (…×D, float) → (payload …×D float8_e4m3fn, scale …×1 float32), x ≈ payload·scale."""
    return _quantize(x)


def _store_fwd(x):
    return _quantize(x), None


def _store_bwd(_, cotangents):
    payload_cotangent, gradient_scale = cotangents  # the FP8 gradient and its per-row scale
    return (payload_cotangent.astype(jnp.float32) * gradient_scale,)


store_fp8.defvjp(_store_fwd, _store_bwd)


@jax.custom_vjp
def load_fp8(payload: jax.Array, scale: jax.Array) -> jax.Array:
    """payload·scale in float32 (exact). Backward: the gradient is returned as FP8 with its own
    per-row power-of-two scale, which goes back in the scale's cotangent slot (see module doc)."""
    return payload.astype(jnp.float32) * scale


def _load_fwd(payload, scale):
    return load_fp8(payload, scale), None


def _load_bwd(_, cotangent):
    return _quantize(cotangent)


load_fp8.defvjp(_load_fwd, _load_bwd)


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def graded_write_strengths(n: int) -> list[float]:
    """Initial write strengths s_m = (2m + 1)/n, m = 0 … n−1: spread over (0, 2), mean 1."""
    return [(2 * m + 1) / n for m in range(n)]


def random_write_logits(key: jax.Array, shape, dtype, n: int) -> jax.Array:
    """`gated_residual.init="random"`: write logits i.i.d. U(logit(1/(2n)), logit(1 − 1/(2n))), the
    range of the graded logits (module docstring)."""
    low, high = _logit(graded_write_strengths(n)[0] / 2), _logit(graded_write_strengths(n)[-1] / 2)
    return jax.random.uniform(key, shape, dtype, minval=low, maxval=high)


class BranchGate(nnx.Module):
    """Gate logits per branch (and channel): bias + z W_up, n×B×T×W for a summary z (B×T×r), or
    the bias alone (static gates, z = None), or z W_up alone (`static=False`: no bias). W_up is
    zero-initialized, or N(0, 1/r) without a bias (module docstring). `bias_init(key, shape,
    dtype)` overrides the constant logits `bias_per_branch`; `frozen`: the bias gets no gradient
    (`gated_residual.static_frozen`)."""

    def __init__(self, n: int, width: int, rank: int, bias_per_branch: list[float], *,
                 dynamic: bool, rngs: nnx.Rngs, static: bool = True, frozen: bool = False,
                 bias_init=None):
        channel_axis = "norm" if width > 1 else None
        values = jnp.broadcast_to(jnp.asarray(bias_per_branch, jnp.float32)[:, None], (n, width))
        bias_init = bias_init or (lambda key, shape, dtype: values.astype(dtype))
        self.bias = (param(rngs, bias_init, (n, width), (None, channel_axis))
                     if static else None)
        self.frozen = frozen
        up_init = (lambda fan_in, fan_out: nnx.initializers.zeros) if static else None
        self.up = (Dense((rank,), (n, width), ("norm_rank",),
                         (None, "embed" if width > 1 else None), rngs=rngs, init=up_init)
                   if dynamic else None)

    def __call__(self, summary_BxTxR: jax.Array | None) -> jax.Array:
        bias_NxW = None
        if self.bias is not None:
            bias_NxW = jax.lax.stop_gradient(self.bias[...]) if self.frozen else self.bias[...]
        if summary_BxTxR is None:
            return bias_NxW[:, None, None, :]
        dynamic_NxBxTxW = jnp.moveaxis(self.up(summary_BxTxR), -2, 0)
        if bias_NxW is None:
            return dynamic_NxBxTxW
        return bias_NxW[:, None, None, :] + dynamic_NxBxTxW


def channelwise(cfg, which: str) -> bool:
    """Whether the `which` ("read" or "write") gates are per channel: `gr_channelwise_<which>`,
    or `gated_residual.channelwise` where that is None."""
    value = cfg.gated_residual[f"channelwise_{which}"]
    return cfg.gated_residual.channelwise if value is None else value


def top_k_mask(gates_NxBxTxW: jax.Array, k: int) -> jax.Array:
    """1 for the k branches of largest gate (mean over channels) per token, else 0: n×B×T×1
    (n×1×1×1 for static gates). Ties go to the lower branch index (`jax.lax.top_k`)."""
    scores_BxTxN = jnp.moveaxis(jnp.mean(gates_NxBxTxW, axis=-1), 0, -1)
    _, kept_BxTxK = jax.lax.top_k(jax.lax.stop_gradient(scores_BxTxN), k)
    mask_BxTxN = jnp.sum(jax.nn.one_hot(kept_BxTxK, gates_NxBxTxW.shape[0],
                                        dtype=gates_NxBxTxW.dtype), axis=-2)
    return jnp.moveaxis(mask_BxTxN, -1, 0)[..., None]


class GatedResidualStream(ResidualStream):
    """Model-level part: the embedding copied into every branch; the final norm reads their
    mean."""

    def __init__(self, cfg):
        self.n = cfg.residual.streams
        self.state_dtype = cfg.gated_residual.state_dtype
        self.dtype = jnp.dtype(cfg.dtype)

    def begin(self, x_BxTxD) -> dict:
        record(self, "embedding", x_BxTxD.astype(jnp.float32), PathTerm)
        branches = jnp.broadcast_to(x_BxTxD.astype(jnp.float32), (self.n, *x_BxTxD.shape))
        return store_branches(branches, self.state_dtype)

    def end(self, state: dict) -> jax.Array:
        return jnp.mean(load_branches(state), axis=0).astype(self.dtype)


def store_branches(branches_NxBxTxD: jax.Array, state_dtype: str) -> dict:
    """The residual state for float32 branches: {"branches"} in `state_dtype`, plus
    {"branch_scales"} (n×B×T×1 float32) for FP8."""
    if state_dtype == "float8_e4m3fn":
        payload, scales = store_fp8(branches_NxBxTxD)
        return {"branches": payload, "branch_scales": scales}
    return {"branches": branches_NxBxTxD.astype(state_dtype)}


def load_branches(state: dict) -> jax.Array:
    """The branches of a residual state in float32, n×B×T×D."""
    if "branch_scales" in state:
        return load_fp8(state["branches"], state["branch_scales"])
    return state["branches"].astype(jnp.float32)


@RESIDUALS.register("gated_residual")
class GatedResidual(ResidualMechanism):
    """Gated Residual on GatedNorm (Qwen3.8-Next report §2.2); equations, initialization and
    which choices are ours: see the module docstring. `read(state) -> h_BxTxD`,
    `write(state, update_BxTxD, read_context) -> state`; the state is {"branches": n×B×T×D[,
    "branch_scales"]}.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        n, d, rank = cfg.residual.streams, cfg.d_model, cfg.gated_residual.rank
        read_width = d if channelwise(cfg, "read") else 1
        write_width = d if channelwise(cfg, "write") else 1
        self.n, self.eps = n, cfg.norm.eps
        self.read_top_k = cfg.gated_residual.read_top_k
        self.dtype = jnp.dtype(cfg.dtype)
        self.state_dtype = cfg.gated_residual.state_dtype
        self.scale = param(rngs, nnx.initializers.ones, (n, d), (None, "norm"))
        dynamic = cfg.residual.dynamic
        self.gate_down = (Dense((n, d), (rank,), (None, "embed"), ("norm_rank",), rngs=rngs)
                          if dynamic else None)
        static, frozen = cfg.gated_residual.static, cfg.gated_residual.static_frozen
        self.read_gate = BranchGate(n, read_width, rank, [_logit(1.0 / n)] * n, dynamic=dynamic,
                                    static=static, frozen=frozen, rngs=rngs)
        random_init = ((lambda key, shape, dtype: random_write_logits(key, shape, dtype, n))
                       if cfg.gated_residual.init == "random" else None)
        self.write_gate = BranchGate(n, write_width, rank,
                                     [_logit(s / 2) for s in graded_write_strengths(n)],
                                     dynamic=dynamic, static=static, frozen=frozen,
                                     bias_init=random_init, rngs=rngs)
        self.mixing = (param(rngs, nnx.initializers.zeros, (n, n), (None, None))
                       if cfg.gated_residual.mixing else None)

    @classmethod
    def stream(cls, cfg, *, execution=None, rngs: nnx.Rngs) -> nnx.Module:
        return GatedResidualStream(cfg)

    def _gates_input(self, state: dict):
        """Loaded branches (float32), their inverse rms (n×B×T×1), normalized branches n̂ and the
        low-rank summary z."""
        branches = load_branches(state)
        inverse_rms = jax.lax.rsqrt(jnp.mean(branches**2, axis=-1, keepdims=True) + self.eps)
        normalized = branches * inverse_rms * self.scale[...][:, None, None, :]
        summary_BxTxR = (self.gate_down(jnp.moveaxis(normalized, 0, -2))
                         if self.gate_down is not None else None)
        return branches, inverse_rms, normalized, summary_BxTxR

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """n branches: gates read nd; apply read: read nd, write d; write: read d (output) + read
        nd (branches), write nd → (4n + 2)d (18d at n = 4); with `gated_residual.mixing` the mixing
        matrix adds read nd + write nd → (6n + 2)d. Branch traffic is state traffic."""
        n, T = cfg.residual.streams, ResidualTraffic
        items = (T("compute the read gates", n, 0, state=True),
                 T("apply the read gates: read the branches", n, 0, state=True),
                 T("apply the read gates: write the read", 0, 1),
                 T("write: read the sublayer output", 1, 0),
                 T("write: update the branches", n, n, state=True))
        if cfg.gated_residual.mixing:
            items += (T("apply the mixing matrix", n, n, state=True),)
        return ResidualIO(items)

    @classmethod
    def residual_history(cls, cfg) -> int:
        return cfg.residual.streams

    @classmethod
    def state_itemsize(cls, cfg) -> float:
        """`model.gated_residual.state_dtype`'s itemsize; FP8 adds its float32 scale per row of
        d."""
        dtype = cfg.gated_residual.state_dtype
        itemsize = float(jnp.dtype(dtype).itemsize)
        return itemsize + 4 / cfg.d_model if dtype == "float8_e4m3fn" else itemsize

    def probe_norm(self, state: dict) -> tuple[nnx.Module, jax.Array]:
        """The per-branch normalization: gain `scale` (n×D), input the n·B·T branch rows."""
        branches_NxBxTxD = load_branches(jax.lax.stop_gradient(state))
        return self, branches_NxBxTxD.reshape(-1, *branches_NxBxTxD.shape[2:])

    def read(self, state: dict) -> jax.Array:
        return self.read_with_context(state)[0]

    def read_with_context(self, state: dict) -> tuple[jax.Array, tuple]:
        """(h, (loaded branches, gate summary z)): `write` reuses both, so each stored state is
        loaded once per sublayer (the FP8 gradients need that, module docstring)."""
        branches, inverse_rms, normalized, summary_BxTxR = self._gates_input(state)
        gates = jax.nn.sigmoid(self.read_gate(summary_BxTxR))  # n×B×T×W or n×1×1×W, in (0,1)
        if self.read_top_k:
            gates = gates * top_k_mask(gates, self.read_top_k)
        record(self, "read_gates", _per_token(gates, normalized.shape))
        read_BxTxD = jnp.sum(gates * normalized, axis=0)
        record(self, "read_inverse_rms", jnp.moveaxis(inverse_rms, 0, 2), PathTerm)
        record(self, "branch_gains", self.scale[...], PathTerm)
        record(self, "read", read_BxTxD, PathTerm)
        return read_BxTxD.astype(self.dtype), (branches, summary_BxTxR)

    def write(self, state: dict, update_BxTxD: jax.Array, read_context=None) -> dict:
        if read_context is not None:
            branches, summary_BxTxR = read_context
        else:
            branches, _, _, summary_BxTxR = self._gates_input(state)
        strengths = 2.0 * jax.nn.sigmoid(self.write_gate(summary_BxTxR))  # in (0,2)
        record(self, "write_strengths", _per_token(strengths, branches.shape))
        record(self, "sublayer_output", update_BxTxD.astype(jnp.float32), PathTerm)
        if self.mixing is not None:
            mixing_NxN = jnp.eye(self.n, dtype=jnp.float32) + self.mixing[...]
            record(self, "mixing_matrix", mixing_NxN)
            branches = jnp.einsum("mk,kbtd->mbtd", mixing_NxN, branches)
        branches = branches + strengths * update_BxTxD.astype(jnp.float32)[None]
        return store_branches(branches, self.state_dtype)


def _per_token(values_NxBxTxW: jax.Array, shape_NxBxTxD) -> jax.Array:
    """Gates as B×T×n×W (static gates broadcast over the batch and the tokens)."""
    n, batch, length, _ = shape_NxBxTxD
    values = jnp.broadcast_to(values_NxBxTxW, (n, batch, length, values_NxBxTxW.shape[-1]))
    return jnp.moveaxis(values, 0, 2)
