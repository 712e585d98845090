"""A minimal hand-written pure-JAX decoder LM: the oracle for tests and the baseline for benchmarks.

It shares no code with the modules in `arch/`: plain functions over the nested dict of parameter
arrays that `nnx.to_pure_dict(nnx.state(model, nnx.Param))` gives. It covers the foundation's
components (RMSNorm/LayerNorm, RoPE/learned/no positions, MHA/GQA/MQA, two-projection or SwiGLU
FFN, Pre-Norm residual sum or Attention Residuals (Full or Block, every `attnres_*` variant),
tied/untied head), so a test can check the framework against it and
`scripts/bench.py` can time a train step the framework does not touch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from config import lookup


def _norm(cfg, p, x):
    x32 = x.astype(jnp.float32)
    if cfg.norm.name == "layernorm":
        x32 = x32 - x32.mean(-1, keepdims=True)
        y = x32 / jnp.sqrt((x32**2).mean(-1, keepdims=True) + cfg.norm.eps)
        return (y * p["scale"] + p["bias"]).astype(x.dtype)
    y = x32 / jnp.sqrt((x32**2).mean(-1, keepdims=True) + cfg.norm.eps)
    return (y * p["scale"]).astype(x.dtype)


def _rope(cfg, x, t):
    if cfg.position.name != "rope":
        return x
    half = x.shape[-1] // 2
    freq = cfg.position.rope_base ** (-jnp.arange(half) / half)
    angle = t[:, None] * freq[None, :]                      # T × P/2
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def _attention(cfg, a, y, dtype):
    """Causal multi-head attention of the normalized input y."""
    b, t, _ = y.shape
    h, k = cfg.attention.num_heads, cfg.attention.num_kv_heads
    pos = jnp.arange(t)
    q = _rope(cfg, jnp.einsum("btd,dhp->bthp", y, a["query"]["kernel"].astype(dtype)), pos)
    kk = _rope(cfg, jnp.einsum("btd,dkp->btkp", y, a["key"]["kernel"].astype(dtype)), pos)
    v = jnp.einsum("btd,dkp->btkp", y, a["value"]["kernel"].astype(dtype))
    kk, v = jnp.repeat(kk, h // k, axis=2), jnp.repeat(v, h // k, axis=2)  # GQA: share KV heads
    s = jnp.einsum("bthp,bshp->bhts", q, kk).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    o = jnp.einsum("bhts,bshp->bthp", jax.nn.softmax(s, -1).astype(dtype), v)
    return jnp.einsum("bthp,hpd->btd", o, a["output"]["kernel"].astype(dtype))


def _ffn(cfg, f, y, dtype):
    if cfg.ffn.name == "swiglu":
        hid = jax.nn.silu(y @ f["gate"]["kernel"].astype(dtype)) * (y @ f["up"]["kernel"]
                                                                    .astype(dtype))
    else:
        act = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}[cfg.ffn.activation]
        hid = act(y @ f["up"]["kernel"].astype(dtype))
    return hid @ f["down"]["kernel"].astype(dtype)


def _block(cfg, x, p, dtype):
    x = x + _attention(cfg, p["attention"], _norm(cfg, p["attention_residual"]["norm"], x), dtype)
    return x + _ffn(cfg, p["ffn"], _norm(cfg, p["ffn_residual"]["norm"], x), dtype)


def _depth_read(cfg, sources, index, stream, projection):
    """AttnRes read of sublayer `index` (index = n: the final read), float32: Σ_j α_j v_j over
    `sources` (a list of B×T×D arrays, list position = source slot)."""
    heads, d = cfg.attnres.heads, cfg.d_model
    slots = list(range(len(sources)))
    if cfg.attnres.window:
        slots = slots[-cfg.attnres.window:]

    def split(x):  # B×T×D → B×T×H×(D/H), float32
        return x.astype(jnp.float32).reshape(*x.shape[:-1], heads, d // heads)

    def key(x):
        if not cfg.attnres.key_norm:
            return split(x)
        return split(x) / jnp.sqrt(jnp.mean(split(x) ** 2, -1, keepdims=True) + cfg.norm.eps)

    if cfg.attnres.weights == "static":
        table = stream["static_weights"][index]                       # slots × H
        weights = [jnp.broadcast_to(table[j], sources[0].shape[:2] + (heads,)) for j in slots]
    else:
        query = split(stream["pseudo_queries"][index][None, None])   # 1×1×H×K
        if projection is not None:  # the newest source, as a key, through W
            query = query + cfg.attnres.query_scale * split(
                key(sources[-1]).reshape(sources[-1].shape) @ projection["kernel"])
        scores = jnp.stack([(key(sources[j]) * query).sum(-1) for j in slots])  # n×B×T×H
        weights = (jax.nn.softmax(scores, 0) if cfg.attnres.weights == "softmax"
                   else jax.nn.sigmoid(scores))
    mixed = sum(w[..., None] * split(sources[j]) for w, j in zip(weights, slots, strict=True))
    return mixed.reshape(sources[0].shape)


def _attnres_stack(cfg, x, params, dtype):
    """Full/Block AttnRes over Python lists: `sources` holds the embedding and the completed
    block summaries, `partial` the current block's partial sum (None while empty)."""
    block_size = cfg.attnres.block_size if cfg.residual.name == "block_attnres" else 1
    stream = params["residual_stream"]
    sources, partial, index = [x], None, 0
    for layer in range(cfg.num_layers):
        p = jax.tree.map(lambda a, layer=layer: a[layer], params["blocks"])
        for name, sublayer in (("attention", _attention), ("ffn", _ffn)):
            residual = p[f"{name}_residual"]
            available = sources + ([] if partial is None else [partial])
            mixed = _depth_read(cfg, available, index, stream, residual.get("query_projection"))
            update = sublayer(cfg, p[name], _norm(cfg, residual["norm"], mixed.astype(dtype)),
                              dtype)
            partial = update if partial is None else partial + update
            index += 1
            if index % block_size == 0:  # the block is complete: its summary becomes a source
                sources, partial = sources + [partial], None
    available = sources + ([] if partial is None else [partial])
    return _depth_read(cfg, available, index, stream,
                       stream.get("final_query_projection")).astype(dtype)


SUPPORTED = {"attention.name": ("mha",), "norm.name": ("rmsnorm", "layernorm"),
             "ffn.name": ("mlp", "swiglu"), "ffn.activation": ("gelu", "relu", "silu"),
             "residual.name": ("prenorm", "attnres", "block_attnres"),
             "head.name": ("tied", "untied"), "position.name": ("rope", "learned", "none")}


def unsupported(cfg) -> str | None:
    """Why the reference cannot compute `cfg`'s model, or None if it can."""
    for field, choices in SUPPORTED.items():
        if (value := lookup(cfg, field)) not in choices:
            return (f"the reference model has no model.{field}={value!r}; it covers "
                    f"{', '.join(choices)}")
    if cfg.fixnorm or cfg.head.bias or cfg.linear_bias or not cfg.use_ffn or cfg.reversible:
        return ("the reference model covers neither fixnorm, head.bias, linear_bias, "
                "use_ffn=False nor reversible blocks")
    if cfg.attention.window:
        return ("the reference model has no sliding window (model.attention.window="
                f"{cfg.attention.window}); it attends fully causally")
    return None


def logits(cfg, params: dict, tokens_BxT: jax.Array, unrolled: bool = False) -> jax.Array:
    """Float32 logits of the Pre-Norm (or AttnRes) decoder described by `cfg` (a resolved model
    config). Initialization does not matter here (parameters come in), so `model.init` is
    ignored. The Pre-Norm blocks run in a `lax.scan` over the stacked layers, or with
    `unrolled`, a Python loop (one copy of the block per layer in the program); the AttnRes
    stack is a Python loop either way."""
    if reason := unsupported(cfg):
        raise ValueError(reason)
    dtype = jnp.dtype(cfg.dtype)
    table = params["embed"]["embedding"]
    x = table[tokens_BxT].astype(dtype)
    if cfg.position.name == "learned":
        x = x + params["position"]["table"][: tokens_BxT.shape[1]].astype(dtype)
    if cfg.residual.name == "prenorm" and unrolled:
        for layer in range(cfg.num_layers):
            x = _block(cfg, x, jax.tree.map(lambda a, layer=layer: a[layer], params["blocks"]),
                       dtype)
    elif cfg.residual.name == "prenorm":
        x, _ = jax.lax.scan(lambda x, p: (_block(cfg, x, p, dtype), None), x, params["blocks"])
    else:
        x = _attnres_stack(cfg, x, params, dtype)
    if cfg.norm.final:
        x = _norm(cfg, params["final_norm"], x)
    w = table.T if cfg.head.name == "tied" else params["head"]["output"]["kernel"]
    return (x @ w.astype(dtype)).astype(jnp.float32)


def loss(cfg, params, tokens_BxT1, unrolled: bool = False):
    lg = logits(cfg, params, tokens_BxT1[:, :-1], unrolled)
    return optax.softmax_cross_entropy_with_integer_labels(lg, tokens_BxT1[:, 1:]).mean()


def make_train_step(cfg, optimizer: optax.GradientTransformation, unrolled: bool = False):
    """A plain jitted AdamW step on the pure-dict parameters (buffers donated); `unrolled`: the
    layers in a Python loop (`logits`)."""

    def step(params, opt_state, tokens_BxT1):
        value, grads = jax.value_and_grad(lambda p: loss(cfg, p, tokens_BxT1, unrolled))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))
