"""Books of a model from its config alone (via `jax.eval_shape`, nothing allocated)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from arch.attention import ATTENTION
from arch.heads import HEADS
from arch.model import TransformerLM
from arch.residual import RESIDUALS


def abstract_model(model_cfg) -> TransformerLM:
    """The model with ShapeDtypeStruct leaves: shapes and logical axes, no memory. Built outside
    any mesh context the caller is in (nnx.eval_shape would read the logical names as mesh
    axes)."""
    frozen = ml_collections.FrozenConfigDict(model_cfg)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        return nnx.eval_shape(lambda: TransformerLM(frozen, rngs=nnx.Rngs(0)))


def _size(state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def parameter_count(model_cfg) -> int:
    """All parameters (`nnx.Param`; not running statistics or MoE loss/metric variables), every
    routed expert included."""
    return _size(nnx.state(abstract_model(model_cfg), nnx.Param))


def _routed_expert_share(model_cfg, model) -> tuple[int, int, int]:
    """(routed-expert weights, k, E): the stacked weights of `arch.moe.RoutedExperts`, of which
    each token uses k of E experts (0 weights without MoE)."""
    if model_cfg.ffn != "moe":
        return 0, 1, 1
    routed = nnx.state(model, lambda path, _: "routed_experts" in path)
    return _size(routed), model_cfg.moe_top_k, model_cfg.moe_experts


def active_parameter_count(model_cfg) -> int:
    """Parameters one token uses: the total minus the (E − k)/E share of the routed-expert
    weights (each token runs k of the E experts); equals `parameter_count` without MoE."""
    model = abstract_model(model_cfg)
    routed, k, experts = _routed_expert_share(model_cfg, model)
    return _size(nnx.state(model, nnx.Param)) - routed * (experts - k) // experts


def matmul_parameter_count(model_cfg) -> int:
    """Weights used in one matrix multiply per token: every Dense kernel once (MoE router and
    shared experts included), routed MoE expert weights at k/E of their size (a token runs k of
    the E experts; dispatch/combine einsums are not counted), plus what the head multiplies again
    (the tied embedding; MoS's K vocabulary projections)."""
    model = abstract_model(model_cfg)
    count = _size(nnx.state(model, lambda path, _: path[-1] == "kernel"))
    routed, k, experts = _routed_expert_share(model_cfg, model)
    count += routed * k // experts
    return count + HEADS[model_cfg.head].reused_matmul_parameters(model_cfg)


COMPONENTS = ("embedding", "attention", "ffn", "norms", "residual", "head")


def component_of(path: tuple[str, ...]) -> str:
    """The component a parameter belongs to, from its path in the model:

      embedding  the token table and learned position table (`embed`, `position`)
      attention  everything inside a block's `attention` module (MLA's latent norms included)
      ffn        everything inside a block's `ffn` module (MoE router and experts included)
      norms      the sublayer norms of the plain sums (`*_residual/norm`) and `final_norm`
      residual   the rest of the residual mechanism (`*_residual/...`, the model-level
                 `residual_stream`: AttnRes pseudo-queries, HC/mHC/GR gates and their norms)
      head       the output head (an untied projection, MoS/MoC mixtures, an output bias)
    """
    keys = [str(key) for key in path]
    for key in keys:
        if key in ("embed", "position"):
            return "embedding"
        if key in ("attention", "ffn", "head"):
            return key
        if key == "final_norm":
            return "norms"
        if key.endswith("_residual") or key == "residual_stream":
            following = keys[keys.index(key) + 1:]
            return "norms" if following[:1] == ["norm"] else "residual"
    raise ValueError(f"parameter {'/'.join(keys)} belongs to no known component")


def parameter_breakdown(model_cfg) -> dict[str, int]:
    """Parameter counts by component (`component_of`), from the abstract model:

      total           unique parameters (storage), every routed expert included
      active          parameters one token uses (`active_parameter_count`)
      <component>     one entry per name in `COMPONENTS`; they sum to `total`
      vocabulary      parameters indexed by the vocabulary or by position: tables with a logical
                      `vocab` or `positions` axis (token embedding, learned positions, an untied
                      output projection and an output bias)
      non_embedding   total − vocabulary (Kaplan et al. 2020's N: what scales with depth and width)
      tying_savings   the untied head's parameters minus the tied head's: V·d (V·d + 0 for bias)
    """
    model = abstract_model(model_cfg)
    counts = dict.fromkeys(COMPONENTS, 0)
    vocabulary = 0
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        size = math.prod(variable.shape)
        counts[component_of(path)] += size
        if {"vocab", "positions"} & set(variable.get_metadata().get("out_sharding") or ()):
            vocabulary += size
    total = sum(counts.values())
    untied = ml_collections.ConfigDict(model_cfg.to_dict())
    untied.update(head="untied", fixnorm=False)
    tied = ml_collections.ConfigDict(untied.to_dict())
    tied.head = "tied"
    return {"total": total, "active": active_parameter_count(model_cfg), **counts,
            "vocabulary": vocabulary, "non_embedding": total - vocabulary,
            "tying_savings": parameter_count(untied) - parameter_count(tied)}


def kv_cache_bytes_per_token(model_cfg, dtype: str | None = None) -> int:
    """Bytes the KV cache holds per token, over all layers: each attention class's
    `cache_shapes` per position (MHA/GQA/MQA: keys and values, 2·h_kv·p; MLA: the latent and
    the decoupled rotary key, d_c + d_r), × num_layers × the itemsize of `dtype` (default the
    compute dtype `model.dtype`). Per sequence: × its length."""
    shapes = ATTENTION[model_cfg.attention].cache_shapes(model_cfg, 1, 1)
    per_layer = sum(math.prod(shape) for shape in shapes.values())
    itemsize = jnp.dtype(dtype or model_cfg.dtype).itemsize
    return model_cfg.num_layers * per_layer * itemsize


def flops_per_token(model_cfg, seq_len: int, training: bool = True) -> float:
    """Matmul FLOPs per token: 2 per matmul weight, plus causal attention counted honestly (each
    attention class's `score_flops_per_token`: position t attends to t + 1 keys, not T).
    Training (forward + backward) is 3× forward.
    """
    attention = ATTENTION[model_cfg.attention].score_flops_per_token(model_cfg, seq_len)
    forward = 2 * matmul_parameter_count(model_cfg) + model_cfg.num_layers * attention
    return float(3 * forward if training else forward)


# Residual-stream mechanisms (issue 4) ------------------------------------------------------------

PLAIN_SUMS = ("prenorm", "postnorm", "deepnorm", "noskip")


@dataclasses.dataclass(frozen=True)
class ResidualTraffic:
    """One itemized memory access of a residual mechanism, per token per sublayer, in units of d
    elements. `state` marks traffic of the stored residual state (the branches of
    gated_residual, stored in `model.gr_state_dtype`); everything else moves `model.dtype`."""

    what: str
    reads: float
    writes: float
    state: bool = False


@dataclasses.dataclass(frozen=True)
class ResidualIO:
    """A mechanism's residual I/O per token per sublayer: the itemized traffic (units of d) and
    the small per-token scalars it also moves (mHC's n×n mixing matrix and 2n read/write
    coefficients: `scalars` elements, not multiplied by d and not included in `total`)."""

    items: tuple[ResidualTraffic, ...]
    scalars: float = 0.0

    @property
    def reads(self) -> float:
        return sum(item.reads for item in self.items)

    @property
    def writes(self) -> float:
        return sum(item.writes for item in self.items)

    @property
    def total(self) -> float:
        """Reads plus writes, in units of d elements."""
        return self.reads + self.writes

    def state_total(self) -> float:
        """The part of `total` that is stored-state traffic (see `ResidualTraffic.state`)."""
        return sum(item.reads + item.writes for item in self.items if item.state)


def residual_io(mechanism: str, *, sublayers: int, block_size: int = 1, streams: int = 1,
                gr_mixing: bool = False) -> ResidualIO:
    """Closed-form residual I/O per token per sublayer (worst case over the network's sublayers),
    in units of d elements, itemized. L = `sublayers`, S = `block_size` (sublayers per block or
    chunk), N = ⌈L/S⌉, n = `streams`. Per-token scalars (mixing coefficients) are kept apart in
    `ResidualIO.scalars` (only hc/mhc have any worth listing); everything below is in d.

    - plain sums (prenorm, postnorm, deepnorm, noskip): read the stream (1) and the sublayer
      output (1), write the stream (1) → 3.
    - block_attnres, two-phase schedule (AttnRes report, "Block AttnRes" inference schedule):
      phase 1 reads the N block summaries once per block for all S queries → N/S; the phase-1
      result is written and read back → 2; the partial sum is read once (online-softmax merge and
      the add), the sublayer output read, the partial sum written → 3. Total N/S + 5
      (5.5 at L = 128, S = 16).
    - attnres (Full, "scheduled": the same two-phase schedule over chunks of S sublayers, every
      output its own source; S = `model.attnres_block_size`): phase 1 reads the (N − 1)·S
      outputs of earlier chunks once per chunk → N − 1 (= (L − S)/S when S divides L); the
      phase-1 result written and read back → 2; phase 2 merges up to S − 1 intra-chunk outputs →
      S − 1; the sublayer's output is stored once as a source (its own write, not counted).
      Total L/S + S (24 at L = 128, S = 16). `model.attnres_window` is not modelled (an upper
      bound for windowed depth attention).
    - hc, mhc with n streams (Xie et al. 2025, "mHC", the I/O table of its efficiency section):
      compute the coefficients: read nd; apply read weights: read nd, write d; apply write
      strengths: read d, write nd; apply the mixing matrix: read nd, write nd; merge: read 2nd,
      write nd → (8n + 2)d (34d at n = 4), plus 2n² + 4n scalars (the n×n matrix and 2n
      coefficients, read and written).
    - width (n branches, scalar read mixture, round-robin write): read nd, write d (the mixed
      read); read d (output) + read d (the target branch), write d → (n + 4)d.
    - gated_residual (n branches): gates read nd; apply read: read nd, write d; write: read d
      (output) + read nd (branches), write nd → (4n + 2)d (18d at n = 4); with `gr_mixing` the
      mixing matrix adds read nd + write nd → (6n + 2)d. Branch traffic is state traffic.
    """
    L, S, n = sublayers, max(1, min(block_size, sublayers)), streams
    N = math.ceil(L / S)
    T = ResidualTraffic
    if mechanism in PLAIN_SUMS:
        items = (T("read the stream", 1, 0), T("read the sublayer output", 1, 0),
                 T("write the stream", 0, 1))
        return ResidualIO(items)
    if mechanism == "block_attnres":
        items = (T("phase 1: read the N block summaries once per block", N / S, 0),
                 T("phase 1 result: write, read back", 1, 1),
                 T("read the partial sum (merge and add)", 1, 0),
                 T("read the sublayer output", 1, 0), T("write the partial sum", 0, 1))
        return ResidualIO(items)
    if mechanism == "attnres":
        items = (T("phase 1: read the earlier chunks' outputs once per chunk", N - 1, 0),
                 T("phase 1 result: write, read back", 1, 1),
                 T("phase 2: merge the intra-chunk outputs", S - 1, 0))
        return ResidualIO(items)
    if mechanism in ("hc", "mhc"):
        items = (T("compute the coefficients", n, 0), T("apply the read weights", n, 1),
                 T("apply the write strengths", 1, n), T("apply the mixing matrix", n, n),
                 T("merge", 2 * n, n))
        return ResidualIO(items, scalars=2 * n * n + 4 * n)
    if mechanism == "width":
        items = (T("mix the read", n, 1), T("read the sublayer output", 1, 0),
                 T("update the target branch", 1, 1))
        return ResidualIO(items)
    if mechanism == "gated_residual":
        items = (T("compute the read gates", n, 0, state=True),
                 T("apply the read gates: read the branches", n, 0, state=True),
                 T("apply the read gates: write the read", 0, 1),
                 T("write: read the sublayer output", 1, 0),
                 T("write: update the branches", n, n, state=True))
        if gr_mixing:
            items += (T("apply the mixing matrix", n, n, state=True),)
        return ResidualIO(items)
    known = ", ".join((*PLAIN_SUMS, "attnres", "block_attnres", "hc", "mhc", "width",
                       "gated_residual"))
    raise ValueError(f"no residual I/O model for {mechanism!r}; modelled: {known}")


def sublayer_count(model_cfg) -> int:
    """L: residual sublayers in the network (attention and FFN per block, or attention only)."""
    return model_cfg.num_layers * (2 if model_cfg.use_ffn else 1)


def residual_history(mechanism: str, *, sublayers: int, block_size: int = 1,
                     streams: int = 1) -> int:
    """Residual state kept per token, in units of d elements: 1 for the plain sums (the stream);
    L + 1 for Full AttnRes (every sublayer output and the embedding); N + 1 for Block AttnRes
    with N = ⌈L/S⌉ (the embedding, the N − 1 completed block summaries and the current block's
    partial sum — at the final read the N summaries and the embedding); n for hc, mhc, width
    and gated_residual (the streams or branches)."""
    if mechanism in PLAIN_SUMS:
        return 1
    if mechanism == "attnres":
        return sublayers + 1
    if mechanism == "block_attnres":
        return math.ceil(sublayers / max(1, min(block_size, sublayers))) + 1
    if mechanism in ("hc", "mhc", "width", "gated_residual"):
        return streams
    raise ValueError(f"no residual history model for {mechanism!r}")


def residual_state_elements_per_token(model_cfg) -> int:
    """Measured: elements per token of the residual state the layer scan carries (the pytree
    `stream.begin` returns), by `jax.eval_shape` at one and at two positions (so counters and
    other per-sequence leaves cancel)."""
    frozen = ml_collections.FrozenConfigDict(model_cfg)

    def begin(x_BxTxD):
        stream = RESIDUALS[frozen.residual].stream(frozen, rngs=nnx.Rngs(0))
        return stream.begin(x_BxTxD)

    def size(positions: int) -> int:
        x = jax.ShapeDtypeStruct((1, positions, frozen.d_model), jnp.dtype(frozen.dtype))
        return _size(jax.eval_shape(begin, x))

    return size(2) - size(1)


def added_parameters(model_cfg) -> int:
    """Parameters the residual mechanism adds: `parameter_count` minus that of the same config
    with residual="prenorm" (so the plain sum's per-sublayer norms are the zero point)."""
    plain = ml_collections.ConfigDict(model_cfg.to_dict())
    plain.residual = "prenorm"
    return parameter_count(model_cfg) - parameter_count(plain)


def residual_accounting(model_cfg) -> dict:
    """The books of `model.residual` for a resolved model config, per token:

      io_per_token_per_sublayer           residual I/O, units of d (`residual_io`, worst case)
      io_elements_per_token_per_sublayer  the same in elements (× d_model), scalars excluded
      io_scalars_per_token_per_sublayer   the small per-token coefficients (hc/mhc), elements
      io_bytes_per_token_per_sublayer     stored-state traffic at `gr_state_dtype`'s itemsize
                                          (gated_residual; FP8 adds its float32 scale per row
                                          of d, 4/d bytes per element) and the rest at
                                          `model.dtype`'s
      history_elements_per_token          residual state kept (`residual_history` × d)
      state_elements_per_token            measured: what the stream's `begin` carries per token
                                          (≥ the history: e.g. AttnRes's cached 1/rms per source
                                          and head, FP8 branch scales)
      added_parameters                    parameters minus those of the same config with
                                          residual="prenorm" (the plain sum's per-sublayer norms
                                          are the zero point)
      sublayers, block_size, streams      L, S (= model.attnres_block_size), n
    """
    L, S, n = sublayer_count(model_cfg), model_cfg.attnres_block_size, model_cfg.residual_streams
    mechanism = model_cfg.residual
    io = residual_io(mechanism, sublayers=L, block_size=S, streams=n,
                     gr_mixing=bool(model_cfg.gr_mixing))
    d = model_cfg.d_model
    compute_bytes = jnp.dtype(model_cfg.dtype).itemsize
    state_bytes = compute_bytes
    if mechanism == "gated_residual":
        state_bytes = jnp.dtype(model_cfg.gr_state_dtype).itemsize
        if model_cfg.gr_state_dtype == "float8_e4m3fn":  # + a float32 scale per row of d
            state_bytes += 4 / d
    return {
        "io_per_token_per_sublayer": float(io.total),
        "io_elements_per_token_per_sublayer": float(io.total * d),
        "io_scalars_per_token_per_sublayer": float(io.scalars),
        "io_bytes_per_token_per_sublayer": float(
            d * (io.state_total() * state_bytes + (io.total - io.state_total()) * compute_bytes)),
        "history_elements_per_token": residual_history(mechanism, sublayers=L, block_size=S,
                                                       streams=n) * d,
        "state_elements_per_token": residual_state_elements_per_token(model_cfg),
        "added_parameters": added_parameters(model_cfg),
        "sublayers": L, "block_size": S, "streams": n,
    }


def books(model_cfg, seq_len: int) -> dict:
    """Every accounting figure of a resolved model config at `seq_len` (capped at the model's
    max_seq_len), as a nested dict: parameters (`parameter_breakdown`), flops per token for
    training and inference, KV-cache bytes per token and per sequence, and the residual
    mechanism's I/O, history and added parameters."""
    seq_len = min(seq_len, model_cfg.max_seq_len or seq_len)
    kv_per_token = kv_cache_bytes_per_token(model_cfg)
    residual = residual_accounting(model_cfg)
    return {
        "parameters": parameter_breakdown(model_cfg),
        "flops": {"seq_len": seq_len,
                  "training_per_token": flops_per_token(model_cfg, seq_len, True),
                  "inference_per_token": flops_per_token(model_cfg, seq_len, False)},
        "kv_cache": {"dtype": model_cfg.dtype, "bytes_per_token": kv_per_token,
                     "bytes_per_sequence": kv_per_token * seq_len},
        "residual": {"mechanism": model_cfg.residual,
                     "io_per_token_per_sublayer_d": residual["io_per_token_per_sublayer"],
                     "history_elements_per_token": residual["history_elements_per_token"],
                     "added_parameters": residual["added_parameters"]},
    }
