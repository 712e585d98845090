"""Block pruning by angular distance and healing with low-rank adapters.

Selection (which contiguous blocks to drop):

- Angular distance (Gromov et al. 2024, "The Unreasonable Ineffectiveness of the Deeper Layers",
  §3.2): with x^l the hidden state at boundary l (the input of block l; x^L what the final norm
  reads), d(x^l, x^{l+n}) = (1/π) · arccos(x^l · x^{l+n} / (‖x^l‖ ‖x^{l+n}‖)), averaged over the
  B·T tokens of a calibration batch; drop the n blocks l*, …, l* + n − 1 with
  l* = argmin_l d(x^l, x^{l+n}) (ties to the shallower l). Cost: one forward pass.
- Block Influence (ShortGPT, Men et al. 2024): `train.instruments.ablation.prune_by_influence`, the
  n blocks with the lowest 1 − cos(x^l, x^{l+1}) (not necessarily contiguous).

Removal: `train.instruments.ablation.prune_blocks` (the blocks' stacked parameters are sliced, the
config says the smaller depth).

Healing (Gromov et al. heal with QLoRA; here LoRA, Hu et al. 2021, in float32): every `Dense`
kernel of the stacked blocks, W of shape L×(in axes)×(out axes), viewed as L matrices of I×O
(I, O the products of its input and output axes), gets an adapter A (L×I×r, normal with std
1/√I) and B (L×r×O, zero), and the block computes with W + (α/r)·A B, i.e.
y = x W + (α/r)·(x A) B, which at B = 0 is the pruned model exactly. The adapters train with
Adam for a fixed number of steps on the run's training split; the base parameters sit in the same
optimized tree but an optax partition gives them `optax.set_to_zero()`, so only A and B move.
The healed model is returned with the adapters folded into the kernels (a plain `TransformerLM`
of the pruned config, which restores and generates like any other). Cost per healing step: one
forward and backward of the pruned model plus the L·r·(I + O) adapter entries per kernel.

Why not qwix's LoRA provider (`qwix.LoraProvider`, 0.1.8): it creates its `nnx.LoRAParam`s
lazily on the module the first time an intercepted dot_general/einsum runs, and in this model the
blocks run as `nnx.merge` of one slice of the stacked parameters inside `jax.lax.scan`
(arch/model.py), so the adapters would be created on a transient module inside the scan body:
`qwix.apply_lora_to_model` fails there (IndexError in the scan) on a tiny model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from arch.layers import Dense
from arch.model import TransformerLM, interleaves_moe
from config.resolution import unresolved
from train.checkpoint import Checkpointer
from train.instruments.probes import _split_tokens, require_probeable
from train.step import build_program, next_token_loss, resolve_for_job

Adapters = dict[str, dict[str, jax.Array]]


# Angular distance ---------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=0)
def _boundary_hidden_states(graphdef, state, inputs_BxT):
    model = nnx.merge(graphdef, state)
    positions_BxT = jnp.broadcast_to(jnp.arange(inputs_BxT.shape[1]), inputs_BxT.shape)
    stream = model.residual_stream.begin(
        model.position.embed(model.embed(inputs_BxT), positions_BxT))
    block_graphdef, layer_params, layer_states = nnx.split(model.blocks, nnx.Param, ...)

    def run_block(stream, layer):
        block = nnx.merge(block_graphdef, *layer)
        hidden_BxTxD = model.residual_stream.hidden_state(stream)
        stream, _ = block(stream, positions_BxT, model.position.rotate)
        return stream, hidden_BxTxD.astype(jnp.float32)

    stream, hidden_LxBxTxD = jax.lax.scan(run_block, stream, (layer_params, layer_states))
    last_BxTxD = model.residual_stream.end(stream).astype(jnp.float32)
    return jnp.concatenate([hidden_LxBxTxD, last_BxTxD[None]], axis=0)


def boundary_hidden_states(model: TransformerLM, tokens_BxT1: jax.Array) -> np.ndarray:
    """x^0 … x^L, (L+1)×B×T×D float32: the hidden state (the residual mechanism's
    `hidden_state`) at the input of every block and, last, what the final norm reads; the model's
    own blocks in the mode it is in, on tokens[:, :-1]."""
    require_probeable(model.cfg)
    if interleaves_moe(model.cfg):
        raise ValueError(f"model.moe.every={model.cfg.moe.every}: boundaries of single blocks "
                         "are not in the scan over dense/MoE groups; use model.moe.every=1")
    inputs_BxT, _ = _split_tokens(jnp.asarray(tokens_BxT1))
    graphdef, state = nnx.split(model)
    return np.asarray(jax.device_get(_boundary_hidden_states(graphdef, state, inputs_BxT)))


def angular_distances(hidden_Lp1xBxTxD: np.ndarray, num_drop: int) -> np.ndarray:
    """d(x^l, x^{l+n}) for l = 0 … L − n (n = `num_drop`): the token mean of
    arccos(cosine(x^l_t, x^{l+n}_t)) / π, in [0, 1], float64."""
    boundaries = hidden_Lp1xBxTxD.shape[0]
    if not 1 <= num_drop < boundaries - 1:
        raise ValueError(f"num_drop={num_drop}: expected 1 ≤ n < L = {boundaries - 1} "
                         "(at least one block must stay)")
    x = np.asarray(hidden_Lp1xBxTxD, np.float64)
    start, end = x[:boundaries - num_drop], x[num_drop:]
    cosine = np.sum(start * end, -1) / (np.linalg.norm(start, axis=-1)
                                       * np.linalg.norm(end, axis=-1))
    return np.mean(np.arccos(np.clip(cosine, -1.0, 1.0)), axis=(1, 2)) / np.pi


def select_by_angular_distance(model: TransformerLM, tokens_BxT1: jax.Array,
                               num_drop: int) -> dict:
    """Gromov et al.'s selection on the calibration batch: {"distance": (L − n + 1,) array of
    d(x^l, x^{l+n}), "start": l*, "dropped": [l*, …, l* + n − 1]}."""
    distance = angular_distances(boundary_hidden_states(model, tokens_BxT1), num_drop)
    start = int(np.argmin(distance))
    return {"distance": distance, "start": start,
            "dropped": list(range(start, start + num_drop))}


# Low-rank adapters --------------------------------------------------------------------------------

def adapter_targets(model: TransformerLM) -> dict[str, tuple[int, int]]:
    """The Dense modules of the stacked blocks that get adapters: {dotted path inside a block
    (e.g. "attention.query"): (I, O)}, I / O the products of the kernel's input / output axes."""
    targets = {}
    for path, node in nnx.iter_graph(model.blocks):
        if isinstance(node, Dense):
            shape = node.kernel.shape[1:]  # leading axis: the stacked layers
            targets[".".join(str(p) for p in path)] = (
                math.prod(shape[:node.n_in]), math.prod(shape[node.n_in:]))
    return targets


def init_adapters(model: TransformerLM, rank: int, key: jax.Array) -> Adapters:
    """{path: {"a": L×I×r ~ N(0, 1/I), "b": L×r×O zeros}} for every `adapter_targets` kernel."""
    if rank < 1:
        raise ValueError(f"rank={rank}: expected a positive adapter rank")
    layers = model.cfg.num_layers
    adapters = {}
    for (path, (fan_in, fan_out)), subkey in zip(
            sorted(adapter_targets(model).items()),
            jax.random.split(key, len(adapter_targets(model))), strict=True):
        adapters[path] = {
            "a": jax.random.normal(subkey, (layers, fan_in, rank), jnp.float32) * fan_in**-0.5,
            "b": jnp.zeros((layers, rank, fan_out), jnp.float32)}
    return adapters


def _module(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _add_adapters(model: TransformerLM, adapters: Adapters, scale: float) -> None:
    """In place: every adapted kernel W ← W + scale · (A B reshaped to W's shape)."""
    for path, adapter in adapters.items():
        kernel = _module(model.blocks, path).kernel
        delta = jnp.einsum("lir,lro->lio", adapter["a"], adapter["b"])
        kernel[...] = kernel[...] + scale * delta.reshape(kernel.shape).astype(kernel.dtype)


def fold_adapters(model: TransformerLM, adapters: Adapters, alpha: float) -> TransformerLM:
    """A new model (no state shared with `model`) whose kernels are W + (α/r)·A B."""
    graphdef, state = nnx.split(model)
    folded = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))
    rank = next(iter(adapters.values()))["a"].shape[-1]
    _add_adapters(folded, adapters, alpha / rank)
    return folded


def adapter_labels(tree: dict) -> dict:
    """optax partition labels of the healing tree {"base": parameters (nnx.Variables),
    "adapters": Adapters}: "frozen" for every base parameter, "adapter" for A and B."""
    return {"base": jax.tree.map(lambda v: v.replace("frozen"), tree["base"],
                                 is_leaf=lambda x: isinstance(x, nnx.Variable)),
            "adapters": jax.tree.map(lambda _: "adapter", tree["adapters"])}


def healing_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """Adam on the adapters, `optax.set_to_zero()` on the base parameters."""
    return optax.partition({"adapter": optax.adam(learning_rate),
                            "frozen": optax.set_to_zero()}, adapter_labels)


def _adapted_loss(graphdef, rest, scale, tree, tokens_BxT1):
    model = nnx.merge(graphdef, tree["base"], rest)
    _add_adapters(model, tree["adapters"], scale)
    inputs_BxT, targets_BxT = _split_tokens(tokens_BxT1)
    return next_token_loss(model(inputs_BxT), targets_BxT)


@functools.partial(jax.jit, static_argnums=(0, 2, 3), donate_argnums=(4, 5))
def _healing_step(graphdef, rest, scale, optimizer, tree, opt_state, tokens_BxT1):
    loss, grads = jax.value_and_grad(functools.partial(_adapted_loss, graphdef, rest, scale))(
        tree, tokens_BxT1)
    updates, opt_state = optimizer.update(grads, opt_state, tree)
    return optax.apply_updates(tree, updates), opt_state, loss


def heal(model: TransformerLM, batches: Callable[[int], np.ndarray], steps: int, *,
         rank: int = 8, alpha: float | None = None, learning_rate: float = 1e-3,
         seed: int = 0) -> tuple[TransformerLM, dict]:
    """Train low-rank adapters on the model's stacked Dense kernels for `steps` steps (Adam,
    `learning_rate`, batch `batches(step)`, a B×(T+1) token array), the base parameters frozen
    by the optax partition (module docstring). α defaults to r (scale α/r = 1). The model runs in
    the mode it is in (call `model.eval()` first to keep BatchNorm statistics fixed; they are not
    updated either way).

    Returns (the healed model with the adapters folded in, {"losses": per-step training losses,
    "adapters": the trained Adapters, "base": the base parameters after the last step (equal to
    the model's, which the tests check)})."""
    alpha = float(rank if alpha is None else alpha)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tree = {"base": jax.tree.map(jnp.copy, params),
            "adapters": init_adapters(model, rank, jax.random.key(seed))}
    optimizer = healing_optimizer(learning_rate)
    opt_state = optimizer.init(tree)
    losses = []
    for step in range(steps):
        tree, opt_state, loss = _healing_step(graphdef, rest, alpha / rank, optimizer, tree,
                                              opt_state, jnp.asarray(batches(step)))
        losses.append(float(loss))
    healed = fold_adapters(nnx.merge(graphdef, tree["base"], rest), tree["adapters"], alpha)
    return healed, {"losses": losses, "adapters": tree["adapters"], "base": tree["base"]}


def write_run(config, model: TransformerLM, workdir) -> None:
    """Write `model` (e.g. pruned by `ablation.prune_blocks` or `head_pruning.prune_heads`, or
    healed) as a run directory that `train.restore.restore_run`, `python -m train.generate` and
    the instruments read: config.json (`config`, a full training config such as the source run's
    `program.config`, with `model` replaced by the model's own config) and a step-0 checkpoint of
    its parameters, model state and a fresh optimizer state. FileExistsError if `workdir` holds
    a run."""
    workdir = Path(workdir)
    if (workdir / "config.json").exists() or (workdir / "checkpoints").exists():
        raise FileExistsError(f"{workdir} already holds a run; write into a new directory")
    config = unresolved(config)
    config.model = unresolved(model.cfg)
    program = build_program(resolve_for_job(config))  # the smaller shapes checked before writing
    params, model_state = nnx.state(model, nnx.Param), nnx.state(model, nnx.Not(nnx.Param))

    def initial_state(params, model_state):
        return {"step": jnp.zeros((), jnp.int32), "params": params, "model_state": model_state,
                "opt_state": program.optimizer.init(params)}

    with jax.set_mesh(program.mesh):
        state = jax.jit(initial_state, out_shardings=program.state_shardings)(params, model_state)
    workdir.mkdir(parents=True, exist_ok=True)
    with Checkpointer(workdir, config.keep_checkpoints) as checkpointer:
        checkpointer.save(0, state, {"next_step": 0, "seed": config.seed}, force=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
