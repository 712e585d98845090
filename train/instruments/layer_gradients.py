"""Parameter gradients by layer: ‖∂loss/∂W‖_F of every stacked-block parameter, per block.

Tokens, depth and the loss follow the conventions of `train.instruments.probes`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arch.model import TransformerLM, interleaves_moe
from train.instruments.probes import _split_tokens
from train.step import next_token_loss


@functools.partial(jax.jit, static_argnums=0)
def _parameter_gradients(graphdef, params, rest, tokens_BxT1):
    inputs_BxT, targets_BxT = _split_tokens(tokens_BxT1)

    def loss_fn(params):
        # New Variables at this trace level: BatchNorm in training mode writes its statistics.
        model = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))
        return next_token_loss(model(inputs_BxT), targets_BxT)

    return jax.grad(loss_fn)(params)


def layer_gradient_norms(model: TransformerLM, tokens_BxT1: jax.Array) -> dict[str, np.ndarray]:
    """Per block, the Frobenius norm ‖∂loss/∂W‖_F of every parameter W of the stacked blocks, on
    one batch (loss as in `probes.depth_profile`; the model's own forward in the mode it is
    in): a dict from the parameter's dotted path inside a block to an (L,) float64 array in
    network order.
    The projections of an MHA block with a dense FFN are "attention.query.kernel",
    "attention.key.kernel", "attention.value.kernel", "attention.output.kernel",
    "ffn.up.kernel", ("ffn.gate.kernel" for gated FFNs) and "ffn.down.kernel"; the residual
    mechanism's own parameters follow its attribute names (e.g. "attention_residual.norm.scale").
    Any residual mechanism, also the reversible stack; ValueError for MoE interleaving, whose
    stacked groups hold k blocks each."""
    if interleaves_moe(model.cfg):
        raise ValueError(f"model.moe.every={model.cfg.moe.every}: gradients by layer read the "
                         "stack of single blocks; use model.moe.every=1")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = _parameter_gradients(graphdef, params, rest, jnp.asarray(tokens_BxT1))
    norms = {}
    for path, grad in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads["blocks"])):
        grad32 = np.asarray(jax.device_get(grad), np.float64)
        key = ".".join(str(getattr(part, "key", part)) for part in path)
        norms[key] = np.sqrt(np.sum(grad32.reshape(grad32.shape[0], -1) ** 2, axis=1))
    return norms
