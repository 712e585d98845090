"""The one mapping from the flat config names of earlier versions to their sections.

`MOVED[old] = new`, both dotted paths from the config's root. `upgrade` rewrites a config.json
written by an earlier run into today's sections (run directories stay readable), and the command
line refuses an old name in one line that names its new place (`moved_hint`). No JAX.
"""

from __future__ import annotations

import copy

_SECTIONS = {
    "mla": ("kv_rank", "q_rank", "rope_dim", "nope_dim", "v_dim", "absorb"),
    "moe": ("experts", "top_k", "every", "dense_ffn", "d_ff", "expert_ffn", "capacity_factor",
            "dropless", "renormalize", "shared_experts", "balance_coef", "z_coef"),
    "attnres": ("block_size", "query", "heads", "weights", "key_norm", "window"),
}

MOVED: dict[str, str] = {
    **{f"model.{section}_{field}": f"model.{section}.{field}"
       for section, fields in _SECTIONS.items() for field in fields},
    **{f"model.gr_{field}": f"model.gated_residual.{field}"
       for field in ("rank", "channelwise", "channelwise_read", "channelwise_write", "static",
                     "init", "read_top_k", "mixing", "state_dtype")},
    "model.hc_dynamic_scale": "model.hyper.dynamic_scale",
    "model.mhc_sinkhorn_iters": "model.hyper.sinkhorn_iters",
    "model.attention_implementation": "execution.attention_implementation",
    "model.attention_chunk": "execution.attention_chunk",
    "model.sequence_attention": "execution.sequence_attention",
    "model.remat": "execution.remat",
    "model.remat_policy": "execution.remat",
    "model.scan_unroll": "execution.scan_unroll",
    **{f"model.pipeline_{field}": f"execution.pipeline.{field}"
       for field in ("schedule", "microbatches", "virtual_stages", "transfer")},
}


def moved_hint(field: str) -> str | None:
    """For an old dotted name, "FIELD moved to NEW" with how to set it; None for other names."""
    new = MOVED.get(field)
    if new is None:
        return None
    if field == "model.remat":
        return (f"{field} moved to {new}, which names a policy (arch.remat): use "
                f"--config.{new}=full for remat=True")
    return f"{field} moved to {new}; use --config.{new}=VALUE"


def _pop(tree: dict, path: str):
    *parents, name = path.split(".")
    for part in parents:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return None, False
    if name not in tree:
        return None, False
    return tree.pop(name), True


def _put(tree: dict, path: str, value) -> None:
    *parents, name = path.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[name] = value


def upgrade(saved: dict) -> dict:
    """A config as JSON data, with every old name of `MOVED` at its new place (a copy; a config
    in today's sections comes back equal). `model.remat` (a bool) and `model.remat_policy` (a
    name or None) become the one policy `execution.remat`."""
    saved = copy.deepcopy(saved)
    remat, had_remat = _pop(saved, "model.remat")
    policy, had_policy = _pop(saved, "model.remat_policy")
    if had_remat or had_policy:
        _put(saved, "execution.remat", policy or ("full" if remat else "none"))
    for old, new in MOVED.items():
        value, found = _pop(saved, old)
        if found:
            _put(saved, new, value)
    return saved
