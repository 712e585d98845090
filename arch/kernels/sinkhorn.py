"""mHC's projection onto the doubly-stochastic matrices (the mechanism: `arch.hyper`).

The projection of exp(L) (Sinkhorn & Knopp 1967; mHC, Xie et al. 2025 §4) is the unique doubly
stochastic M = diag(u) exp(L) diag(v). mHC approaches it by t_max = 20 Sinkhorn–Knopp
iterations, which leave the columns far from 1 at large logits; plain Sinkhorn–Knopp needs
hundreds of iterations for 10⁻³ there, the Newton method tens of steps
(docs/performance.md#mhcs-sinkhorn-column-error). So we solve for the same
point, to a tolerance, by a safeguarded Newton method on the dual [ours], in float32, per matrix.

Dual. With column potentials g ∈ Rⁿ, M(g)_ij = softmax_j(L_ij + g_j) has rows summing to 1;
its column sums c(g) = Mᵀ1 are 1 at the minimum of the convex
    F(g) = Σ_i logsumexp_j(L_ij + g_j) − Σ_j g_j,   ∇F = c − 1,   ∇²F = diag(c) − MᵀM.
One Sinkhorn–Knopp iteration (columns, then rows) is the step s = −log c. The Newton step is
δ = (∇²F + 11ᵀ/n)⁻¹(1 − c) (∇²F is singular along 1, which leaves M unchanged). Each iteration
takes, of the steps −log c and tδ (t = 1, ½, ¼, ⅛), the one that lowers F most (`_dual_change`),
so F falls at least as fast as under Sinkhorn–Knopp, and near the solution the full Newton step
converges quadratically. A matrix stops one step after its column error max_j |c_j − 1| is
within the tolerance (that step kept only if it does not raise the error), or when no step
lowers F (float32 can do no better): where a rounding difference moves the stop by one step (a
sharded program against one device), the result then moves by that step's size, far below
the tolerance, instead of by up to the tolerance.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

NEWTON_STEPS = (1.0, 0.5, 0.25, 0.125)  # the damped Newton candidates t
RIDGE = 1e-6  # added to the Newton and backward systems: finite when M is numerically a permutation


class Sinkhorn(NamedTuple):
    """What `sinkhorn` returns; leading axes X as the logits'."""

    matrix: jax.Array  # X×n×n, float32: rows sum to 1, columns within the tolerance (or capped)
    iterations: jax.Array  # X, int32: the steps each matrix took (the one after included)
    column_error: jax.Array  # X, float32: max_j |Σ_i M_ij − 1| of the returned matrix


# Below, matrices are laid out n×n×X (entry axes first, the batch X last and contiguous), so
# every operation is vectorized over the batch (with the n×n axes last, XLA:CPU ran a step
# ≈ 4× slower), and sums and maxima over an entry axis are unrolled into n − 1 elementwise
# operations: XLA:CPU (jax 0.10.2) computed a fused jnp.sum(a * b, axis=2) over a 5×4×4×10000
# product wrong (errors of 2 where values are ≈ 1) for X ≳ 2000.

def _sum(x, axis: int):
    return functools.reduce(jnp.add, jnp.unstack(x, axis=axis))


def _max(x, axis: int):
    return functools.reduce(jnp.maximum, jnp.unstack(x, axis=axis))


def _rows_normalized(logits, potentials):
    """M(g)_ij = softmax_j(L_ij + g_j): logits n×n×X, potentials n×X."""
    shifted = logits + potentials[None]
    exponentials = jnp.exp(shifted - _max(shifted, 1)[:, None])
    return exponentials / _sum(exponentials, 1)[:, None]


def _column_error(matrix):
    return _max(jnp.abs(_sum(matrix, 0) - 1.0), 0)


def _dual_change(matrix, steps):
    """F(g + s) − F(g) for candidate steps s (K×n×X) at M = M(g) → K×X, as
    Σ_i log1p(Σ_j M_ij expm1(s_j)) − Σ_j s_j: accurate for small s, where F itself is not
    (float32 resolves F ≈ 10 to 10⁻⁶); +inf where not finite."""
    mixed = _sum(matrix[None] * jnp.expm1(steps)[:, None], 2)  # K×n_i×X
    change = _sum(jnp.log1p(mixed), 1) - _sum(steps, 1)
    return jnp.where(jnp.isfinite(change), change, jnp.inf)


def _solve(matrix, rhs):
    """(diag(c) − MᵀM + 11ᵀ/n + RIDGE·I)⁻¹ rhs per matrix (rows of M sum to 1; rhs n×X): that
    system is symmetric positive definite, solved by a Cholesky factorization unrolled over n
    (n³/6 vector operations over X)."""
    n = matrix.shape[0]
    columns = _sum(matrix, 0)
    system = [[1.0 / n - _sum(matrix[:, j] * matrix[:, k], 0)
               + ((columns[j] + RIDGE) if j == k else 0.0) for k in range(n)] for j in range(n)]
    lower = [[None] * n for _ in range(n)]
    for j in range(n):
        lower[j][j] = jnp.sqrt(system[j][j] - sum(lower[j][k] ** 2 for k in range(j)))
        for i in range(j + 1, n):
            lower[i][j] = (system[i][j] - sum(lower[i][k] * lower[j][k] for k in range(j))
                           ) / lower[j][j]
    forward = []
    for i in range(n):
        forward.append((rhs[i] - sum(lower[i][k] * forward[k] for k in range(i))) / lower[i][i])
    solution = [None] * n
    for i in reversed(range(n)):
        solution[i] = (forward[i] - sum(lower[k][i] * solution[k] for k in range(i + 1, n))
                       ) / lower[i][i]
    return jnp.stack(solution)


def _iterate(logits, max_iterations: int, tolerance: float):
    """The forward iterations (module docstring) on n×n×X logits: (M, iterations, column
    error)."""
    newton_steps = jnp.asarray(NEWTON_STEPS, logits.dtype).reshape(-1, *[1] * (logits.ndim - 1))
    potentials = jnp.zeros_like(logits[0])  # zeros_like: in shard_map, as varying
    matrix = _rows_normalized(logits, potentials)
    finished = jnp.zeros_like(logits[0, 0], bool)
    start = (0, potentials, matrix, finished, jnp.zeros_like(logits[0, 0], jnp.int32))

    def cond(carry):
        step, _, _, finished, _ = carry
        return (step < max_iterations) & ~jnp.all(finished)

    def body(carry):
        step, potentials, matrix, finished, iterations = carry
        columns, error = _sum(matrix, 0), _column_error(matrix)
        newton = _solve(matrix, 1.0 - columns)
        steps = jnp.concatenate([-jnp.log(jnp.maximum(columns, 1e-30))[None],
                                 newton_steps * newton[None]])  # K×n×X
        change = _dual_change(matrix, steps)
        lowest = functools.reduce(jnp.minimum, jnp.unstack(change))
        step_taken = steps[-1]  # the candidate of lowest change (on a tie, the earlier one)
        for candidate in reversed(range(len(steps) - 1)):
            step_taken = jnp.where(change[candidate] == lowest, steps[candidate], step_taken)
        new_matrix = _rows_normalized(logits, potentials + step_taken)
        within = error <= tolerance  # then this is the last step, kept if it helps
        progress = lowest < 0
        take = ~finished & progress & (~within | (_column_error(new_matrix) <= error))
        return (step + 1, jnp.where(take[None], potentials + step_taken, potentials),
                jnp.where(take[None, None], new_matrix, matrix),
                finished | within | ~progress, iterations + take.astype(jnp.int32))

    _, _, matrix, _, iterations = jax.lax.while_loop(cond, body, start)
    return matrix, iterations, _column_error(matrix)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _sinkhorn(logits, max_iterations: int, tolerance: float):
    return _iterate(logits, max_iterations, tolerance)


def _sinkhorn_fwd(logits, max_iterations, tolerance):
    result = _iterate(logits, max_iterations, tolerance)
    return result, result[0]


def _sinkhorn_bwd(max_iterations, tolerance, matrix, cotangents):
    """Implicit differentiation at the returned M = diag(u) exp(L) diag(v): with its row and
    column sums r, c held, ∂L = M ⊙ (Ḡ − a1ᵀ − 1bᵀ), [[diag r, M], [Mᵀ, diag c]] [a; b] =
    [(M⊙Ḡ)1; (M⊙Ḡ)ᵀ1]. With r = 1, a = (M⊙Ḡ)1 − M b and (diag c − MᵀM) b = (M⊙Ḡ)ᵀ1 −
    Mᵀ(M⊙Ḡ)1, singular along b ∝ 1 (a_i + b_j unchanged): `_solve`. The iteration count and
    the column error get no gradient."""
    cotangent = cotangents[0]
    weighted = matrix * cotangent  # M ⊙ Ḡ
    row_terms = _sum(weighted, 1)
    b = _solve(matrix, _sum(weighted, 0) - _sum(matrix * row_terms[:, None], 0))
    a = row_terms - _sum(matrix * b[None], 1)
    return (matrix * (cotangent - a[:, None] - b[None]),)


_sinkhorn.defvjp(_sinkhorn_fwd, _sinkhorn_bwd)


def sinkhorn(logits_XxNxN: jax.Array, max_iterations: int, tolerance: float) -> Sinkhorn:
    """The doubly-stochastic projection of exp(logits) (leading axes X are a batch), to
    max_j |Σ_i M_ij − 1| ≤ `tolerance`: each matrix iterates (module docstring) from g = 0 (M =
    the row softmax of the logits) until one step after it is within the tolerance, or for
    `max_iterations` steps; rows sum to 1 to float rounding. A matrix's result depends on its own
    logits only, not on the others in the batch.

    Gradient: implicit differentiation at the returned matrix (`_sinkhorn_bwd`), exact at
    convergence and independent of the iterations; it keeps only M for the backward. No
    forward-mode derivative (a custom VJP).

    Cost: per step an n×n Cholesky solve and six log-sum-exp-like passes over the X·n² values;
    the loop runs until the slowest matrix of the batch stops (steps to 10⁻³ and time:
    docs/performance.md#mhcs-sinkhorn-column-error). Backward: one solve."""
    logits_NxNxX = jnp.moveaxis(logits_XxNxN.astype(jnp.float32), (-2, -1), (0, 1))
    matrix_NxNxX, iterations, column_error = _sinkhorn(logits_NxNxX, max_iterations, tolerance)
    return Sinkhorn(jnp.moveaxis(matrix_NxNxX, (0, 1), (-2, -1)), iterations, column_error)
