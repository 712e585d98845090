"""The option rules of the components that have options: a JAX-free function over the `model`
section for each, which its record in `config.catalogue` names and `config.resolve` runs (through
`config.model_rules.resolve_model`) when a config uses the component. A rule checks the
component's own config section, one line per error naming the field, the value and the fix, and
fills the section's derived fields. A record's `mesh_rules` are the rules that need the mesh
(`config.resolution`). Imports only `config`.
"""

from __future__ import annotations

from config import check, is_int

ATTNRES_WEIGHTS = ("softmax", "sigmoid", "static")  # arch.attnres
ATTNRES_QUERIES = ("static", "input")
GR_STATE_DTYPES = ("float32", "bfloat16", "float8_e4m3fn")  # arch.gated_residual
GR_INITS = ("graded", "random")


def divisors(n: int) -> list[int]:
    """The positive divisors of `n`, for "valid: ..." messages."""
    return [k for k in range(1, n + 1) if n % k == 0]


def positive_int(value) -> bool:
    """Whether `value` is an int (not a bool) above 0."""
    return is_int(value) and value > 0


# ---------------------------------------------------------------------------------------------
# Token mixers and feed-forward networks


def mla(cfg) -> None:
    """Multi-head latent attention fields (`arch.attention.MultiHeadLatentAttention`)."""
    mla = cfg.mla
    for field in ("nope_dim", "v_dim"):
        if mla[field] is None:
            mla[field] = cfg.attention.head_dim
    for field in ("kv_rank", "rope_dim", "nope_dim", "v_dim"):
        check(positive_int(mla[field]), f"model.mla.{field}", mla[field],
              "must be a positive integer")
    check(is_int(mla.q_rank) and mla.q_rank >= 0, "model.mla.q_rank", mla.q_rank,
          "must be a non-negative integer (0: full-rank query projection)")
    check(mla.rope_dim % 2 == 0, "model.mla.rope_dim", mla.rope_dim,
          "the decoupled rotary key/query width must be even (RoPE rotates feature pairs)")


def gated_deltanet(cfg) -> None:
    """Gated DeltaNet fields (`arch.deltanet.GatedDeltaNet`): `model.deltanet`'s heads and key
    width default to `model.attention`'s, its value width to its key width."""
    dn, attention = cfg.deltanet, cfg.attention
    for field, default in (("num_heads", attention.num_heads), ("head_dim", attention.head_dim)):
        if dn[field] is None:
            dn[field] = default
    if dn.value_dim is None:
        dn.value_dim = dn.head_dim
    for field in ("num_heads", "head_dim", "value_dim", "conv_width", "chunk"):
        check(positive_int(dn[field]), f"model.deltanet.{field}", dn[field],
              "must be a positive integer")


def gated_deltanet_mesh(cfg, mesh: dict[str, int]) -> None:
    """Gated DeltaNet's heads shard over `tensor`."""
    heads = cfg.deltanet.num_heads
    check(heads % mesh["tensor"] == 0, "model.deltanet.num_heads", heads,
          f"must be divisible by mesh.tensor={mesh['tensor']}")


# ---------------------------------------------------------------------------------------------
# The residual mechanisms' options (the mechanism: arch/<file> registering the name)


def attnres(cfg) -> None:
    """attnres, block_attnres (arch/attnres.py)."""
    section = cfg.attnres
    check(positive_int(section.block_size), "model.attnres.block_size", section.block_size,
          "must be an integer ≥ 1 (sublayers per block)")
    check(section.weights in ATTNRES_WEIGHTS, "model.attnres.weights", section.weights,
          f"valid: {', '.join(ATTNRES_WEIGHTS)}")
    check(section.query in ATTNRES_QUERIES, "model.attnres.query", section.query,
          f"valid: {', '.join(ATTNRES_QUERIES)}")
    check(section.query == "static" or section.weights != "static", "model.attnres.query",
          section.query,
          "static (input-independent) weights use no query; set model.attnres.query='static'"
          " or model.attnres.weights='softmax'/'sigmoid'")
    scale = section.query_scale
    check(scale > 0, "model.attnres.query_scale", scale, "must be positive")
    check(section.query == "input" or scale == 1, "model.attnres.query_scale", scale,
          "scales the input-dependent query only; set model.attnres.query='input'")
    heads, d = section.heads, cfg.d_model
    check(positive_int(heads) and d % heads == 0, "model.attnres.heads", heads,
          f"must divide model.d_model={d}; valid: {divisors(d)}")
    check(isinstance(section.key_norm, bool), "model.attnres.key_norm", section.key_norm,
          "must be True or False")
    check(is_int(section.window) and section.window >= 0, "model.attnres.window",
          section.window, "must be an integer ≥ 0 (0: every source)")


def streams(cfg) -> None:
    """width (arch/hyper.py)."""
    check(positive_int(cfg.residual.streams), "model.residual.streams", cfg.residual.streams,
          "must be a positive integer (the number of residual streams n)")


def hyper(cfg) -> None:
    """hc (arch/hyper.py)."""
    streams(cfg)
    check(isinstance(cfg.residual.dynamic, bool), "model.residual.dynamic", cfg.residual.dynamic,
          "must be True (static + input-dependent weights) or False (static only)")
    if cfg.residual.dynamic:
        check(cfg.hyper.dynamic_scale > 0, "model.hyper.dynamic_scale", cfg.hyper.dynamic_scale,
              "must be positive: with the zero-initialized projections a scale of 0 keeps the "
              "dynamic part at 0 forever; set model.residual.dynamic=False for static weights")


def mhc(cfg) -> None:
    """mhc (arch/hyper.py)."""
    hyper(cfg)
    check(positive_int(cfg.hyper.sinkhorn_iters), "model.hyper.sinkhorn_iters",
          cfg.hyper.sinkhorn_iters,
          "must be a positive integer (the most steps of the Sinkhorn projection)")
    tolerance = cfg.hyper.sinkhorn_tolerance
    check(isinstance(tolerance, int | float) and not isinstance(tolerance, bool)
          and 0 <= tolerance < 1, "model.hyper.sinkhorn_tolerance", tolerance,
          "must be a number in [0, 1): the largest |column sum − 1| of the mixing matrices "
          "(0: as close as float32 gets, in at most model.hyper.sinkhorn_iters steps)")


def gated_residual(cfg) -> None:
    """gated_residual (arch/gated_residual.py)."""
    n = cfg.residual.streams
    check(is_int(n) and n >= 2, "model.residual.streams", n,
          "gated_residual needs an integer n ≥ 2 branches (one branch: use "
          "residual='prenorm' with norm='gatednorm')")
    gr = cfg.gated_residual
    check(positive_int(gr.rank), "model.gated_residual.rank", gr.rank,
          "must be a positive integer (rank of the gate predictor)")
    check(gr.state_dtype in GR_STATE_DTYPES, "model.gated_residual.state_dtype", gr.state_dtype,
          f"valid: {', '.join(GR_STATE_DTYPES)}")
    check(isinstance(cfg.residual.dynamic, bool), "model.residual.dynamic",
          cfg.residual.dynamic, "must be a bool")
    for field in ("channelwise", "mixing", "static", "static_frozen"):
        check(isinstance(gr[field], bool), f"model.gated_residual.{field}", gr[field],
              "must be a bool")
    for field in ("channelwise_read", "channelwise_write"):
        check(gr[field] is None or isinstance(gr[field], bool),
              f"model.gated_residual.{field}", gr[field],
              "must be a bool, or None: follow model.gated_residual.channelwise")
    check(gr.static or cfg.residual.dynamic, "model.gated_residual.static", gr.static,
          "removing the static gate term needs model.residual.dynamic=True (with "
          "residual.dynamic=False the gates have no other term)")
    check(gr.static or not gr.static_frozen, "model.gated_residual.static_frozen",
          gr.static_frozen, "freezes the static gate logits, which "
          "model.gated_residual.static=False removes")
    check(gr.init in GR_INITS, "model.gated_residual.init", gr.init,
          f"valid: {', '.join(GR_INITS)}")
    check(gr.init == "graded" or gr.static, "model.gated_residual.init", gr.init,
          "initializes the static write logits, which model.gated_residual.static=False "
          "removes")
    k = gr.read_top_k
    check(is_int(k) and 0 <= k <= n, "model.gated_residual.read_top_k", k,
          f"must be an integer in [0, model.residual.streams={n}] (0: read all branches)")
