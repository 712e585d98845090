"""Early-exit probe of looped depth (`model.loop_count` = R, `TransformerLM._loop`): the loss the
model would have if it stopped after each pass of its block stack.

    loss_r = CE(head(final_norm(x_r)), next tokens),   r = 1 … R

with x_r what the final norm would read after pass r (`TransformerLM.loop_hidden_states`), the
cross-entropy the mean over the B·T targets of a train-step batch (`train.step.next_token_loss`).
loss_R is the model's own loss. A model with R = 1 gives one entry, its loss. Cost: one forward
pass plus R − 1 more head applications.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arch.model import TransformerLM
from train.step import next_token_loss


@nnx.jit
def _losses(model: TransformerLM, tokens_BxT1: jax.Array) -> jax.Array:
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    hidden_RxBxTxD = model.loop_hidden_states(inputs_BxT)
    return jax.lax.map(lambda hidden: next_token_loss(model.logits_of_hidden(hidden), targets_BxT),
                       hidden_RxBxTxD)


def early_exit_losses(model: TransformerLM, tokens_BxT1: jax.Array) -> np.ndarray:
    """The next-token loss after each of the R passes, float64 [R], on a batch B×(T+1) (inputs
    tokens[:, :-1], targets tokens[:, 1:]). The model runs in the mode it is in (call
    `model.eval()` first for BatchNorm's running statistics)."""
    if tokens_BxT1.ndim != 2 or tokens_BxT1.shape[1] < 2:
        raise ValueError(f"tokens_BxT1 has shape {tuple(tokens_BxT1.shape)}: expected B×(T+1) "
                         "token ids with T ≥ 1")
    return np.asarray(_losses(model, jnp.asarray(tokens_BxT1)), np.float64)
