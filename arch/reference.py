"""A minimal hand-written pure-JAX decoder LM: the oracle for tests and the baseline for benchmarks.

It shares no code with the modules in `arch/`: plain functions over the nested dict of parameter
arrays that `nnx.to_pure_dict(nnx.state(model, nnx.Param))` gives. It covers the foundation's
components (RMSNorm/LayerNorm, RoPE/learned/no positions, MHA/GQA/MQA, two-projection or SwiGLU
FFN, Pre-Norm residual sum, tied/untied head), so a test can check the framework against it and
`scripts/bench.py` can time a train step the framework does not touch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _norm(cfg, p, x):
    x32 = x.astype(jnp.float32)
    if cfg.norm == "layernorm":
        x32 = x32 - x32.mean(-1, keepdims=True)
        y = x32 / jnp.sqrt((x32**2).mean(-1, keepdims=True) + cfg.norm_eps)
        return (y * p["scale"] + p["bias"]).astype(x.dtype)
    y = x32 / jnp.sqrt((x32**2).mean(-1, keepdims=True) + cfg.norm_eps)
    return (y * p["scale"]).astype(x.dtype)


def _rope(cfg, x, t):
    if cfg.position != "rope":
        return x
    half = x.shape[-1] // 2
    freq = cfg.rope_base ** (-jnp.arange(half) / half)
    angle = t[:, None] * freq[None, :]                      # T × P/2
    cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def _block(cfg, x, p, dtype):
    b, t, _ = x.shape
    h, k = cfg.num_heads, cfg.num_kv_heads
    pos = jnp.arange(t)
    a = p["attention"]
    y = _norm(cfg, p["attention_residual"]["norm"], x)
    q = _rope(cfg, jnp.einsum("btd,dhp->bthp", y, a["query"]["kernel"].astype(dtype)), pos)
    kk = _rope(cfg, jnp.einsum("btd,dkp->btkp", y, a["key"]["kernel"].astype(dtype)), pos)
    v = jnp.einsum("btd,dkp->btkp", y, a["value"]["kernel"].astype(dtype))
    kk, v = jnp.repeat(kk, h // k, axis=2), jnp.repeat(v, h // k, axis=2)  # GQA: share KV heads
    s = jnp.einsum("bthp,bshp->bhts", q, kk).astype(jnp.float32) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    o = jnp.einsum("bhts,bshp->bthp", jax.nn.softmax(s, -1).astype(dtype), v)
    x = x + jnp.einsum("bthp,hpd->btd", o, a["output"]["kernel"].astype(dtype))
    f = p["ffn"]
    y = _norm(cfg, p["ffn_residual"]["norm"], x)
    if cfg.ffn == "swiglu":
        hid = jax.nn.silu(y @ f["gate"]["kernel"].astype(dtype)) * (y @ f["up"]["kernel"]
                                                                    .astype(dtype))
    else:
        act = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "silu": jax.nn.silu}[cfg.activation]
        hid = act(y @ f["up"]["kernel"].astype(dtype))
    return x + hid @ f["down"]["kernel"].astype(dtype)


SUPPORTED = dict(attention=("mha",), norm=("rmsnorm", "layernorm"), ffn=("mlp", "swiglu"),
                 activation=("gelu", "relu", "silu"), residual=("prenorm",),
                 head=("tied", "untied"), position=("rope", "learned", "none"))


def unsupported(cfg) -> str | None:
    """Why the reference cannot compute `cfg`'s model, or None if it can."""
    for field, choices in SUPPORTED.items():
        if cfg[field] not in choices:
            return (f"the reference model has no model.{field}={cfg[field]!r}; it covers "
                    f"{', '.join(choices)}")
    if cfg.fixnorm or cfg.head_bias or not cfg.use_ffn or cfg.reversible:
        return ("the reference model covers neither fixnorm, head_bias, use_ffn=False nor "
                "reversible blocks")
    return None


def logits(cfg, params: dict, tokens_BxT: jax.Array) -> jax.Array:
    """Float32 logits of the Pre-Norm decoder described by `cfg` (a resolved model config).
    Initialization does not matter here (parameters come in), so `model.init` is ignored."""
    if reason := unsupported(cfg):
        raise ValueError(reason)
    dtype = jnp.dtype(cfg.dtype)
    table = params["embed"]["embedding"]
    x = table[tokens_BxT].astype(dtype)
    if cfg.position == "learned":
        x = x + params["position"]["table"][: tokens_BxT.shape[1]].astype(dtype)
    x, _ = jax.lax.scan(lambda x, p: (_block(cfg, x, p, dtype), None), x, params["blocks"])
    if cfg.final_norm:
        x = _norm(cfg, params["final_norm"], x)
    w = table.T if cfg.head == "tied" else params["head"]["output"]["kernel"]
    return (x @ w.astype(dtype)).astype(jnp.float32)


def loss(cfg, params, tokens_BxT1):
    lg = logits(cfg, params, tokens_BxT1[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(lg, tokens_BxT1[:, 1:]).mean()


def make_train_step(cfg, optimizer: optax.GradientTransformation):
    """A plain jitted AdamW step on the pure-dict parameters (buffers donated)."""

    def step(params, opt_state, tokens_BxT1):
        value, grads = jax.value_and_grad(lambda p: loss(cfg, p, tokens_BxT1))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))
