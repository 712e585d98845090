"""Softmax bottleneck diagnostic (Yang et al. 2018, "Breaking the Softmax Bottleneck", §2).

For N contexts c_i and a fixed subset of M tokens v_1..v_M plus a reference token v_0, the
log-odds matrix

    A_ij = log p(v_j | c_i) − log p(v_0 | c_i)        (N × M)

removes each context's normalizer. A single softmax over a d-dimensional context h_i gives
A_ij = h_i·(e_j − e_0) + (b_j − b_0): rank ≤ d + 1 with an output bias, ≤ d without. A model whose
true log-odds have higher rank cannot be matched by any such head; Mixture of Softmaxes escapes the
bound because log Σ_k π_k softmax(·) is not bilinear.

`softmax_bottleneck` computes the stable log-probabilities' log-odds in float64, their singular
values and the numerical rank: the number of σ > rtol·σ_max. The default rtol is
max(N, M)·ε_float32 (numpy's `matrix_rank` rule at the precision of float32 log-probabilities,
whose round-off sits near 1e-7·σ_max). The result states the precision, threshold and dimensions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from arch.heads import HEADS


def log_odds(log_probs_NxV: np.ndarray, tokens: np.ndarray, reference_token: int) -> np.ndarray:
    """A_ij = log p(tokens[j] | i) − log p(reference_token | i), float64, N × M."""
    log_probs = np.asarray(log_probs_NxV, np.float64)
    tokens = np.asarray(tokens)
    if reference_token in set(tokens.tolist()):
        raise ValueError(f"reference_token={reference_token} is also in tokens; pick another "
                         "reference (its column would be identically zero)")
    return log_probs[:, tokens] - log_probs[:, [reference_token]]


def softmax_bottleneck(log_probs_NxV, *, tokens, reference_token: int,
                       rtol: float | None = None) -> dict:
    """The diagnostic for N contexts' log-probabilities (N × V, any float dtype; normalize them
    first, e.g. `jax.nn.log_softmax` of logits, which is stable): the log-odds matrix against
    `reference_token` over the M `tokens` (`log_odds`), its singular values (float64 SVD,
    descending) and numerical rank at `rtol`·σ_max.

    Returns {"singular_values", "numerical_rank", "threshold" (absolute), "rtol", "contexts": N,
    "tokens": M, "reference_token", "precision"}."""
    matrix = log_odds(log_probs_NxV, tokens, reference_token)
    contexts, width = matrix.shape
    singular = np.linalg.svd(matrix, compute_uv=False)
    rtol = max(contexts, width) * float(np.finfo(np.float32).eps) if rtol is None else rtol
    threshold = rtol * float(singular[0]) if singular.size else 0.0
    return {"singular_values": singular, "numerical_rank": int(np.sum(singular > threshold)),
            "threshold": threshold, "rtol": rtol, "contexts": contexts, "tokens": width,
            "reference_token": int(reference_token),
            "precision": f"float64 SVD of {np.asarray(log_probs_NxV).dtype} log-probabilities"}


def model_bottleneck(model, tokens_BxT: jax.Array, *, num_tokens: int | None = None,
                     reference_token: int = 0, rtol: float | None = None) -> dict:
    """`softmax_bottleneck` of a language model: every position of `tokens_BxT` is one context
    (N = B·T; use diverse text), the token subset is the M = `num_tokens` vocabulary ids after
    `reference_token` (default M = min(V − 1, 2(d + 1)): enough columns to exceed the bound; pass
    another subset to `softmax_bottleneck` to choose the tokens). Adds "bound": the rank a single
    softmax of the final d-dimensional hidden state can reach (d + 1 with an output bias, d
    without; None for a head with no such bound, `mos` and `sigsoftmax`). The bound is tested
    only when N and M exceed it."""
    cfg = model.cfg
    log_probs = jax.nn.log_softmax(model(tokens_BxT).astype(jnp.float32), axis=-1)
    vocab = log_probs.shape[-1]
    if num_tokens is None:
        num_tokens = min(vocab - 1, 2 * (cfg.d_model + 1))
    subset = (reference_token + 1 + np.arange(num_tokens)) % vocab
    result = softmax_bottleneck(np.asarray(log_probs).reshape(-1, vocab), tokens=subset,
                                reference_token=reference_token, rtol=rtol)
    bounded = HEADS[cfg.head.name].rank_bounded
    result["bound"] = cfg.d_model + int(cfg.head.bias) if bounded else None
    return result
