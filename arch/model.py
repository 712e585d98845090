"""The decoder-only Transformer LM, assembled from the component registries.

    x⁰ = position.embed(E[tokens]);  state = residual_stream.begin(x⁰)
    for each of L blocks (run under one `jax.lax.scan` over stacked parameters):
        state = attention sublayer, then FFN sublayer, each through the residual mechanism
    logits = head(final_norm(residual_stream.end(state)))

Layer parameters are stacked along a leading `layers` axis at construction (one entry per block,
or per `BlockGroup` of k blocks when MoE is interleaved), and the forward pass scans over them, so
compile time does not grow with depth. Non-parameter layer state (BatchNorm
running statistics) comes out of the scan and is written back into the module.
Looped depth (`model.loop_count` = R > 1, `_loop`) runs the scan R times with the same parameters,
inside one outer scan. Multi-token prediction modules (`model.head.mtp_depth`, arch/mtp.py) run
only in the training loss (`multi_token_logits`); the forward pass and `decode` ignore them.
Under a mesh whose `stage` axis is larger than 1, training and evaluation run the stack as a
pipeline instead (`sharding/pipeline.py`, GPipe or circular over microbatches); KV-cache decoding
keeps the ordinary scan (GSPMD moves the stage-sharded layer parameters).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from arch.attention import ATTENTION
from arch.branch_scale import BranchScale
from arch.dropout import Dropout
from arch.dropout import active as dropout_active
from arch.ffn import FFNS
from arch.heads import HEADS
from arch.init import group_init
from arch.layers import Embedding
from arch.moe import AuxLoss, DroppedFraction
from arch.mtp import MultiTokenModule, prenorm_config
from arch.norms import make_norm
from arch.positions import POSITIONS
from arch.remat import ATTENTION_OUTPUT, FFN_OUTPUT, apply_remat
from arch.residual import RESIDUALS, constrain_state, is_capturing
from arch.reversible import run_reversible
from config.defaults import execution_config
from config.derived import blocks_per_unit, interleaves_moe, layer_attentions
from sharding import pipeline
from sharding.rules import STREAM, constrain


class Block(nnx.Module):
    """One Transformer block: an attention and an FFN sublayer (unless `model.use_ffn=False`),
    each wrapped by its own instance of the residual mechanism. `attention` / `ffn` name the
    token mixer / FFN when they differ from the config's (layer patterns, MoE interleaving)."""

    def __init__(self, cfg, *, execution=None, ffn: str | None = None,
                 attention: str | None = None, rngs: nnx.Rngs):
        self.attention = ATTENTION[attention or cfg.attention.name](cfg, execution=execution,
                                                                    rngs=rngs)
        self.attention_residual = RESIDUALS[cfg.residual.name].build(
            cfg, execution=execution, rngs=rngs)
        if cfg.use_ffn:  # False: a pure-attention stack (rank-collapse ablation)
            self.ffn = FFNS[ffn or cfg.ffn.name](cfg, rngs=rngs)
            self.ffn_residual = RESIDUALS[cfg.residual.name].build(
                cfg, execution=execution, rngs=rngs)
        self.use_ffn = cfg.use_ffn
        self.scales_branches = cfg.branch_scale.name != "none"
        if self.scales_branches:  # arch/branch_scale.py: γ ⊙ F or c·F before the write
            self.attention_branch = BranchScale(cfg, rngs=rngs)
            if cfg.use_ffn:
                self.ffn_branch = BranchScale(cfg, rngs=rngs)

    def __call__(self, stream, positions_BxT, rotate, cache=None,
                 dropout: Dropout | None = None):
        stream, cache = self.sublayer("attention", stream, positions_BxT, rotate, cache,
                                      dropout=dropout)
        if self.use_ffn:
            stream, _ = self.sublayer("ffn", stream, positions_BxT, rotate, dropout=dropout)
        return stream, cache

    def sublayer(self, name: str, stream, positions_BxT, rotate, cache=None,
                 tap: Callable[[jax.Array], jax.Array] | None = None,
                 dropout: Dropout | None = None):
        """One sublayer ("attention" or "ffn") through its residual mechanism:
        h = read(state), u = F(h), state = write(state, u), then the state is sharded (between
        the tensor-parallel regions). `tap(u) -> u'`: the capture point of the instruments (the
        probes record u there and add their perturbation; None in training). `dropout`: the
        block's (arch/dropout.py), active inside F (attention probabilities, FFN hidden) and
        applied to u before the write; None: none. Returns (state, KV cache)."""
        residual = getattr(self, f"{name}_residual")
        h, read = residual.read_with_context(stream)
        dropout = None if dropout is None else dropout.sublayer(name)
        with dropout_active(dropout):
            if name == "attention":
                update, cache = self.attention(h, positions_BxT, rotate, cache)
            else:
                update = self.ffn(h)
        if dropout is not None:
            update = dropout.output(update, name)
        # What `execution.remat` save_attention_and_ffn_outputs / offload keep (arch/remat.py).
        update = checkpoint_name(update, ATTENTION_OUTPUT if name == "attention" else FFN_OUTPUT)
        if self.scales_branches:
            update = getattr(self, f"{name}_branch")(update)
        if tap is not None:
            update = tap(update)
        return constrain_state(residual.write(stream, update, read)), cache


class BlockGroup(nnx.Module):
    """k blocks run as one step of the layer scan (k = `config.derived.blocks_per_unit`), so the
    scan compiles once per group, not per layer:

    - Dense/MoE interleaving, one MoE block every `model.moe.every` blocks (GShard, Lepikhin et
      al. 2020 §3.1 and Switch Transformer, Fedus et al. 2022, use every = 2): the other blocks
      use the dense `model.moe.dense_ffn`.
    - A hybrid `model.layer_pattern` (e.g. "LLLA": three Gated DeltaNet blocks, then one
      softmax-attention block, as in Qwen3-Next and Kimi Linear): block j's token mixer is the
      pattern's letter j.

    Both together: k is the least common multiple of the two periods. Its caches are stacked k per
    group when its blocks share one attention kind, else a tuple with one cache per block."""

    def __init__(self, cfg, *, execution=None, rngs: nnx.Rngs):
        self.size = blocks_per_unit(cfg)
        attentions, every = layer_attentions(cfg), cfg.moe.every if interleaves_moe(cfg) else 0
        for j in range(self.size):  # attributes block_0 … block_{k-1}
            ffn = None if not every else "moe" if (j + 1) % every == 0 else cfg.moe.dense_ffn
            setattr(self, f"block_{j}", Block(cfg, execution=execution, ffn=ffn,
                                              attention=attentions[j], rngs=rngs))

    def __call__(self, stream, positions_BxT, rotate, cache=None,
                 dropout: Dropout | None = None):
        caches, per_block = [], isinstance(cache, tuple)
        for j in range(self.size):
            block = getattr(self, f"block_{j}")
            layer_cache = (None if cache is None else cache[j] if per_block
                           else jax.tree.map(lambda c, j=j: c[j], cache))
            stream, layer_cache = block(stream, positions_BxT, rotate, layer_cache,
                                        dropout=None if dropout is None else dropout.at(j))
            caches.append(layer_cache)
        if cache is None or per_block:
            return stream, None if cache is None else tuple(caches)
        return stream, jax.tree.map(lambda *c: jnp.stack(c), *caches)


class TransformerLM(nnx.Module):
    """Decoder-only causal LM. `model(tokens_BxT) -> logits_BxTxV` (float32).

    `model(tokens_BxT, positions_BxT)` runs tokens given in any order with their positions (the
    causal mask and every position scheme read the positions, never the array index); the
    train step passes the striped order of sequence parallelism (`sharding/sequence.py`).

    `decode(tokens_BxT, positions_BxT, cache)` runs the same network on a block of positions
    against a KV cache from `init_cache`, for generation.

    `cfg` is the `model` section (what is computed); `execution` the `execution` section (how:
    attention kernel, remat policy, scan unroll, pipeline schedule), `execution_config()` if None.
    """

    def __init__(self, cfg, *, execution=None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.execution = ml_collections.FrozenConfigDict(execution or execution_config())
        self.embed = Embedding(cfg.vocab_size, cfg.d_model, rngs=rngs, dtype=jnp.dtype(cfg.dtype),
                               fixnorm=cfg.fixnorm, fixnorm_scale=cfg.fixnorm_scale,
                               init=group_init(cfg, "embedding")(cfg.d_model, cfg.vocab_size))
        self.position = POSITIONS[cfg.position.name](cfg, rngs=rngs)

        size = blocks_per_unit(cfg)
        self.stack_shape = (cfg.num_layers // size, size) if size > 1 else (cfg.num_layers,)
        unit = (BlockGroup if size > 1
                else functools.partial(Block, attention=layer_attentions(cfg)[0]))

        @nnx.split_rngs(splits=self.stack_shape[0])
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs):
            return unit(cfg, execution=self.execution, rngs=rngs)

        self.blocks = stacked_blocks(rngs)
        self.residual_stream = RESIDUALS[cfg.residual.name].stream(
            cfg, execution=self.execution, rngs=rngs)
        self.final_norm = make_norm(cfg, rngs=rngs) if cfg.norm.final else None
        self.head = HEADS[cfg.head.name](cfg, rngs=rngs)
        if cfg.head.get("mtp_depth", 0):  # multi-token prediction modules (arch/mtp.py)
            self.mtp = nnx.List([
                MultiTokenModule(cfg, Block(prenorm_config(cfg), execution=self.execution,
                                            rngs=rngs), rngs=rngs)
                for _ in range(cfg.head.mtp_depth)])

    def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None, *,
                 dropout_key: jax.Array | None = None) -> jax.Array:
        """Logits; `dropout_key` (a typed key, e.g. `arch.dropout.train_key(seed, step)`) turns
        on the `model.dropout` sites (training); None, or all rates 0: deterministic."""
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
        logits, _ = self._forward(tokens_BxT, positions_BxT, None,
                                  Dropout.for_model(self.cfg, dropout_key))
        return logits

    def decode(self, tokens_BxT, positions_BxT, cache):
        return self._forward(tokens_BxT, positions_BxT, cache)

    def multi_token_logits(self, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                           future_tokens_KxBxT: jax.Array, *,
                           dropout_key: jax.Array | None = None) -> list[jax.Array]:
        """The training forward pass with multi-token prediction (arch/mtp.py): [the next-token
        logits, then those of MTP modules 1 … k], each B×T×V float32. `future_tokens_KxBxT[j−1]`
        holds t_{i+j} at the array index of t_i (any token where none exists: causal attention
        keeps it out of every earlier position). `dropout_key`: the trunk's dropout (the MTP
        modules run without it)."""
        hidden_BxTxD, _ = self._hidden(tokens_BxT, positions_BxT, None,
                                       Dropout.for_model(self.cfg, dropout_key))
        logits = [self.logits_of_hidden(hidden_BxTxD)]
        for module, future_BxT in zip(self.mtp, future_tokens_KxBxT, strict=True):
            hidden_BxTxD = module(hidden_BxTxD, self.embed(future_BxT), positions_BxT,
                                  self.position.rotate)
            logits.append(self.logits_of_hidden(hidden_BxTxD))
        return logits

    def init_cache(self, batch: int, length: int, dtype=jnp.float32) -> dict | tuple:
        """Zeroed KV cache for `length` positions, stacked over layers (groups × k when the scan
        runs `BlockGroup`s), and with looped depth (`model.loop_count` = R > 1) over loops first:
        one cache per (loop, layer). Each layer's is its token mixer's `TokenMixer.init_cache`:
        in `dtype` but for the mixer's `float32_cache` entries (Gated DeltaNet's recurrent
        state); with `attention.window` W > 0 a softmax attention's holds min(length, W) slots, a
        ring buffer, and their positions. A group whose blocks differ in attention
        (`model.layer_pattern`) gets a tuple of k caches, each stacked over (loops,) groups."""
        attentions = layer_attentions(self.cfg)[:blocks_per_unit(self.cfg)]
        loops = self.cfg.get("loop_count", 1)
        loop = (loops,) if loops > 1 else ()

        def zeros(attention: str, stack: tuple[int, ...]) -> dict:
            return ATTENTION[attention].init_cache(self.cfg, batch, length, dtype, stack)

        if len(set(attentions)) == 1:
            return zeros(attentions[0], loop + self.stack_shape)
        return tuple(zeros(attention, loop + self.stack_shape[:1]) for attention in attentions)

    def loop_hidden_states(self, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None
                           ) -> jax.Array:
        """What the final norm would read after each pass of the layer stack (looped depth,
        `model.loop_count` = R), R×B×T×D; the last entry is what it does read. For the
        early-exit probe (`train.instruments.early_exit`)."""
        if positions_BxT is None:
            positions_BxT = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
        hidden_RxBxTxD, _ = self._hidden(tokens_BxT, positions_BxT, None, loop_exits=True)
        return hidden_RxBxTxD

    def _forward(self, tokens_BxT, positions_BxT, cache, dropout: Dropout | None = None):
        hidden_BxTxD, cache = self._hidden(tokens_BxT, positions_BxT, cache, dropout)
        return self.logits_of_hidden(hidden_BxTxD), cache

    def _hidden(self, tokens_BxT, positions_BxT, cache, dropout: Dropout | None = None,
                loop_exits: bool = False):
        """The stack's output (what the final norm reads), B×T×D, and the updated KV cache.
        `dropout`: the training dropout (arch/dropout.py), None: none. `loop_exits`: that output
        after each pass of a looped stack instead, R×B×T×D."""
        x_BxTxD = self.position.embed(self.embed(tokens_BxT), positions_BxT)
        if dropout is not None:  # arch/dropout.py; keys of unit l: dropout.layer_keys
            x_BxTxD = dropout.embedding(x_BxTxD)
        graphdef, layer_params, layer_states = nnx.split(self.blocks, nnx.Param, ...)
        loops = self.cfg.get("loop_count", 1)
        if (loops > 1 or loop_exits) and (self.cfg.reversible or pipeline.stage_count() > 1):
            raise ValueError(f"model.loop_count={loops}: looped depth runs neither reversible "
                             "blocks nor the pipeline (mesh.stage > 1)")
        if self.cfg.reversible:  # arch/reversible.py: two coupled streams
            x_BxTxD, cache = run_reversible(graphdef, layer_params, layer_states, x_BxTxD,
                                            positions_BxT, self.position.rotate, cache,
                                            dropout=dropout)
            return x_BxTxD, cache
        x_BxTxD = constrain(x_BxTxD, STREAM)
        stages = pipeline.stage_count()
        if stages > 1 and dropout is not None:
            raise ValueError(f"model.dropout does not run in the pipeline (mesh.stage={stages}): "
                             "set its rates to 0 or mesh.stage=1")
        if stages > 1 and cache is None:  # training and evaluation: pipelined over `stage`
            return self._pipelined(x_BxTxD, positions_BxT, graphdef, layer_params,
                                   layer_states, stages), None
        stream = constrain_state(self.residual_stream.begin(x_BxTxD))
        if loops > 1 or loop_exits:
            hidden, layer_states, cache = self._loop(stream, x_BxTxD, positions_BxT, graphdef,
                                                     layer_params, layer_states, cache, loops,
                                                     loop_exits, dropout)
            nnx.update(self.blocks, layer_states)
            return hidden, cache
        stream, (layer_states, cache) = self._scan(stream, positions_BxT, graphdef, layer_params,
                                                   layer_states, cache, dropout)
        nnx.update(self.blocks, layer_states)  # e.g. BatchNorm running statistics
        return self.residual_stream.end(stream), cache

    def _loop(self, stream, x_BxTxD, positions_BxT, graphdef, layer_params, layer_states, cache,
              loops: int, exits: bool = False, dropout: Dropout | None = None):
        """Looped depth (Dehghani et al. 2019, "Universal Transformers"; Geiping et al. 2025,
        "Scaling up Test-Time Compute with Latent Reasoning: A Recurrent Depth Approach"): the
        layer stack applied R = `model.loop_count` times with the same parameters,

            x ← stack(x)  for r = 1;   x ← stack(x + x⁰ if `model.loop_inject` else x)  for r > 1,

        as one outer `jax.lax.scan` over the R passes around the layer scan (`_scan`), so the
        stack compiles once. The KV cache holds one entry per (loop, layer) (`init_cache`).
        Non-parameter layer state threads through the passes (BatchNorm running statistics are
        updated once per pass); the MoE auxiliary losses are summed over the passes (each pass
        is L more MoE layers) and the dropped fraction averaged; dropout folds the pass index
        into its keys, so each pass draws its own masks. Returns (what the final norm
        reads, B×T×D, or with `exits` what it would read after each pass, R×B×T×D; the layer
        state; the cache). Cost: R× the stack's FLOPs and KV cache, the same parameters."""
        inject = self.cfg.get("loop_inject", False)

        def one_pass(carry, loop):
            stream, layer_states = carry
            index, loop_cache = loop
            if inject:
                stream = jnp.where(index > 0, stream + x_BxTxD, stream)
            stream, (layer_states, loop_cache) = self._scan(
                stream, positions_BxT, graphdef, layer_params, layer_states, loop_cache,
                None if dropout is None else dropout.at(index))
            exit_BxTxD = self.residual_stream.end(stream) if exits else None
            return (stream, layer_states), (exit_BxTxD, layer_states, loop_cache)

        (stream, _), (exits_RxBxTxD, states_R, cache) = jax.lax.scan(
            one_pass, (stream, layer_states), (jnp.arange(loops), cache))
        losses, dropped, rest = nnx.split_state(states_R, AuxLoss, DroppedFraction, ...)
        layer_states = nnx.merge_state(jax.tree.map(lambda x: x.sum(0), losses),
                                       jax.tree.map(lambda x: x.mean(0), dropped),
                                       jax.tree.map(lambda x: x[-1], rest))
        return (exits_RxBxTxD if exits else self.residual_stream.end(stream)), layer_states, cache

    def _scan(self, stream, positions_BxT, graphdef, layer_params, layer_states, cache,
              dropout: Dropout | None = None):
        """The layer stack as one scan over units (blocks, or MoE block groups),
        `execution.scan_unroll` units per loop iteration, or, for a mechanism that runs a group of
        units at a time (`ResidualStream.units_per_block`), scanned by the mechanism
        (`scan`). With `dropout`, each unit's key data rides along as a scanned input, so any
        recomputation of a unit replays its masks. Returns the final state and the per-unit
        (non-parameter state, KV cache), stacked over units."""
        units, stream_module = self.stack_shape[0], self.residual_stream
        group = stream_module.units_per_block(units)

        def run_unit(stream, layer):
            params, states, layer_cache, *key_data = layer
            block = nnx.merge(graphdef, params, states)
            unit_dropout = dropout.from_key_data(key_data[0]) if key_data else None
            stream, layer_cache = block(stream, positions_BxT, self.position.rotate, layer_cache,
                                        dropout=unit_dropout)
            return stream, (nnx.state(block, nnx.Not(nnx.Param)), layer_cache)

        run_unit = apply_remat(run_unit, self.execution.remat)  # arch/remat.py
        scan = (stream_module.scan if group
                else functools.partial(jax.lax.scan, unroll=self.execution.scan_unroll))
        layers = (layer_params, layer_states, cache)
        if dropout is not None:
            layers = (*layers, dropout.layer_keys(units))
        return scan(run_unit, stream, layers)

    def _pipelined(self, x_BxTxD, positions_BxT, graphdef, layer_params, layer_states,
                   stages: int):
        """The layer stack as a pipeline over the mesh's `stage` axis (`sharding/pipeline.py`):
        the batch split into `execution.pipeline.microbatches` microbatches, each with its own
        residual state (`begin`/`end` per microbatch), carried with its positions from stage to
        stage. Returns the stack's output, B×T×D."""
        cfg, schedule = self.cfg, self.execution.pipeline
        if is_capturing(self):
            raise ValueError("nnx.capture is not supported under pipeline parallelism "
                             f"(mesh.stage={stages}); capture on a mesh with stage=1")
        microbatches = schedule.microbatches
        if x_BxTxD.shape[0] % microbatches:
            raise ValueError(f"batch {x_BxTxD.shape[0]} is invalid: execution.pipeline.microbatches"
                             f"={microbatches} must divide it")
        begin = lambda x: constrain_state(self.residual_stream.begin(x))
        states_M = jax.vmap(begin)(pipeline.to_microbatches(x_BxTxD, microbatches))
        positions_M = pipeline.to_microbatches(positions_BxT, microbatches)

        def run_block(carry, layer):
            stream, positions = carry
            block = nnx.merge(graphdef, *layer)
            stream, _ = block(stream, positions, self.position.rotate)
            return (stream, positions), nnx.state(block, nnx.Not(nnx.Param))

        run_block = apply_remat(run_block, self.execution.remat)
        # What crosses a stage boundary: the residual state (positions are in every stage's copy
        # of the microbatch), or what the next stage lacks (`ResidualStream.stage_message`: for a
        # mechanism with a history, the part written since that stage last held it).
        residual_stream = self.residual_stream
        if schedule.transfer == "cached":
            sublayers = cfg.num_layers * (2 if cfg.use_ffn else 1)
            lag = (stages - 1) * sublayers // (stages * schedule.virtual_stages)
            send = lambda state: residual_stream.stage_message(state, lag)
            rebuild = lambda cached, message: residual_stream.stage_merge(
                cached, message, lag)
        else:
            send, rebuild = (lambda state: state), (lambda cached, message: message)
        (states_M, _), layer_states = pipeline.pipeline(
            run_block, (states_M, positions_M), layer_params, layer_states, stages=stages,
            virtual_stages=schedule.virtual_stages, message=lambda carry: send(carry[0]),
            merge=lambda cached, message: (rebuild(cached[0], message), cached[1]))
        nnx.update(self.blocks, layer_states)  # MoE auxiliary losses: mean over microbatches
        return pipeline.from_microbatches(jax.vmap(self.residual_stream.end)(states_M))

    def logits_of_hidden(self, x_BxTxD):
        """Float32 logits of the stack's output (or of any hidden state B×T×D: the probes' early
        exits): the final norm (if any), then the head."""
        if self.final_norm is not None:
            x_BxTxD = self.final_norm(x_BxTxD)
        logits = self.head(x_BxTxD, self.embed)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab")).astype(jnp.float32)
