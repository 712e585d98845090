"""The layer scan of Block AttnRes's two-phase schedule, one block per step, with a hand-written
gradient (the mechanism: `arch.attnres`; its reads: `arch.kernels.depth_read`).

Completed slots never change, so the forward pass saves no copy of the B×T×(N+1)×D buffer per
step (autodiff of the scan would), and the backward pass reads phase 1's sources from the final
buffer. Each scan unit's outputs (KV cache, layer states; parameter cotangents in the backward
pass) are written in place into the scan's unit-major buffers. A block's S/2 layers are unrolled
in the step, so compile time grows with S, not with depth at a fixed S.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from arch.kernels.depth_read import (
    add_to_slot,
    contraction_views,
    inverse_rms,
    phase_one_on_views,
    read_slot,
    source_slots,
    write_slot,
)

HISTORY = ("sources", "inverse_rms")  # the state's per-slot leaves: the buffer and its 1/rms


def buffer_views(layout, history: dict) -> tuple:
    """The buffer and its 1/rms as phase 1 contracts them (`contraction_views`)."""
    return contraction_views(*source_slots(layout, history), layout.heads)


def open_block(layout, queries_table, views: tuple, first) -> tuple:
    """Phase 1 for the block whose first sublayer is `first`: its S pseudo-queries against the
    completed sources (`views` of the buffer) at once. Each read's (log-sum-exp, normalized
    read), in order."""
    queries = jax.lax.dynamic_slice_in_dim(queries_table, first, layout.block_size)
    valid = jnp.arange(layout.slots) <= first // layout.block_size
    lse, reads = phase_one_on_views(queries, views, valid, layout.heads)
    return tuple((lse[:, :, i], read) for i, read in enumerate(reads))


def close_block(layout, history: dict, partial_BxTxD, first, constrain) -> dict:
    """The buffer with the block's sum written to its slot (with its 1/rms), passed through
    `constrain` (the mechanism's sharding of its state): the summary becomes a source."""
    slot = first // layout.block_size + 1
    history = dict(history, sources=add_to_slot(history["sources"], partial_BxTxD, slot))
    if layout.normalizes_keys:
        history["inverse_rms"] = write_slot(
            history["inverse_rms"], inverse_rms(partial_BxTxD, layout.heads, layout.eps),
            slot, layout.heads)
    return constrain(history)


def unit_state(queries_table, phase: tuple, first, partial_BxTxD, fresh: bool) -> dict:
    """What the layers of a scan unit in an opened block read and write: the counter, the query
    table, the unit's reads' phase-1 results and the block's partial sum, and, when the unit
    starts the block, the key "fresh" (the partial sum is not a source yet)."""
    state = dict(sublayer=first, pseudo_queries=queries_table, phase=phase,
                 partial=partial_BxTxD)
    return dict(state, fresh=None) if fresh else state


def scan_blocks(stream, body, state: dict, xs, constrain):
    """`stream.scan` (`arch.attnres.AttnResStream`): the layer stack as `jax.lax.scan` over
    AttnRes blocks, `body(unit_state, x) -> (unit_state, y)` run for each scan unit of a block
    after `open_block`, then `close_block`, with `block_scan`'s gradient. Returns (final state,
    y stacked over units). `constrain` shards the buffer after each block (the kernels import
    no mechanism: `arch.residual.constrain_state`, passed by `arch.attnres`)."""
    queries, first = state["pseudo_queries"], state["sublayer"]
    history = {name: state[name] for name in HISTORY if name in state}
    layout = stream.layout
    per_block = stream.units_per_block(_units(xs))
    reads = layout.block_size // per_block

    def example(fresh: bool):
        return jax.eval_shape(lambda: (unit_state(
            queries, open_block(layout, queries, buffer_views(layout, history), first)[:reads],
            first,
            _empty_partial(history, queries), fresh), jax.tree.map(lambda x: x[0], xs)))
    # A unit that starts its block reads no partial sum: a body of its own.
    bodies, consts = zip(*(jax.closure_convert(body, *example(fresh))
                           for fresh in (True, False)[:per_block]), strict=True)
    history, ys = block_scan(stream, bodies, per_block, constrain)(
        queries, history, first, consts, xs)
    return dict(state, **history, sublayer=first + layout.sublayers), ys


def _split_inexact(tree):
    """(leaves that take gradients or None, the other leaves or None), each in `tree`'s shape."""
    inexact = lambda x: jnp.issubdtype(x.dtype, jnp.inexact)
    return (jax.tree.map(lambda x: x if inexact(x) else None, tree),
            jax.tree.map(lambda x: None if inexact(x) else x, tree))


def _join(first, second):
    """The inverse of `_split_inexact`."""
    return jax.tree.map(lambda a, b: b if a is None else a, first, second,
                        is_leaf=lambda x: x is None)


def _units(xs) -> int:
    """The number of scan units: the leading axis of the unit-major inputs."""
    return jax.tree.leaves(xs)[0].shape[0]


def _empty_partial(history: dict, queries_table) -> jax.Array:
    """A block's partial sum before its first output: zeros, B×T×D."""
    sources = history["sources"]
    return jnp.zeros((*sources.shape[:2], queries_table.shape[-1]), sources.dtype)


def block_scan(stream, bodies: tuple, per_block: int, constrain):
    """`run(queries_table, history, first, consts, xs) -> (history, ys)`: the scan of
    `AttnResStream.scan`, one AttnRes block of `per_block` scan units per step, with
    `bodies[0](unit_state, x, *consts[0])` for a block's first unit and `bodies[1]` (with
    `consts[1]`) for the others (`jax.closure_convert`ed), and its hand-written gradient.

    Completed slots never change and phase 1 masks the others, so what phase 1 of a block needs
    from the buffer in the backward pass is in the final buffer. The forward pass saves, per
    block, the residuals of phase 1 and of each unit (`jax.vjp`) except those that are the
    step's own inputs: the buffer, the query table, the constants and the layer's parameters
    come back from the final buffer and the inputs (autodiff of the scan would save the
    B×T×(N+1)×D buffer at every step). The backward pass scans the blocks in reverse: the
    block's sum gets the cotangent of its slot and of its 1/rms, the units' VJPs, last first,
    give those of their phase-1 results, queries, constants, layer inputs and the partial sum
    each read, and phase 1's adds to the buffer's and the queries'. Each unit's inputs are
    indexed in the unit-major xs directly (a blocks × units view of them made decoding slower)."""
    layout = stream.layout
    size, reads = layout.block_size, layout.block_size // per_block
    plans = {}  # filled while tracing the forward pass: where each residual comes from

    def unit(j, first, other_x):
        """Unit j of the block at `first` as a function of its differentiable inputs."""
        def run_unit(queries, phase, consts, diff_x, partial):
            state = unit_state(queries, phase, first + j * reads, partial, j == 0)
            state, y = bodies[min(j, 1)](state, _join(diff_x, other_x), *consts)
            diff_y, other_y = _split_inexact(y)
            return (state["partial"], diff_y), other_y
        return run_unit

    def at(tree, unit):  # one unit's slice of unit-major leaves
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, unit, keepdims=False), tree)

    def scan_blocks(step, carry, units: int, scanned=(), reverse=False):
        """`jax.lax.scan` of `step(carry, (block, *scanned)) -> (carry, (per-unit outputs,
        other outputs))` over the blocks, each unit's output written in place into unit-major
        buffers in the loop carry (stacked per block and interleaved after, every output was
        copied once more: the whole KV cache at each decode step). Returns (carry, unit-major
        outputs, other outputs stacked over blocks)."""
        blocks = jnp.arange(units // per_block)
        example = jax.eval_shape(step, carry, (blocks[0], *at(scanned, 0)))[1][0][0]
        buffers = jax.tree.map(lambda y: jnp.zeros((units, *y.shape), y.dtype), example)

        def body(carry_buffers, inputs):
            carry, buffers = carry_buffers
            carry, (ys, other) = step(carry, inputs)
            for j, y in enumerate(ys):
                buffers = jax.tree.map(lambda b, y, j=j: jax.lax.dynamic_update_index_in_dim(
                    b, y.astype(b.dtype), inputs[0] * per_block + j, 0), buffers, y)
            return (carry, buffers), other
        (carry, buffers), other = jax.lax.scan(body, (carry, buffers), (blocks, *scanned),
                                               reverse=reverse)
        return carry, buffers, other

    def step_units(queries, phase, consts, xs, block, history, first, differentiate):
        """The block's units in order: (partial sum, each unit's y, each unit's VJP and the
        inputs it may keep)."""
        partial, ys, vjps = _empty_partial(history, queries), [], []
        for j in range(per_block):
            diff_x, other_x = _split_inexact(at(xs, block * per_block + j))
            args = (queries, phase[j * reads:(j + 1) * reads], consts[min(j, 1)], diff_x,
                    partial)
            run_unit = unit(j, first, other_x)
            if differentiate:
                (partial, diff_y), vjp, other_y = jax.vjp(run_unit, *args, has_aux=True)
                vjps.append((vjp, (queries, consts[min(j, 1)], diff_x)))
            else:
                (partial, diff_y), other_y = run_unit(*args)
            ys.append(_join(diff_y, other_y))
        return partial, tuple(ys), vjps

    def run(queries, history, first, consts, xs):
        def step(carry, inputs):
            (history, first), (block,) = carry, inputs
            phase = open_block(layout, queries, buffer_views(layout, history), first)
            partial, ys, _ = step_units(queries, phase, consts, xs, block, history, first, False)
            return (close_block(layout, history, partial, first, constrain), first + size), (ys, ())
        (history, _), ys, _ = scan_blocks(step, (history, first), _units(xs))
        return history, ys

    def keep(key, vjp, inputs):
        """The VJP's residuals that are not among `inputs` (their places recorded)."""
        residuals, tree = jax.tree.flatten(vjp)
        inputs = jax.tree.leaves(inputs)
        where = [next((i for i, x in enumerate(inputs) if x is r), None) for r in residuals]
        plans[key] = (tree, where)
        return [r for r, i in zip(residuals, where, strict=True) if i is None]

    def rebuild(key, kept, inputs):
        tree, where = plans[key]
        kept, inputs = iter(kept), jax.tree.leaves(inputs)
        return jax.tree.unflatten(tree, [next(kept) if i is None else inputs[i] for i in where])

    def run_saving(queries, history, first, consts, xs):
        def step(carry, inputs):
            (history, first), (block,) = carry, inputs
            views = buffer_views(layout, history)
            phase, open_vjp = jax.vjp(lambda q, v: open_block(layout, q, v, first), queries, views)
            partial, ys, vjps = step_units(queries, phase, consts, xs, block, history, first,
                                           True)
            saved = [keep("open", open_vjp, (queries, views))]
            saved += [keep(j, vjp, inputs) for j, (vjp, inputs) in enumerate(vjps)]
            closed = close_block(layout, history, partial, first, constrain)
            return (closed, first + size), (ys, saved)
        (history, _), ys, saved = scan_blocks(step, (history, first), _units(xs))
        return (history, ys), (queries, history, first, consts, xs, saved)

    def backward(residuals, cotangents):
        queries, final, first, consts, xs, saved = residuals
        history_cotangent, ys_cotangent = cotangents
        width, dtype = queries.shape[-1], final["sources"].dtype
        views, views_vjp = jax.vjp(lambda history: buffer_views(layout, history), final)

        def step(carry, inputs):
            history_cotangent, queries_cotangent, consts_cotangent = carry
            block, saved = inputs
            slot = (first + block * size) // size + 1
            partial_cotangent = read_slot(history_cotangent["sources"], slot, width)
            if layout.normalizes_keys:  # the slot's 1/rms, written from the block's sum
                inverse = history_cotangent["inverse_rms"]
                _, rms_vjp = jax.vjp(lambda p: inverse_rms(p, layout.heads, layout.eps),
                                     read_slot(final["sources"], slot, width))
                partial_cotangent += rms_vjp(read_slot(inverse, slot, layout.heads))[0]
                history_cotangent = dict(history_cotangent, inverse_rms=write_slot(
                    inverse, jnp.zeros(inverse.shape[:2] + (layout.heads,)), slot, layout.heads))
            consts_cotangent, phase_cotangent, xs_cotangent = list(consts_cotangent), [], []
            for j in reversed(range(per_block)):  # the units' VJPs, last unit first
                unit_vjp = rebuild(j, saved[j + 1], (queries, consts[min(j, 1)], _split_inexact(
                    at(xs, block * per_block + j))[0]))
                queries_from_unit, unit_phase, consts_from_unit, x_cotangent, partial_cotangent \
                    = unit_vjp((partial_cotangent.astype(dtype), _split_inexact(
                        at(ys_cotangent, block * per_block + j))[0]))
                queries_cotangent = queries_cotangent + queries_from_unit
                consts_cotangent[min(j, 1)] = jax.tree.map(jnp.add, consts_cotangent[min(j, 1)],
                                                           consts_from_unit)
                phase_cotangent[:0], xs_cotangent[:0] = unit_phase, [x_cotangent]
            queries_from_phase, views_cotangent = rebuild("open", saved[0], (queries, views))(
                tuple(phase_cotangent))
            carry = (jax.tree.map(jnp.add, history_cotangent, views_vjp(views_cotangent)[0]),
                     queries_cotangent + queries_from_phase, tuple(consts_cotangent))
            return carry, (tuple(xs_cotangent), ())

        zeros = jax.tree.map(jnp.zeros_like, (queries, consts))
        (history_cotangent, queries_cotangent, consts_cotangent), xs_cotangent, _ = scan_blocks(
            step, (history_cotangent, *zeros), _units(xs), (saved,), reverse=True)
        return queries_cotangent, history_cotangent, None, consts_cotangent, xs_cotangent

    scan = jax.custom_vjp(run)
    scan.defvjp(run_saving, backward)
    return scan
