"""Books of a model from its config alone (via `jax.eval_shape`, nothing allocated)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from arch.attention import ATTENTION, cache_slots
from arch.heads import HEADS
from arch.model import TransformerLM
from arch.norms import make_norm
from arch.residual import (  # noqa: F401  (ResidualTraffic: re-exported with ResidualIO)
    RESIDUALS,
    ResidualIO,
    ResidualMechanism,
    ResidualTraffic,
)
from config.catalogue import RECURRENT_DECODING, has
from config.derived import layer_attentions, sublayer_count


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
    if model_cfg.ffn.name != "moe":
        return 0, 1, 1
    routed = nnx.state(model, lambda path, _: "routed_experts" in path)
    return _size(routed), model_cfg.moe.top_k, model_cfg.moe.experts


def active_parameter_count(model_cfg) -> int:
    """Parameters one token uses: the total minus the (E − k)/E share of the routed-expert
    weights (each token runs k of the E experts); equals `parameter_count` without MoE."""
    model = abstract_model(model_cfg)
    routed, k, experts = _routed_expert_share(model_cfg, model)
    return _size(nnx.state(model, nnx.Param)) - routed * (experts - k) // experts


def _matmul_weights(model_cfg, model, inside=lambda path: True) -> int:
    """Dense kernels once plus routed MoE expert weights at k/E, of the parameters whose path
    satisfies `inside` (everything by default)."""
    count = _size(nnx.state(model, lambda path, _: path[-1] == "kernel" and inside(path)))
    if model_cfg.ffn.name == "moe":
        routed = _size(nnx.state(model, lambda path, _: "routed_experts" in path
                                 and inside(path)))
        count += routed * model_cfg.moe.top_k // model_cfg.moe.experts
    return count


def matmul_parameter_count(model_cfg) -> int:
    """Weights used in one matrix multiply per token: every Dense kernel once (MoE router and
    shared experts included), routed MoE expert weights at k/E of their size (a token runs k of
    the E experts; dispatch/combine einsums are not counted), plus what the head multiplies again
    (the tied embedding; MoS's K vocabulary projections). Multi-token prediction modules
    (arch/mtp.py) count once, with their kernels; see `flops_per_token` for how often each
    part runs."""
    model = abstract_model(model_cfg)
    return (_matmul_weights(model_cfg, model)
            + HEADS[model_cfg.head.name].reused_matmul_parameters(model_cfg))


COMPONENTS = ("embedding", "attention", "ffn", "norms", "residual", "head", "mtp")


def component_of(path: tuple[str, ...]) -> str:
    """The component a parameter belongs to, from its path in the model:

      embedding  the token table and learned position table (`embed`, `position`)
      attention  everything inside a block's `attention` module (MLA's latent norms included)
      ffn        everything inside a block's `ffn` module (MoE router and experts included)
      norms      the sublayer norms of the plain sums (`*_residual/norm`) and `final_norm`
      residual   the rest of the residual mechanism (`*_residual/...` and the model-level
                 `residual_stream`: depth-attention queries, stream gates and their norms) and
                 the branch scales (`*_branch`: LayerScale's γ)
      head       the output head (an untied projection, MoS/MoC mixtures, an output bias)
      mtp        the multi-token prediction modules (`mtp`, arch/mtp.py: norms, projections and
                 blocks), counted apart because they serve training only
    """
    keys = [str(key) for key in path]
    if keys[:1] == ["mtp"]:
        return "mtp"
    for key in keys:
        if key in ("embed", "position"):
            return "embedding"
        if key in ("attention", "ffn", "head"):
            return key
        if key == "final_norm":
            return "norms"
        if key.endswith("_branch"):  # branch scaling (arch/branch_scale.py)
            return "residual"
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
    untied.head.name, untied.fixnorm = "untied", False
    tied = ml_collections.ConfigDict(untied.to_dict())
    tied.head.name = "tied"
    return {"total": total, "active": active_parameter_count(model_cfg), **counts,
            "vocabulary": vocabulary, "non_embedding": total - vocabulary,
            "tying_savings": parameter_count(untied) - parameter_count(tied)}


def kv_cache_bytes_per_token(model_cfg, dtype: str | None = None) -> int:
    """Bytes the KV cache holds per token, over the layers whose cache grows with the sequence
    (`config.derived.layer_attentions`; not the `recurrent_decoding` mixers of
    `config.catalogue`): each token mixer's `cache_bytes` of one position (MHA/GQA/MQA: keys
    and values, 2·h_kv·p; MLA: the latent and the decoupled rotary key, d_c + d_r) at the
    itemsize of `dtype` (default the compute dtype `model.dtype`). Per sequence: × the
    positions it holds, its length, or with a sliding window W at most W (`cache_positions`).
    Gated DeltaNet layers add nothing per token: their constant state is
    `recurrent_state_bytes`. Looped depth (`model.loop_count` = R) keeps one
    cache per loop and layer: × R."""
    total = sum(ATTENTION[name].cache_bytes(model_cfg, dtype or model_cfg.dtype)
                for name in layer_attentions(model_cfg)
                if not has("attention", name, RECURRENT_DECODING))
    return model_cfg.get("loop_count", 1) * total


def recurrent_state_bytes(model_cfg, dtype: str | None = None) -> int:
    """Bytes per sequence of the constant-size caches (Gated DeltaNet: the state S, H×V×K in
    float32, and the convolutions' last W − 1 inputs, (W − 1)·H·(2K + V) at `dtype`, default
    `model.dtype`), over the layers that keep one (× `model.loop_count`); the same at any
    sequence length."""
    total = sum(ATTENTION[name].cache_bytes(model_cfg, dtype or model_cfg.dtype)
                for name in layer_attentions(model_cfg)
                if has("attention", name, RECURRENT_DECODING))
    return model_cfg.get("loop_count", 1) * total


def cache_positions(model_cfg, seq_len: int) -> int:
    """Positions a KV cache holds for a sequence of `seq_len`: seq_len, or min(seq_len, W) with
    `attention.window` W > 0 (a ring buffer, `arch.attention.write_cache`; its W int32 slot
    positions per layer are not counted)."""
    return cache_slots(model_cfg, seq_len)


def flops_per_token(model_cfg, seq_len: int, training: bool = True,
                    depth_mixing: bool = True) -> float:
    """Matmul FLOPs per token: 2 per matmul weight, plus each layer's token mixing
    (`score_flops_per_token` of its attention class: causal attention counted honestly, position
    t attends to t + 1 keys, not T; Gated DeltaNet's chunked form, O(1) in T), plus, with
    `depth_mixing`, the residual mechanism's own mixing over depth
    (`ResidualMechanism.mixing_flops_per_token`: AttnRes's depth reads; 0 for the plain sums).
    Training (forward + backward) is 3× forward. Multi-token prediction (`model.head.mtp_depth`
    = k, arch/mtp.py) adds, in training only, its modules' weights and, per module, one more
    head application and one block's attention scores. Looped depth (`model.loop_count` = R)
    runs the block stack, its weights and its token mixing, R times (the parameters stay).
    """
    mixing = sum(ATTENTION[attention].score_flops_per_token(model_cfg, seq_len)
                 for attention in layer_attentions(model_cfg))
    model = abstract_model(model_cfg)
    mtp = _matmul_weights(model_cfg, model, lambda path: path[0] == "mtp")
    blocks = _matmul_weights(model_cfg, model, lambda path: path[0] == "blocks")
    loops = model_cfg.get("loop_count", 1)
    if depth_mixing:
        mixing += RESIDUALS[model_cfg.residual.name].mixing_flops_per_token(model_cfg)
    forward = (2 * (matmul_parameter_count(model_cfg) - mtp + (loops - 1) * blocks)
               + loops * mixing)
    depth = model_cfg.head.get("mtp_depth", 0)
    if training and depth:
        attention = ATTENTION[model_cfg.attention.name].score_flops_per_token(model_cfg, seq_len)
        head = (_matmul_weights(model_cfg, model, lambda path: path[0] == "head")
                + HEADS[model_cfg.head.name].reused_matmul_parameters(model_cfg))
        forward += 2 * mtp + depth * (2 * head + attention)
    return float(3 * forward if training else forward)


# Residual-stream mechanisms: each declares its own books (`arch.residual.ResidualMechanism`) -----

def _mechanism(model_cfg, what: str):
    """The registered class of `model.residual`; ValueError naming the mechanisms that model
    `what` (a `ResidualMechanism` hook) when it is not registered."""
    name = model_cfg.residual.name
    if name not in RESIDUALS:
        base = getattr(ResidualMechanism, what).__func__
        modelled = [key for key, mechanism in RESIDUALS.items()
                    if getattr(mechanism, what).__func__ is not base]
        label = {"residual_io": "residual I/O"}.get(what, what.replace("_", " "))
        raise ValueError(f"no {label} model for {name!r}; modelled: {', '.join(modelled)}")
    return RESIDUALS[name]


def residual_io(model_cfg) -> ResidualIO:
    """Closed-form residual I/O of `model.residual` per token per sublayer (worst case over the
    network's sublayers), in units of d elements, itemized: the mechanism's
    `ResidualMechanism.residual_io` (each gives its formula; e.g. 3 for the plain sums). Per-token
    scalars (mixing coefficients) are kept apart in `ResidualIO.scalars`. ValueError for a
    mechanism without an I/O model."""
    return _mechanism(model_cfg, "residual_io").residual_io(model_cfg)


def residual_history(model_cfg) -> int:
    """Residual state kept per token by `model.residual`, in units of d elements (the
    mechanism's `ResidualMechanism.residual_history`: 1 for the plain sums, the sources of a
    depth-attention history, the n streams of a multi-stream state)."""
    return _mechanism(model_cfg, "residual_history").residual_history(model_cfg)


def residual_state_elements_per_token(model_cfg) -> int:
    """Measured: elements per token of the residual state the layer scan carries (the pytree
    `stream.begin` returns), by `jax.eval_shape` at one and at two positions (so counters and
    other per-sequence leaves cancel)."""
    frozen = ml_collections.FrozenConfigDict(model_cfg)

    def begin(x_BxTxD):
        stream = RESIDUALS[frozen.residual.name].stream(frozen, rngs=nnx.Rngs(0))
        return stream.begin(x_BxTxD)

    def size(positions: int) -> int:
        x = jax.ShapeDtypeStruct((1, positions, frozen.d_model), jnp.dtype(frozen.dtype))
        return _size(jax.eval_shape(begin, x))

    return size(2) - size(1)


def added_parameters(model_cfg) -> int:
    """Parameters the residual mechanism adds: those of the per-sublayer mechanism modules
    (`*_residual`) and of the model-level `residual_stream`, minus one `model.norm` per sublayer
    (the plain Pre-Norm sum's, so the plain sums are the zero point)."""
    model = abstract_model(model_cfg)
    residual = _size(nnx.state(model, lambda path, _: any(
        str(key).endswith("_residual") or key == "residual_stream" for key in path)))
    frozen = ml_collections.FrozenConfigDict(model_cfg)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        norm = nnx.eval_shape(lambda: make_norm(frozen, rngs=nnx.Rngs(0)))
    return residual - sublayer_count(model_cfg) * _size(nnx.state(norm, nnx.Param))


def residual_accounting(model_cfg) -> dict:
    """The books of `model.residual` for a resolved model config, per token:

      io_per_token_per_sublayer           residual I/O, units of d (`residual_io`, worst case)
      io_elements_per_token_per_sublayer  the same in elements (× d_model), scalars excluded
      io_scalars_per_token_per_sublayer   the small per-token coefficients, elements
      io_bytes_per_token_per_sublayer     stored-state traffic at the mechanism's
                                          `state_itemsize` (e.g. an FP8 state with its scales)
                                          and the rest at `model.dtype`'s itemsize
      history_elements_per_token          residual state kept (`residual_history` × d)
      state_elements_per_token            measured: what the stream's `begin` carries per token
                                          (≥ the history: e.g. cached 1/rms per depth source,
                                          FP8 branch scales)
      added_parameters                    `added_parameters` (the plain sums are the zero point)
      sublayers                           L
    """
    mechanism = _mechanism(model_cfg, "residual_io")
    io = mechanism.residual_io(model_cfg)
    d = model_cfg.d_model
    compute_bytes = jnp.dtype(model_cfg.dtype).itemsize
    state_bytes = mechanism.state_itemsize(model_cfg)
    return {
        "io_per_token_per_sublayer": float(io.total),
        "io_elements_per_token_per_sublayer": float(io.total * d),
        "io_scalars_per_token_per_sublayer": float(io.scalars),
        "io_bytes_per_token_per_sublayer": float(
            d * (io.state_total() * state_bytes + (io.total - io.state_total()) * compute_bytes)),
        "history_elements_per_token": mechanism.residual_history(model_cfg) * d,
        "state_elements_per_token": residual_state_elements_per_token(model_cfg),
        "added_parameters": added_parameters(model_cfg),
        "sublayers": sublayer_count(model_cfg),
    }


def books(model_cfg, seq_len: int, sequence_shards: int = 1) -> dict:
    """Every accounting figure of a resolved model config at `seq_len` (capped at the model's
    max_seq_len), as a nested dict: parameters (`parameter_breakdown`), flops per token for
    training and inference, KV-cache bytes per token and per sequence (the per-token cache × the
    length, plus Gated DeltaNet layers' constant recurrent state, itemized), and the residual
    mechanism's I/O, history and added parameters, with the history's bytes per sequence
    (history elements × seq_len at the mechanism's `state_itemsize`: e.g. a prefill's AttnRes
    sources, (N + 1)·T·d) and per device when `sequence_shards` devices split the sequence."""
    seq_len = min(seq_len, model_cfg.max_seq_len or seq_len)
    kv_per_token = kv_cache_bytes_per_token(model_cfg)
    state_bytes = recurrent_state_bytes(model_cfg)
    residual = residual_accounting(model_cfg)
    history_bytes = (residual["history_elements_per_token"] * seq_len
                     * _mechanism(model_cfg, "state_itemsize").state_itemsize(model_cfg))
    return {
        "parameters": parameter_breakdown(model_cfg),
        "flops": {"seq_len": seq_len,
                  "training_per_token": flops_per_token(model_cfg, seq_len, True),
                  "inference_per_token": flops_per_token(model_cfg, seq_len, False)},
        "kv_cache": {"dtype": model_cfg.dtype, "bytes_per_token": kv_per_token,
                     "positions_held": cache_positions(model_cfg, seq_len),
                     "recurrent_state_bytes_per_sequence": state_bytes,
                     "bytes_per_sequence": kv_per_token * cache_positions(model_cfg, seq_len)
                     + state_bytes},
        "residual": {"mechanism": model_cfg.residual.name,
                     "io_per_token_per_sublayer_d": residual["io_per_token_per_sublayer"],
                     "history_elements_per_token": residual["history_elements_per_token"],
                     "history_bytes_per_sequence": history_bytes,
                     "history_bytes_per_device": history_bytes / sequence_shards,
                     "added_parameters": residual["added_parameters"]},
    }
