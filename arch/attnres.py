"""Attention Residuals (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031): each sublayer
reads a learned attention mixture over depth instead of the unit-weight residual sum.

Full AttnRes (paper §3, "Full Attention Residuals"), registered as "attnres". The sources of
sublayer l (0-based, attention and FFN sublayers counted separately, n = 2L of them, L with
`model.use_ffn=False`) are the token embedding v₀ = x⁰ and every earlier sublayer output
v_j = F_j(h_j), j < l. With a pseudo-query w_l ∈ R^d per sublayer,

    α_{j→l} = softmax_j( w_l · k̂_j ),   k̂_j = v_j / sqrt(mean(v_j²) + ε),    (scores in float32)
    h_l = norm_l( Σ_j α_{j→l} v_j ),     the sublayer input (a Pre-Norm on the mixed read),

and a final read with its own pseudo-query w_n feeds the model's final norm. The keys are RMS-
normalized without a gain on purpose: w · (g ⊙ k̂) = (w ⊙ g) · k̂, so a key gain is redundant with
the query. Initialization: every w = 0, so the weights start uniform over the available sources
(1/(l+1)), not at the ordinary unit-weight sum (the norm that follows removes the scale anyway).

Block AttnRes (paper §3, "Block Attention Residuals"), registered as "block_attnres": the n
sublayers form N = ⌈n/S⌉ blocks of S = `model.attnres.block_size` consecutive sublayers. The
outputs of a block are summed, b_m = Σ_{j ∈ block m} v_j; sublayer l of block m = ⌊l/S⌋ attends
over the embedding, the completed summaries b_0 … b_{m−1} and, unless it is the block's first
sublayer, the partial sum of block m's earlier outputs. Boundary rules: a read happens before its
own output is added; a summary becomes a source once, when its block completes; an output is in
exactly one source; an empty partial sum is never a source. S = 1 is Full AttnRes exactly; S ≥ n
(N = 1) keeps the embedding beside one running sum.

Storage: one buffer of 1 + N source slots (`arch.kernels.depth_read`): the embedding in slot 0
and block m's running sum in slot m + 1, so slot j ≥ 1 is a source of sublayer l iff j ≤ ⌈l/S⌉,
with each slot's 1/rms per head. Cost: (N + 1)·(D + H) stored values per token (N = n for Full
AttnRes); a naive read is O(N·D) per token, a two-phase read O(D) after its block's phase 1.

Variants (config fields):
- `attnres.query="input"`: w_l + c·W_l k̂_cur, with W_l ∈ R^{d×d} zero-initialized, the
  "current state" k̂_cur the most recent source (slot ⌈l/S⌉: the previous sublayer's output for
  Full AttnRes, the current partial sum or the last summary for Block), normalized like a key,
  and c = `attnres.query_scale` (default 1). Under Adam, with c = 1 the scores' input-dependent
  part can move up to d times as far per step as the static part (W_l's d² entries meet k̂_cur
  and k̂_j; w_l's d meet k̂_j); c = 1/d equalizes them.
- `attnres.heads=H`: d split into H chunks of d/H features; each chunk has its own query chunk,
  per-chunk key normalization and its own softmax over the sources.
- `attnres.weights="sigmoid"`: α_j = σ(w_l · k̂_j), unnormalized over the sources.
- `attnres.weights="static"`: input-independent learned weights α_{j→l} (per head), DenseFormer
  style (Pagliardini et al. 2024, "DenseFormer", §3, depth-weighted averages). Initialized to 1 on
  every available source, DenseFormer's principle of starting exactly at the standard residual
  model: with all-one weights h_l = norm(x⁰ + Σ_{j<l} v_j) is the Pre-Norm sum.
- `attnres.key_norm=False`: raw sources as keys.
- `attnres.window=W > 0`: only the W most recent sources (slots ⌈l/S⌉ − W + 1 … ⌈l/S⌉).

Two-phase schedule (paper, "Two-phase computation"), in training and with a KV cache: the
pseudo-queries do not depend on the input, so a block's S queries are batched against the
completed sources once (phase 1) and each read merges its block's partial sum into that result
(phase 2), the layer scan stepping one block at a time (`arch.kernels.block_scan`,
`arch.kernels.depth_read`; equal to the naive read to float rounding). It applies to softmax
weights with static queries and no window when blocks are whole scan units
(`units_per_block`); the other variants and layouts keep the naive read. Its one-head softmax
case runs as XLA ops, or with `execution.depth_read="pallas"` as one fused Pallas kernel, forward
and backward (`arch.kernels.pallas_depth_read`).

Pipeline parallelism: a stage is sent only the slots written since it last held the buffer
(`stage_message`, `stage_merge`; `arch.kernels.stage_transfer`); `execution.pipeline.transfer=
"full"` sends the whole buffer.

Recorded (`arch.residual.record`): "depth_weights", the weights over the N + 1 slots (zero on
unavailable slots) averaged over batch, tokens and heads, one row per read; under `nnx.capture`
the model scans unit by unit with naive reads, which record them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arch.kernels import stage_transfer
from arch.kernels.block_scan import scan_blocks
from arch.kernels.depth_read import (
    add_to_slot,
    depth_read,
    inverse_rms,
    merge_partial,
    mix_sources,
    read_slot,
    softmax_read,
    source_slots,
    split_heads,
    write_slot,
)
from arch.kernels.pallas_depth_read import pallas_softmax_read
from arch.layers import Dense, param
from arch.norms import make_norm
from arch.residual import (
    RESIDUALS,
    MixingParam,
    ResidualIO,
    ResidualMechanism,
    ResidualStream,
    ResidualTraffic,
    constrain_state,
    is_capturing,
    record,
    sublayers_per_block,
)
from config.derived import sublayer_count


@dataclasses.dataclass(frozen=True)
class DepthLayout:
    """The static shape of an AttnRes stack: how many sublayers, blocks, heads and which variant."""

    sublayers: int       # n: 2L, or L without FFNs
    block_size: int      # S sublayers per block (1: Full AttnRes)
    heads: int           # H depth-attention heads
    weights: str         # softmax | sigmoid | static
    query: str           # static | input
    query_scale: float   # c in w_l + c·W_l k̂_cur (query="input")
    key_norm: bool
    window: int          # 0: every source
    eps: float
    depth_read: str = "xla"  # the one-head softmax read: xla | pallas (`execution.depth_read`)

    @property
    def slots(self) -> int:
        """1 + N: the embedding and one slot per block."""
        return 1 + math.ceil(self.sublayers / self.block_size)

    @property
    def normalizes_keys(self) -> bool:
        return self.key_norm and self.weights != "static"

    @property
    def two_phase(self) -> bool:
        """Whether decoding uses the two-phase schedule (input-independent softmax scores)."""
        return self.weights == "softmax" and self.query == "static" and self.window == 0


def _row(table, index):
    return jax.lax.dynamic_index_in_dim(table, index, axis=0, keepdims=False)


def _read(layout: DepthLayout, state: dict, query_projection, module: nnx.Module) -> jax.Array:
    """The mixed read Σ_j α_{j→l} v_j (float32 B×T×D) of sublayer l = `state["sublayer"]` (l = n:
    the final read); inside a block opened by `AttnResStream.open`, the two-phase merge."""
    if "phase" in state:
        eps = layout.eps if layout.normalizes_keys else None
        return merge_partial(_row(state["pseudo_queries"], state["sublayer"]), *state["phase"][0],
                             None if "fresh" in state else state["partial"], layout.heads, eps)
    index = state["sublayer"]
    sources, inverse = source_slots(layout, state)
    newest = (index + layout.block_size - 1) // layout.block_size  # ⌈l/S⌉, the newest source
    slot = jnp.arange(layout.slots)
    valid = slot <= newest
    if layout.window:
        valid &= slot > newest - layout.window
    if layout.weights == "static":
        weights = _row(state["static_weights"], index).reshape(layout.slots, layout.heads)
        weights = jnp.where(valid[:, None], weights, 0.0)
        record(module, "depth_weights", weights.mean(-1))
        return mix_sources(weights, sources, layout.heads)
    query = _row(state["pseudo_queries"], index)
    if query_projection is not None:  # + W_l k̂_cur, the newest source as a key
        current = split_heads(sources[:, :, newest].astype(jnp.float32), layout.heads)
        if inverse is not None:
            current = current * inverse[:, :, newest, :, None]
        query = query + layout.query_scale * query_projection(
            current.reshape(*current.shape[:-2], -1))
    if layout.heads == 1 and layout.weights == "softmax" and not is_capturing(module):
        ones = jnp.ones(sources.shape[:3], jnp.float32)
        read = pallas_softmax_read if layout.depth_read == "pallas" else softmax_read
        return read(query, sources, ones if inverse is None else inverse[..., 0], valid)
    mixed, weights = depth_read(query, sources, inverse, valid, layout.heads, layout.weights)
    record(module, "depth_weights", weights.mean((0, 1, 3)))
    return mixed


def _query_projection(cfg, rngs: nnx.Rngs) -> Dense:
    """W ∈ R^{d×d}, zero-initialized: the input-dependent query starts at the static one."""
    return Dense((cfg.d_model,), (cfg.d_model,), ("embed",), (None,), rngs=rngs,
                 init=lambda fan_in, fan_out: nnx.initializers.zeros)


class AttnResStream(ResidualStream):
    """Model-level part of AttnRes: the pseudo-query table w_0 … w_n (the last row is the final
    read's), zero-initialized, or the static weight table (1 on every source); `begin` fills the
    source buffer with the embedding, `end` is the final read (no norm: the model's final norm
    follows)."""

    def __init__(self, layout: DepthLayout, cfg, *, rngs: nnx.Rngs):
        self.layout = layout
        rows = layout.sublayers + 1
        if layout.weights == "static":
            self.static_weights = param(rngs, nnx.initializers.ones,
                                        (rows, layout.slots, layout.heads), (None, None, None),
                                        MixingParam)
        else:
            self.pseudo_queries = param(rngs, nnx.initializers.zeros, (rows, cfg.d_model),
                                        (None, None), MixingParam)
        self.final_query_projection = (_query_projection(cfg, rngs) if layout.query == "input"
                                       else None)

    def begin(self, x_BxTxD) -> dict:
        layout = self.layout
        batch, length, width = x_BxTxD.shape
        sources = write_slot(jnp.zeros((batch, length, layout.slots * width), x_BxTxD.dtype),
                             x_BxTxD, 0, width)
        state = dict(sources=sources, sublayer=jnp.zeros((), jnp.int32))
        if layout.normalizes_keys:
            state["inverse_rms"] = write_slot(
                jnp.zeros((batch, length, layout.slots * layout.heads), jnp.float32),
                inverse_rms(x_BxTxD, layout.heads, layout.eps), 0, layout.heads)
        if layout.weights == "static":  # kept 2-D: constrain_state shards 3-D leaves as streams
            state["static_weights"] = self.static_weights[...].reshape(layout.sublayers + 1, -1)
        else:
            state["pseudo_queries"] = self.pseudo_queries[...]
        return state

    def end(self, state: dict) -> jax.Array:
        mixed = _read(self.layout, state, self.final_query_projection, self)
        return mixed.astype(state["sources"].dtype)

    def hidden_state(self, state: dict) -> jax.Array:
        """The final depth-attention read over the sources available in `state`: `end`, with the
        final read's query row (or static weight row) in the row of the state's next sublayer,
        which `end` reads."""
        key = "static_weights" if "static_weights" in state else "pseudo_queries"
        table = state[key]
        return self.end(dict(state, **{key: table.at[state["sublayer"]].set(table[-1])}))

    def units_per_block(self, units: int) -> int | None:
        """How many of the model's `units` scan units (blocks, or MoE block groups) make one
        AttnRes block, when the blocks align with them (S a multiple of the sublayers per unit, n
        a multiple of S) and the reads are two-phase: the layer scan is then `scan`, one AttnRes
        block per step. None otherwise (the naive read, unit by unit), and under `nnx.capture`
        (the naive reads record their depth weights)."""
        layout = self.layout
        if is_capturing(self):
            return None
        per_unit = layout.sublayers // units
        if (layout.two_phase and layout.block_size % per_unit == 0
                and layout.sublayers % layout.block_size == 0):
            return layout.block_size // per_unit
        return None

    def scan(self, body, state: dict, xs):
        """The whole layer stack (layouts with `units_per_block`), one AttnRes block per step:
        phase 1 for the block's reads, then `body(unit_state, x) -> (unit_state, y)` for each of
        its scan units, whose layers read by merging into phase 1 and add their outputs to the
        block's partial sum, then the sum written to its slot (`arch.kernels.block_scan`).
        Returns (final state, y stacked over units)."""
        return scan_blocks(self, body, state, xs, constrain_state)

    def stage_window(self, lag: int) -> int:
        """Source slots a pipeline stage is sent: those written in `lag` consecutive sublayers,
        at most ⌈(lag − 1)/S⌉ + 1 of the 1 + N (all of them when that is no fewer)."""
        return stage_transfer.window(self.layout.slots, self.layout.block_size, lag)

    def stage_message(self, state: dict, lag: int) -> dict:
        """What a pipeline stage that last held this state `lag` sublayers ago lacks (the cached
        transfer of the AttnRes report, `sharding/pipeline.py`): the counter and the window of
        slots written since, with their 1/rms. The embedding, the blocks completed before and the
        query table are in its copy already, so a transfer is O(lag/S) slots instead of 1 + N."""
        return stage_transfer.message(self.layout.slots, self.layout.block_size, state, lag)

    def stage_merge(self, cached: dict, message: dict, lag: int) -> dict:
        """The state from a stage's own older copy and a `stage_message`: the window written
        over the copy's slots (slots before the window are final in both, those after empty)."""
        return stage_transfer.merge(self.layout.slots, self.layout.block_size, cached, message,
                                    lag)


@RESIDUALS.register("attnres")
class AttentionResidual(ResidualMechanism):
    """Full Attention Residuals, per sublayer: h_l = norm(Σ_j α_{j→l} v_j) over the embedding and
    every earlier sublayer output (equations, initialization and sources: the module docstring of
    `arch/attnres.py`). Parameters here: the read's norm (`model.norm`, gain 1) and, with
    `attnres.query="input"`, the zero-initialized query projection W_l."""

    def __init__(self, cfg, *, execution=None, rngs: nnx.Rngs):
        self.layout = self.depth_layout(cfg, execution)
        self.norm = make_norm(cfg, rngs=rngs)
        self.query_projection = (_query_projection(cfg, rngs) if self.layout.query == "input"
                                 else None)

    @staticmethod
    def block_size(cfg) -> int:
        return 1

    @classmethod
    def depth_layout(cls, cfg, execution=None) -> DepthLayout:
        """The layout of `cfg` (the `model` section), with the depth read of `execution`."""
        return DepthLayout(sublayers=cfg.num_layers * (2 if cfg.use_ffn else 1),
                           block_size=cls.block_size(cfg), heads=cfg.attnres.heads,
                           weights=cfg.attnres.weights, query=cfg.attnres.query,
                           query_scale=cfg.attnres.query_scale,
                           key_norm=cfg.attnres.key_norm, window=cfg.attnres.window,
                           eps=cfg.norm.eps,
                           depth_read="xla" if execution is None else execution.depth_read)

    @classmethod
    def stream(cls, cfg, *, execution=None, rngs: nnx.Rngs) -> nnx.Module:
        return AttnResStream(cls.depth_layout(cfg, execution), cfg, rngs=rngs)

    @classmethod
    def build(cls, cfg, *, execution=None, rngs: nnx.Rngs) -> AttentionResidual:
        return cls(cfg, execution=execution, rngs=rngs)

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """Full AttnRes, "scheduled" (the two-phase schedule of the AttnRes report over chunks of
        S = `model.attnres.block_size` sublayers, every output its own source; L sublayers,
        N = ⌈L/S⌉): phase 1 reads the (N − 1)·S outputs of earlier chunks once per chunk →
        N − 1; the phase-1 result written and read back → 2; phase 2 merges up to S − 1
        intra-chunk outputs → S − 1; the sublayer's output is stored once as a source (not
        counted). Total L/S + S (24 at L = 128, S = 16). `model.attnres.window` is not modelled
        (an upper bound for windowed depth attention)."""
        L, S, N = _chunking(cfg)
        T = ResidualTraffic
        return ResidualIO((T("phase 1: read the earlier chunks' outputs once per chunk", N - 1, 0),
                           T("phase 1 result: write, read back", 1, 1),
                           T("phase 2: merge the intra-chunk outputs", S - 1, 0)))

    @classmethod
    def mixing_flops_per_token(cls, cfg) -> float:
        """The depth reads: read l (l = 0 … n, the last the final read) has
        s_l = 1 + ⌈l/S⌉ sources (at most W with `attnres.window`), each costing 2d for its
        score w_l · k̂_j (none with static weights) and 2d for its share of the weighted sum:
        Σ_l 4d·s_l FLOPs per token (2d·s_l static); the keys' RMS norms are elementwise and
        not counted, nor is the input-dependent query's W_l (a matmul weight)."""
        layout = cls.depth_layout(cfg)
        sources = [1 + math.ceil(read / layout.block_size) for read in range(layout.sublayers + 1)]
        if layout.window:
            sources = [min(count, layout.window) for count in sources]
        per_source = (2 if layout.weights == "static" else 4) * cfg.d_model
        return float(per_source * sum(sources))

    @classmethod
    def residual_history(cls, cfg) -> int:
        """N + 1 sources: the embedding and one per block of S (Full: S = 1, L + 1)."""
        L = sublayer_count(cfg)
        return math.ceil(L / max(1, min(cls.block_size(cfg), L))) + 1

    @classmethod
    def check_prunable(cls, cfg, kept, drop) -> None:
        """Clean only when the kept sublayers group into AttnRes blocks of S as before (each old
        block's kept sublayers form one new block)."""
        old_blocks, new_blocks = cls._pruned_blocks(cfg, kept)
        if any((old_blocks[k] == old_blocks[k + 1]) != (new_blocks[k] == new_blocks[k + 1])
               for k in range(len(old_blocks) - 1)):
            per_block, size = sublayers_per_block(cfg), cls.block_size(cfg)
            raise ValueError(
                f"model.residual.name={cfg.residual.name!r}: dropping blocks {list(drop)} regroups "
                f"the remaining sublayers into other AttnRes blocks of model.attnres.block_size="
                f"{size}; drop blocks whose {per_block} sublayer(s) fill whole AttnRes blocks, "
                "or the last blocks")

    @classmethod
    def prune(cls, cfg, state, kept) -> None:
        """Keep the rows of the model-level pseudo-query (or static weight) table of the kept
        sublayers and the final read, and the static weights' columns of the source slots that
        still hold an output: the kept sublayers read over the remaining outputs."""
        per_block = sublayers_per_block(cfg)
        sublayers = [b * per_block + j for b in kept for j in range(per_block)]
        old_blocks, _ = cls._pruned_blocks(cfg, kept)
        rows = np.asarray([*sublayers, cfg.num_layers * per_block])
        slots = np.asarray([0, *(1 + block for block in dict.fromkeys(old_blocks))])
        stream_state = state["residual_stream"]
        if "static_weights" in stream_state:  # rows × slots × heads
            stream_state["static_weights"] = jax.tree.map(lambda x: x[rows][:, slots],
                                                          stream_state["static_weights"])
        else:  # rows × D
            stream_state["pseudo_queries"] = jax.tree.map(lambda x: x[rows],
                                                          stream_state["pseudo_queries"])

    @classmethod
    def _pruned_blocks(cls, cfg, kept) -> tuple[list[int], list[int]]:
        """The AttnRes block of every kept sublayer before and after pruning."""
        per_block, size = sublayers_per_block(cfg), cls.block_size(cfg)
        sublayers = [b * per_block + j for b in kept for j in range(per_block)]
        return ([sublayer // size for sublayer in sublayers],
                [sublayer // size for sublayer in range(len(sublayers))])

    def read(self, state: dict) -> jax.Array:
        if "phase" in state:  # only this read's inputs: the remat saves them
            inputs = {key: state[key] for key in ("sublayer", "pseudo_queries", "partial", "fresh")
                      if key in state}
            return nnx.remat(_merged_read, prevent_cse=False, graph=False)(self, dict(
                inputs, phase=state["phase"][:1]))
        mixed = _read(self.layout, state, self.query_projection, self)
        return self.norm(mixed.astype(state["sources"].dtype))

    def write(self, state: dict, update_BxTxD, read_context=None) -> dict:
        """Add the output to its block's slot (in place), or, inside an opened block, to the
        partial sum; it is a source from the next read on."""
        layout = self.layout
        index = state["sublayer"]
        state = dict(state, sublayer=index + 1)
        if "phase" in state:
            state.pop("fresh", None)  # the partial sum holds an output from now on
            partial = state["partial"]
            state.update(partial=partial + update_BxTxD.astype(partial.dtype),
                         phase=state["phase"][1:])
            return state
        slot, width = index // layout.block_size + 1, update_BxTxD.shape[-1]
        state["sources"] = add_to_slot(state["sources"], update_BxTxD, slot)
        if layout.normalizes_keys:
            state["inverse_rms"] = write_slot(
                state["inverse_rms"], inverse_rms(read_slot(state["sources"], slot, width),
                                                  layout.heads, layout.eps), slot, layout.heads)
        return state


def _chunking(cfg) -> tuple[int, int, int]:
    """(L sublayers, S = `model.attnres.block_size` capped at L, N = ⌈L/S⌉)."""
    L = sublayer_count(cfg)
    S = max(1, min(cfg.attnres.block_size, L))
    return L, S, math.ceil(L / S)


def _merged_read(residual: AttentionResidual, state: dict) -> jax.Array:
    """norm(the two-phase merge) of a read in an opened block, rematerialized (`nnx.remat`): the
    backward pass recomputes both from the phase-1 result and the partial sum, which are saved
    anyway, instead of saving the merged read and three D-wide arrays of the norm per read
    (written to memory and read back)."""
    mixed = _read(residual.layout, state, None, residual)
    return residual.norm(mixed.astype(state["partial"].dtype))


@RESIDUALS.register("block_attnres")
class BlockAttentionResidual(AttentionResidual):
    """Block Attention Residuals, per sublayer: blocks of S = `model.attnres.block_size`
    sublayers summed into one source each; the read attends over the embedding, the completed
    block summaries and the current partial sum (boundary rules and sources: the module docstring
    of `arch/attnres.py`). S = 1 equals Full AttnRes."""

    @staticmethod
    def block_size(cfg) -> int:
        return cfg.attnres.block_size

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """Two-phase schedule (AttnRes report, "Block AttnRes" inference schedule; L sublayers,
        S = `model.attnres.block_size`, N = ⌈L/S⌉): phase 1 reads the N block summaries once per
        block for all S queries → N/S; the phase-1 result is written and read back → 2; the
        partial sum is read once (online-softmax merge and the add), the sublayer output read,
        the partial sum written → 3. Total N/S + 5 (5.5 at L = 128, S = 16)."""
        L, S, N = _chunking(cfg)
        T = ResidualTraffic
        return ResidualIO((T("phase 1: read the N block summaries once per block", N / S, 0),
                           T("phase 1 result: write, read back", 1, 1),
                           T("read the partial sum (merge and add)", 1, 0),
                           T("read the sublayer output", 1, 0), T("write the partial sum", 0, 1)))
