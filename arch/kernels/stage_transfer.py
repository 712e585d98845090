"""The cached stage transfer of AttnRes's source buffer in the pipeline (AttnRes report;
`sharding/pipeline.py`): a stage that receives the buffer last held it `lag` sublayers earlier
and keeps that copy, so it is sent only the slots written since, with their 1/rms and the
counter, and writes them over its copy. O(lag/S) slots per transfer instead of 1 + N.

`slots` is 1 + N (the embedding and one per block of S = `block_size` sublayers); the per-slot
leaves of a state are token-major, B×T×(slots·width) (`arch.kernels.depth_read`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def window(slots: int, block_size: int, lag: int) -> int:
    """Slots written in `lag` consecutive sublayers: at most ⌈(lag − 1)/S⌉ + 1 (all `slots`
    when that is no fewer)."""
    return min(slots, -(-(lag - 1) // block_size) + 1)


def _recent_slots(slots: int, block_size: int, sublayer, lag: int):
    """(first slot, count) of the window written by sublayers sublayer − lag … sublayer − 1,
    moved back to stay inside the buffer."""
    count = window(slots, block_size, lag)
    first = jnp.maximum(sublayer - lag, 0) // block_size + 1
    return jnp.minimum(first, slots - count), count


def _slot_widths(slots: int, state: dict) -> dict[str, int]:
    """Features per slot of the per-slot leaves: the sources (D) and their 1/rms (H)."""
    widths = {"sources": state["sources"].shape[-1] // slots}
    if "inverse_rms" in state:
        widths["inverse_rms"] = state["inverse_rms"].shape[-1] // slots
    return widths


def message(slots: int, block_size: int, state: dict, lag: int) -> dict:
    """The counter and the window of slots written in the `lag` sublayers before it."""
    first, count = _recent_slots(slots, block_size, state["sublayer"], lag)
    sent = {"sublayer": state["sublayer"]}
    for name, width in _slot_widths(slots, state).items():
        sent[name] = jax.lax.dynamic_slice_in_dim(state[name], first * width, count * width,
                                                  axis=2)
    return sent


def merge(slots: int, block_size: int, cached: dict, sent: dict, lag: int) -> dict:
    """A stage's own older copy with a `message`'s window written over its slots (slots before
    the window are final in both, those after empty)."""
    first, _ = _recent_slots(slots, block_size, sent["sublayer"], lag)
    state = dict(cached, sublayer=sent["sublayer"])
    for name, width in _slot_widths(slots, cached).items():
        state[name] = jax.lax.dynamic_update_slice_in_dim(cached[name], sent[name],
                                                          first * width, axis=2)
    return state
