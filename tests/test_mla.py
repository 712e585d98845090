"""Multi-head latent attention (DeepSeek-V2 §2.1.2–2.1.3): equations, latent KV cache, sharding."""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from arch.attention import MultiHeadAttention, MultiHeadLatentAttention
from arch.model import TransformerLM
from arch.positions import POSITIONS
from config import ConfigError, resolve
from sharding.mesh import make_mesh
from sharding.rules import LOGICAL_RULES
from tests.helpers import random_tokens, tiny_config
from train.step import TrainProgram, next_token_loss

# d = 32, H = 4, attention__head_dim = 8: a latent of 16 + a rotary key of 8 per token and layer.
MLA = dict(attention="mla", mla__kv_rank=16, mla__rope_dim=8)


def _rms(x, gain, eps):
    return x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + eps) * gain


def _rope(x_BxTxHxR, positions_BxT, base):
    half = x_BxTxHxR.shape[-1] // 2
    angle = positions_BxT[:, :, None, None] * base ** (-jnp.arange(half) / half)
    x1, x2 = x_BxTxHxR[..., :half], x_BxTxHxR[..., half:]
    return jnp.concatenate([x1 * jnp.cos(angle) - x2 * jnp.sin(angle),
                            x2 * jnp.cos(angle) + x1 * jnp.sin(angle)], -1)


def reference_mla(cfg, p, x_BxTxD, positions_BxT):
    """DeepSeek-V2 eqs. 9–19 in plain jnp, from the module's parameter dict (float32)."""
    rope = ((lambda x: _rope(x, positions_BxT,
                             cfg.position.rope_base)) if cfg.position.name == "rope"
            else (lambda x: x))
    if cfg.mla.q_rank:
        c_q = _rms(x_BxTxD @ p["query_down"]["kernel"], p["query_norm"]["scale"], cfg.norm.eps)
    else:
        c_q = x_BxTxD
    q_nope = jnp.einsum("btc,chn->bthn", c_q, p["query_up"]["kernel"])                # eq. 13
    q_rope = rope(jnp.einsum("btc,chr->bthr", c_q, p["query_rope"]["kernel"]))        # eq. 14
    c_kv = _rms(x_BxTxD @ p["kv_down"]["kernel"], p["kv_norm"]["scale"], cfg.norm.eps)  # eq. 9
    k_nope = jnp.einsum("bsc,chn->bshn", c_kv, p["key_up"]["kernel"])                 # eq. 10
    v = jnp.einsum("bsc,chv->bshv", c_kv, p["value_up"]["kernel"])                    # eq. 11
    k_rope = rope((x_BxTxD @ p["key_rope"]["kernel"])[:, :, None])[:, :, 0]           # eq. 15
    # eqs. 16–18: [q^C; q^R]·[k^C; k^R] = q^C·k^C + q^R·k^R, the rotary key shared by all heads
    scores = (jnp.einsum("bthn,bshn->bhts", q_nope, k_nope)
              + jnp.einsum("bthr,bsr->bhts", q_rope, k_rope)) / np.sqrt(
                  cfg.mla.nope_dim + cfg.mla.rope_dim)
    t = x_BxTxD.shape[1]
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
    out = jnp.einsum("bhts,bshv->bthv", jax.nn.softmax(scores, -1), v)
    return jnp.einsum("bthv,hvd->btd", out, p["output"]["kernel"])                    # eq. 19


def resolved(**overrides):
    config = tiny_config(**{**MLA, **overrides})
    config = resolve(config, 1)
    return ml_collections.FrozenConfigDict(config.model)


def mla_module(seed=0, **overrides):
    """(resolved model config, one MLA layer, the position module)."""
    cfg = resolved(**overrides)
    return (cfg, MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(seed)),
            POSITIONS[cfg.position.name](cfg, rngs=nnx.Rngs(0)))


@nnx.jit
def attend(attention, position, x_BxTxD, positions_BxT, cache=None):
    return attention(x_BxTxD, positions_BxT, position.rotate, cache)


forward = nnx.jit(lambda model, tokens: model(tokens))
decode = nnx.jit(lambda model, tokens, positions, cache: model.decode(tokens, positions, cache))


@pytest.fixture(scope="module")
def sharded():
    """A TrainProgram for the tiny MLA LM (low-rank queries) on a data=2 × fsdp=2 × tensor=2 mesh
    of the 8 devices, its initial state, and the same parameters as a one-device model (shared by
    the model-level tests, so the model is initialized only once)."""
    config = tiny_config(**MLA, mla__q_rank=12)
    config.mesh.update(data=2, fsdp=2, tensor=2)
    config = resolve(config, 8)
    program = TrainProgram(config, make_mesh(config, jax.devices()))
    state = program.init(0)
    cfg = ml_collections.FrozenConfigDict(config.model)
    abstract = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, _, rest = nnx.split(abstract, nnx.Param, ...)
    return program, state, nnx.merge(graphdef, jax.device_get(state["params"]), rest)


@pytest.fixture
def model(sharded):
    return sharded[2]


def inputs(t=12, seed=3):
    x = jax.random.normal(jax.random.key(seed), (2, t, 32))
    return x, jnp.broadcast_to(jnp.arange(t), (2, t))


@pytest.mark.parametrize("overrides", [
    dict(), dict(mla__nope_dim=6, mla__v_dim=12, mla__q_rank=12), dict(position="none"),
], ids=["full-rank-q", "low-rank-q-N!=V", "no-positions"])
def test_matches_the_equations(overrides):
    cfg, attention, position = mla_module(**overrides)
    x, positions = inputs()
    params = nnx.to_pure_dict(nnx.state(attention, nnx.Param))
    y, cache = attend(attention, position, x, positions)
    assert cache is None and y.shape == x.shape
    expected = jax.jit(reference_mla, static_argnums=0)(cfg, params, x, positions)
    np.testing.assert_allclose(y, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_geometry_defaults_and_logical_axes(model):
    cfg = model.cfg
    assert cfg.mla.nope_dim == cfg.mla.v_dim == cfg.attention.head_dim == 8  # defaults: head_dim
    a = model.blocks.attention  # stacked: leading layers axis
    d, h, c, c_q, r, p = 32, 4, 16, 12, 8, 8
    shapes = dict(query_down=(d, c_q), query_up=(c_q, h, p), query_rope=(c_q, h, r),
                  kv_down=(d, c), key_up=(c, h, p), value_up=(c, h, p), key_rope=(d, r),
                  output=(h, p, d))
    for name, shape in shapes.items():
        assert getattr(a, name).kernel.shape == (2, *shape), name
    assert a.kv_norm.scale.shape == (2, c) and a.query_norm.scale.shape == (2, c_q)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == variable[...].ndim and all(n in LOGICAL_RULES for n in names), path


def test_cache_stores_the_latent_and_the_shared_rotary_key_only(model):
    cfg = model.cfg
    cache = model.init_cache(3, 16)
    assert {k: v.shape for k, v in cache.items()} == {"latent": (2, 3, 16, 16),
                                                      "rope_key": (2, 3, 16, 8)}
    per_token_per_layer = sum(np.prod(v.shape) for v in cache.values()) // (2 * 3 * 16)
    assert per_token_per_layer == cfg.mla.kv_rank + cfg.mla.rope_dim == 24
    mha = ml_collections.ConfigDict(cfg.to_dict())
    mha.attention.num_kv_heads = mha.attention.num_heads
    mha_per_token = sum(np.prod(s[2:]) for s in MultiHeadAttention.cache_shapes(mha, 1, 1)
                        .values())
    mha_width = cfg.attention.num_heads * cfg.attention.head_dim
    assert mha_per_token == 2 * mha_width == 64 > per_token_per_layer


@pytest.mark.parametrize("absorb", [False, True], ids=["up-project", "absorbed"])
def test_kv_cache_decoding_equals_the_full_forward_pass(model, absorb):
    tokens = random_tokens((2, 12))
    full = forward(model, tokens)
    model.blocks.attention.absorb = absorb  # as model.mla.absorb would set it
    try:
        cache = model.init_cache(2, 16)
        positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
        prefill, cache = decode(model, tokens[:, :7], positions[:, :7], cache)
        steps = [prefill]
        for t in range(7, 12):
            logits, cache = decode(model, tokens[:, t:t + 1], positions[:, t:t + 1], cache)
            steps.append(logits)
    finally:
        model.blocks.attention.absorb = False
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=2e-5, rtol=1e-5)


def test_mla_absorb_config_selects_the_absorbed_form():
    for absorb in (False, True):
        cfg = resolved(mla__absorb=absorb)
        abstract = nnx.eval_shape(lambda cfg=cfg: MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(0)))
        assert abstract.absorb is absorb


def test_absorbed_attention_equals_up_projection_on_the_same_cache():
    cfg, attention, position = mla_module(mla__nope_dim=6, mla__v_dim=12, mla__q_rank=12)
    x, positions = inputs()
    cache = {name: jnp.zeros(shape) for name, shape in
             MultiHeadLatentAttention.cache_shapes(cfg, 2, 16).items()}
    _, cache = attend(attention, position, x[:, :9], positions[:, :9], cache)
    simple, simple_cache = attend(attention, position, x[:, 9:], positions[:, 9:], cache)
    attention.absorb = True
    absorbed, absorbed_cache = attend(attention, position, x[:, 9:], positions[:, 9:], cache)
    np.testing.assert_allclose(absorbed, simple, atol=2e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 absorbed_cache, simple_cache)
    np.testing.assert_allclose(simple, attend(attention, position, x, positions)[0][:, 9:],
                               atol=2e-5, rtol=1e-5)


def test_scores_depend_on_relative_positions_only():
    _, attention, position = mla_module()
    x, positions = inputs()
    y = attend(attention, position, x, positions)[0]
    np.testing.assert_allclose(attend(attention, position, x, positions + 37)[0], y, atol=2e-5)
    assert not np.allclose(attend(attention, position, x, 2 * positions)[0], y, atol=1e-3)


def test_causality_future_tokens_leave_the_past_exactly_unchanged(model):
    tokens = random_tokens((2, 12))
    changed = tokens.at[:, 7:].set((tokens[:, 7:] + 7) % 256)
    before, after = forward(model, tokens), forward(model, changed)
    np.testing.assert_array_equal(before[:, :7], after[:, :7])
    assert not np.allclose(before[:, 7:], after[:, 7:])


@pytest.mark.parametrize("field,value,message", [
    ("mla__kv_rank", 0, "must be a positive integer"),
    ("mla__q_rank", -1, "must be a non-negative integer (0: full-rank query projection)"),
    ("mla__rope_dim", 0, "must be a positive integer"),
    ("mla__rope_dim", 6 + 1, "must be even"),
    ("mla__nope_dim", 0, "must be a positive integer"),
    ("mla__v_dim", -8, "must be a positive integer"),
])
def test_config_errors(field, value, message):
    config = tiny_config(**{**MLA, field: value})
    name = "model." + field.replace("__", ".")
    with pytest.raises(ConfigError, match=re.escape(f"{name}={value} is invalid: ")) as e:
        config = resolve(config, 1)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_sharded_train_step_equals_single_device(sharded):
    program, state, single = sharded
    attention = state["params"]["blocks"]["attention"]
    # heads over tensor, d over fsdp (leading axis: layers): the MLA projections really shard
    assert tuple(attention["key_up"]["kernel"][...].sharding.spec) == (None, None, "tensor", None)
    assert tuple(attention["kv_down"]["kernel"][...].sharding.spec) == (None, "fsdp", None)
    tokens = np.asarray(random_tokens((8, 17)))
    _, metrics = program.train_step(state, program.put_batch(tokens))
    loss, grads = nnx.jit(nnx.value_and_grad(  # one device, the same initial parameters
        lambda model: next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])))(single)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(grads), rtol=1e-5)
