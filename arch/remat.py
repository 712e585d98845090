"""Rematerialization policies by name (`execution.remat`): what a block keeps for its
backward pass, applied to the block function of the layer scan (and of the pipeline, and of the
two-phase AttnRes block scan, which scan the same checkpointed function).

Inside a block the attention and FFN sublayer outputs are named with
`jax.ad_checkpoint.checkpoint_name` (`ATTENTION_OUTPUT`, `FFN_OUTPUT`), which is what
`save_attention_and_ffn_outputs` and `offload` select.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from config.model_rules import REMAT_POLICIES

ATTENTION_OUTPUT = "attention_output"
FFN_OUTPUT = "ffn_output"



def host_offload_supported() -> bool:
    """Whether the default device has a `pinned_host` memory space to offload to."""
    device = jax.devices()[0]
    return any(memory.kind == "pinned_host" for memory in device.addressable_memories())


def checkpoint_policy(name: str) -> Callable | None:
    """The `jax.checkpoint` policy for a policy name other than `none` (None for `full`)."""
    policies = jax.checkpoint_policies
    names = [ATTENTION_OUTPUT, FFN_OUTPUT]
    if name == "full":
        return None
    if name == "dots_saveable":
        return policies.dots_saveable
    if name == "save_attention_and_ffn_outputs":
        return policies.save_only_these_names(*names)
    if name == "offload":
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=names,
            offload_src="device", offload_dst="pinned_host")
    raise ValueError(f"execution.remat={name!r} is invalid; valid: {', '.join(REMAT_POLICIES)}")


def apply_remat(fn: Callable, name: str) -> Callable:
    """`fn` checkpointed under the named policy (`fn` itself for `none`)."""
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=checkpoint_policy(name))
