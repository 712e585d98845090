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
    **{f"model.{choice}": f"model.{choice}.name"
       for choice in ("attention", "position", "norm", "ffn", "residual", "head")},
    **{f"model.{old}": f"model.{new}" for old, new in (
        ("num_heads", "attention.num_heads"), ("num_kv_heads", "attention.num_kv_heads"),
        ("head_dim", "attention.head_dim"), ("attention_width", "attention.width"),
        ("rope_base", "position.rope_base"), ("norm_eps", "norm.eps"),
        ("final_norm", "norm.final"), ("batchnorm_momentum", "norm.batchnorm_momentum"),
        ("dyt_alpha_init", "norm.dyt_alpha_init"), ("gated_norm_rank", "norm.gated_rank"),
        ("d_ff", "ffn.d_ff"), ("ffn_ratio", "ffn.ratio"), ("ffn_width", "ffn.width"),
        ("ffn_multiple_of", "ffn.multiple_of"), ("activation", "ffn.activation"),
        ("leaky_relu_slope", "ffn.leaky_relu_slope"), ("residual_streams", "residual.streams"),
        ("residual_dynamic", "residual.dynamic"), ("head_bias", "head.bias"),
        ("mos_components", "head.mos_components"), ("mos_tied", "head.mos_tied"))},
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
    if new is None or new.startswith(field + "."):  # a section now: apply_override says so
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
        if isinstance(value, dict):  # already a section (model.attention, model.norm, ...)
            _put(saved, old, value)
        elif found:
            _put(saved, new, value)
    return saved
