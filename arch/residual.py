"""Residual-stream mechanisms: the protocol every mechanism implements, and the plain sums.
Registry: `RESIDUALS[name](cfg, rngs=...)`, one instance per sublayer.

A mechanism is two classes. `ResidualMechanism`, one instance per sublayer (stacked over layers
with the blocks), owns how a sublayer reads the residual state and how it writes back; its
`stream(cfg, rngs=...)` builds the model-level `ResidualStream` (once per model, parameters not
stacked), which starts the state from the embedding and gives what the final norm reads:

    state = stream.begin(x_BxTxD)
    for each sublayer F:   h, read = mechanism.read_with_context(state)
                           state = mechanism.write(state, F(h), read)
    x_BxTxD = stream.end(state)

`read_with_context` returns the sublayer input and whatever `write` needs from the read (None by
default; `write(state, update)` recomputes it when called alone). The plain sum's state is
x_BxTxD itself. Richer mechanisms (several streams, a history of depth sources) carry a pytree
through the same calls; by convention its leaves are x_BxTxD-shaped, stacked n×B×T×D, or small
(counters, per-depth parameters), and `constrain_state` shards them.

Everything else the framework asks of a mechanism is a hook with a documented default, so that
accounting, probes, pruning, the pipeline and the optimizer name no mechanism:

    config       its record in `config.catalogue` (module, capabilities such as
                 `single_stream`); its options a section of the schema, `config/defaults.py`,
                 and their rules the function its record names (all JAX-free, so a bad value
                 fails before JAX loads); a mechanism without options declares neither
    accounting   `residual_io(cfg)`, `residual_history(cfg)` (default: not modelled, ValueError),
                 `state_itemsize(cfg)` (default: the compute dtype's); added parameters are
                 measured from the built model, with one `model.norm` per sublayer as zero point
    probes       its record's `single_stream` capability (the state is the hidden state x
                 itself, B×T×D: the probes perturb and read it directly, gradient ∂loss/∂x_i;
                 without it the state is a pytree, read through `ResidualStream.hidden_state`,
                 gradients w.r.t. the written updates), `probe_norm(state)` for a normalization
                 that is not a `norm` submodule (default None)
    pruning      `check_prunable(cfg, kept, drop)` (default: any blocks), `prune(cfg, state, kept)`
                 (default: nothing to adjust)
    pipeline     `ResidualStream.stage_message` / `stage_merge` (default: the whole state)
    layer scan   `ResidualStream.units_per_block` / `scan` (default: the model's own scan)
    execution    `build(cfg, execution=, rngs=)` and `stream(cfg, execution=, rngs=)` receive the
                 `execution` section, for a mechanism with a kernel to choose (default: unused)
    optimizer    mixing weights are `MixingParam`s, kept out of weight decay unless
                 `optimizer.decay_mixing`
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from arch.norms import make_norm
from arch.registry import Registry
from sharding.rules import STREAM, constrain

RESIDUALS = Registry("residual")


def constrain_state(state):
    """Shard every activation leaf of a residual state: x_BxTxD like the stream, n×B×T×D with the
    leading (stream or depth-source) axis replicated; other leaves are left alone."""
    def leaf(x):
        if x.ndim == 3:
            return constrain(x, STREAM)
        if x.ndim == 4:
            return constrain(x, (None, *STREAM))
        return x
    return jax.tree.map(leaf, state)


def is_capturing(module: nnx.Module) -> bool:
    """Whether `module` runs under `nnx.capture`. Flax 0.12 has no public query: `nnx.capture`
    marks every module of the captured graph with `__captures__`, which `Module.sow` reads too;
    this is the one place the zoo reads that marker (for `record`, and for the mechanisms whose
    fast paths cannot record: they take their recording path when it is True)."""
    return hasattr(module, "__captures__")


def record(module: nnx.Module, name: str, value, kind: type[nnx.Variable] = nnx.Intermediate,
           ) -> None:
    """Expose a quantity (depth weights, read gates, write strengths) to a caller that runs the
    model under `nnx.capture(model, kind)`; nothing is stored otherwise, so training state never
    changes. Capture matches the exact type: a subclass `kind` (e.g. the attention probabilities'
    `arch.attention.AttentionWeights`) is collected only by callers that ask for it. Values sown
    inside the layer scan come out stacked over layers."""
    if is_capturing(module):
        module.sow(kind, name, value)


class PathTerm(nnx.Intermediate):
    """A term of a mechanism's read/write path decomposition (sublayer outputs, normalization
    scales, the embedding): recorded only under `nnx.capture(model, PathTerm)`, so the depth-mixing
    heatmaps (`nnx.Intermediate`) do not plot them (`train.instruments.gr_paths` reads them).
    Capturing both kinds at once, name PathTerm first: `nnx.capture` splits what it collected by
    isinstance, in the order given, and a PathTerm is an `nnx.Intermediate`."""


def sublayers_per_block(cfg) -> int:
    """Residual sublayers per Transformer block: attention and FFN, or attention only."""
    return 2 if cfg.use_ffn else 1


class MixingParam(nnx.Param):
    """A residual mechanism's mixing weight (depth-attention pseudo-queries, stream read, write
    and mixing coefficients, residual scalars): a parameter whose initialization sets the
    starting mechanism, so weight decay would pull it away from it. `train/optim.py` keeps every
    `MixingParam` out of weight decay unless `optimizer.decay_mixing=True`."""


@dataclasses.dataclass(frozen=True)
class ResidualTraffic:
    """One itemized memory access of a residual mechanism, per token per sublayer, in units of d
    elements. `state` marks traffic of a stored residual state kept in a dtype of its own
    (`ResidualMechanism.state_itemsize`); everything else moves `model.dtype`."""

    what: str
    reads: float
    writes: float
    state: bool = False


@dataclasses.dataclass(frozen=True)
class ResidualIO:
    """A mechanism's residual I/O per token per sublayer: the itemized traffic (units of d) and
    the small per-token scalars it also moves (e.g. a per-token n×n mixing matrix: `scalars`
    elements, not multiplied by d and not included in `total`)."""

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


PLAIN_SUM_IO = ResidualIO((ResidualTraffic("read the stream", 1, 0),
                           ResidualTraffic("read the sublayer output", 1, 0),
                           ResidualTraffic("write the stream", 0, 1)))


class ResidualStream(nnx.Module):
    """Model-level part of a residual mechanism (built by `ResidualMechanism.stream`). Defaults:
    the state is the embedding itself (`begin`, `end` the identity), the probes' hidden state is
    `end`, the model scans the layers, and a pipeline stage sends the whole state."""

    def begin(self, x_BxTxD):
        """The residual state before the first sublayer, from the embedding x⁰ (B×T×D)."""
        return x_BxTxD

    def end(self, state):
        """What the final norm reads (B×T×D) from the state after the last sublayer."""
        return state

    def hidden_state(self, state) -> jax.Array:
        """The probes' hidden state h of a state at a block boundary, B×T×D: what the final norm
        would read if the network stopped there. Default `end`."""
        return self.end(state)

    def units_per_block(self, units: int) -> int | None:
        """Scan units (blocks, or MoE block groups) the stream runs together in its own `scan`
        (`scan(body, state, xs) -> (state, ys)`, `jax.lax.scan`'s contract), or None: the model
        scans unit by unit (the default)."""
        return None

    def stage_message(self, state, lag: int):
        """What crosses a pipeline stage boundary when the receiving stage last held this state
        `lag` sublayers ago (`execution.pipeline.transfer="cached"`). Default: the whole state."""
        return state

    def stage_merge(self, cached, message, lag: int):
        """The state from a stage's own older copy and a `stage_message`. Default: the message."""
        return message


class SumStream(ResidualStream):
    """Model-level part of the single-stream mechanisms: the state is the embedding itself, and
    the final norm reads the state. (`begin` and `end` are restated here so that
    `nnx.capture(..., method_outputs=...)`, which instruments a class's own methods only, sees
    them.)"""

    def begin(self, x_BxTxD):
        return x_BxTxD

    def end(self, stream_BxTxD):
        return stream_BxTxD


class ResidualMechanism(nnx.Module):
    """The per-sublayer part of a residual mechanism, and the class that declares everything the
    framework asks of it (module docstring). Subclasses implement `read` and `write`; every
    other method has the default documented on it."""

    def read(self, state) -> jax.Array:
        """The sublayer's input h (B×T×D) from the residual state."""
        raise NotImplementedError(f"{type(self).__name__} implements no read")

    def write(self, state, update_BxTxD: jax.Array, read_context: Any = None):
        """The state after adding the sublayer's output; `read_context` is the second value of
        `read_with_context` on the same state (None: recomputed if needed)."""
        raise NotImplementedError(f"{type(self).__name__} implements no write")

    def read_with_context(self, state) -> tuple[jax.Array, Any]:
        """(h, what `write` needs from this read), as `Block` calls it. Default (`read`, None)."""
        return self.read(state), None

    @classmethod
    def stream(cls, cfg, *, execution=None, rngs: nnx.Rngs) -> ResidualStream:
        """The model-level module (`execution`: the execution section, None: defaults). Default
        `SumStream` (the state is the embedding itself)."""
        return SumStream()

    @classmethod
    def build(cls, cfg, *, execution=None, rngs: nnx.Rngs) -> ResidualMechanism:
        """One sublayer's instance as the model makes it; `execution` (the `execution` section,
        None: defaults) for a mechanism with a kernel to choose. Default `cls(cfg, rngs=rngs)`."""
        return cls(cfg, rngs=rngs)

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """Closed-form residual I/O per token per sublayer (worst case over the sublayers), in
        units of d, itemized. Default: not modelled, ValueError."""
        raise ValueError(f"no residual I/O model for {cfg.residual.name!r}")

    @classmethod
    def residual_history(cls, cfg) -> int:
        """Residual state kept per token, in units of d elements. Default: not modelled,
        ValueError."""
        raise ValueError(f"no residual history model for {cfg.residual.name!r}")

    @classmethod
    def state_itemsize(cls, cfg) -> float:
        """Bytes per element of the stored-state traffic (`ResidualTraffic.state`). Default: the
        compute dtype's itemsize."""
        return float(jnp.dtype(cfg.dtype).itemsize)

    @classmethod
    def mixing_flops_per_token(cls, cfg) -> float:
        """Forward FLOPs per token of the mechanism's own mixing over depth, beyond its matmul
        weights (`arch.accounting.flops_per_token` adds it). Default: 0, the plain sums."""
        return 0.0

    def probe_norm(self, state) -> tuple[nnx.Module, jax.Array] | None:
        """For a mechanism whose read normalizes without a `norm` submodule: (the module whose
        `scale` is the gain, the normalization's input, rows of D) that the probes report as the
        sublayer norm. Default None: the probes tap `self.norm` if there is one, else report
        NaN."""
        return None

    @classmethod
    def check_prunable(cls, cfg, kept: Sequence[int], drop: Sequence[int]) -> None:
        """ValueError (one line) if removing the blocks `drop` (keeping `kept`, network order)
        changes what the kept blocks compute in a way `prune` cannot undo. Default: any."""

    @classmethod
    def prune(cls, cfg, state, kept: Sequence[int]) -> None:
        """Adjust, in place, the model state of a pruned model (`state["blocks"]` already holds
        the kept blocks' rows; `state["residual_stream"]` the model-level parameters) so that
        every kept sublayer reads and writes as before. Default: nothing to adjust."""


@RESIDUALS.register("prenorm")
class PreNormSum(ResidualMechanism):
    """Pre-Norm residual sum (Xiong et al. 2020, "On Layer Normalization in the Transformer
    Architecture", Fig. 1b): x ← x + F(norm(x)).

    The norm is `model.norm`, gain 1 at initialization; the stream itself is never normalized.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.norm = make_norm(cfg, rngs=rngs)

    @classmethod
    def residual_io(cls, cfg) -> ResidualIO:
        """Read the stream (1) and the sublayer output (1), write the stream (1): 3."""
        return PLAIN_SUM_IO

    @classmethod
    def residual_history(cls, cfg) -> int:
        return 1

    def read(self, stream_BxTxD):
        return self.norm(stream_BxTxD)

    def write(self, stream_BxTxD, update_BxTxD, read_context=None):
        return stream_BxTxD + update_BxTxD


@RESIDUALS.register("postnorm")
class PostNormSum(PreNormSum):
    """Post-Norm (Vaswani et al. 2017 §3.1; Xiong et al. 2020 Fig. 1a): x ← norm(x + F(x)).

    The sublayer reads the raw stream; every write is normalized (gain 1 at initialization).
    The original model has no final norm: set `model.norm.final=False` to match it.
    """

    def read(self, stream_BxTxD):
        return stream_BxTxD

    def write(self, stream_BxTxD, update_BxTxD, read_context=None):
        return self.norm(stream_BxTxD + update_BxTxD)


@RESIDUALS.register("deepnorm")
class DeepNormSum(PostNormSum):
    """DeepNorm (Wang et al. 2022, "DeepNet", eq. 5 and Table 1, decoder-only):
    x ← norm(α·x + F(x)) with α = (2M)^{1/4} for an M-block decoder.

    The other half of DeepNet is its initialization: Xavier with gain β = (8M)^{-1/4} on the FFN,
    value and output projections (Q and K keep gain 1), set by `model.init` (see arch/init.py and
    `experiments.common.use_deepnorm`).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.alpha = (2 * cfg.num_layers) ** 0.25

    @classmethod
    def check_prunable(cls, cfg, kept, drop) -> None:
        raise ValueError("model.residual.name='deepnorm': pruning changes DeepNorm's α = "
                         "(2M)^(1/4) of every remaining block; prune a model with another "
                         "model.residual.name")

    def write(self, stream_BxTxD, update_BxTxD, read_context=None):
        return self.norm(self.alpha * stream_BxTxD + update_BxTxD)


@RESIDUALS.register("noskip")
class NoSkip(PreNormSum):
    """No skip connection, the rank-collapse ablation of Dong et al. 2021 ("Attention is not all
    you need: pure attention loses rank doubly exponentially with depth", §2 and §4):
    x ← F(norm(x)). With `model.use_ffn=False` the stack is pure attention.
    """

    def write(self, stream_BxTxD, update_BxTxD, read_context=None):
        return update_BxTxD
