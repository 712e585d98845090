"""The fused Pallas depth read (`arch.kernels.pallas_depth_read`, interpret mode on CPU) against
`softmax_read` and the naive `depth_read`: values and every gradient, static and input-dependent
queries, masked sources, a token count that is not a multiple of the tile, bf16 sources; and a
tiny AttnRes model with `execution.depth_read="pallas"` against "xla"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.kernels.depth_read import depth_read, softmax_read
from arch.kernels.pallas_depth_read import (
    SLAB_ELEMENTS,
    default_block_tokens,
    pallas_softmax_read,
)
from config import ConfigError, resolve
from tests.helpers import random_tokens, tiny_config, tiny_model

TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # separately compiled programs: float32 rounding
# The sources' cotangent α_j g + ∂z_j w sums terms of size ~1 that may cancel: float32 rounding
# of those terms, not of the result.
GRADIENT_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _perturb_parameters(model, scale: float = 0.1) -> None:
    """Every parameter moved off its initialization (pseudo-queries off zero)."""
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(5), len(leaves))
    nnx.update(model, jax.tree.unflatten(tree, [
        leaf + scale * jax.random.normal(key, leaf.shape)
        for leaf, key in zip(leaves, keys, strict=True)]))


def _inputs(query: str, dtype=jnp.float32, shape=(2, 5, 3, 6)):
    """Query (D or B×T×D), sources B×T×N×D, inverse RMS B×T×N, valid N (the middle source
    masked), a cotangent B×T×D."""
    batch, length, count, width = shape
    keys = jax.random.split(jax.random.key(0), 4)
    sources = jax.random.normal(keys[0], shape).astype(dtype)
    inverse = jax.random.uniform(keys[1], shape[:3], minval=0.5, maxval=2.0)
    query_shape = (width,) if query == "static" else (batch, length, width)
    query = 2.0 * jax.random.normal(keys[2], query_shape)
    valid = jnp.arange(count) != 1
    return query, sources, inverse, valid, jax.random.normal(keys[3], (batch, length, width))


def _value_and_cotangents(read, query, sources, inverse, valid, cotangent):
    out, vjp = jax.vjp(lambda q, s, r: read(q, s, r, valid), query, sources, inverse)
    return out, vjp(cotangent)


def _fused(block_tokens=None):
    return lambda q, s, r, v: pallas_softmax_read(q, s, r, v, block_tokens=block_tokens)


@pytest.mark.parametrize("query", ["static", "input"])
def test_lowers_for_gpu_through_triton(query):
    """Forward and backward lower for CUDA (on this CPU host, no GPU needed) to two Triton
    kernels: the padded block shapes pass Pallas's Triton lowering (compiling the Triton IR
    itself needs a GPU)."""
    query_, sources, inverse, valid, cotangent = _inputs(query, dtype=jnp.bfloat16)

    def read_and_cotangents(q, s, r, g):
        out, vjp = jax.vjp(lambda q, s, r: pallas_softmax_read(q, s, r, valid, interpret=False,
                                                                block_tokens=4), q, s, r)
        return out, vjp(g)

    text = jax.jit(read_and_cotangents).trace(query_, sources, inverse, cotangent).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("@__gpu$xla.gpu.triton(") == 2


@pytest.mark.parametrize("query", ["static", "input"])
def test_fused_read_and_its_gradients_equal_softmax_read(query):
    """10 tokens in tiles of 4 (the last tile padded), N = 3 and D = 6 padded to 4 and 8, the
    middle source masked."""
    inputs = _inputs(query)
    out, cotangents = _value_and_cotangents(_fused(block_tokens=4), *inputs)
    expected_out, expected = _value_and_cotangents(softmax_read, *inputs)
    assert out.dtype == jnp.float32 and out.shape == expected_out.shape
    np.testing.assert_allclose(out, expected_out, **TOLERANCE)
    for name, got, want in zip(("query", "sources", "inverse_rms"), cotangents, expected,
                               strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        np.testing.assert_allclose(got, want, **GRADIENT_TOLERANCE, err_msg=name)
    assert np.abs(cotangents[1][:, :, 1]).max() == 0  # a masked source gets no gradient
    query_, sources, inverse, valid, _ = inputs
    naive, _ = depth_read(query_, sources, inverse[..., None], valid, heads=1)
    np.testing.assert_allclose(out, naive, **TOLERANCE)


def test_default_tile_one_tile_and_unpadded_shapes():
    """Default tile (all 40 tokens in one program) on power-of-two N and D (no padding), and a
    tile of one token; both equal `softmax_read`."""
    inputs = _inputs("input", shape=(2, 20, 4, 8))
    expected_out, expected = _value_and_cotangents(softmax_read, *inputs)
    assert default_block_tokens(40, 4, 8) == 64
    for block_tokens in (None, 1):
        out, cotangents = _value_and_cotangents(_fused(block_tokens), *inputs)
        np.testing.assert_allclose(out, expected_out, **TOLERANCE)
        for got, want in zip(cotangents, expected, strict=True):
            np.testing.assert_allclose(got, want, **GRADIENT_TOLERANCE)


def test_bf16_sources():
    """bf16 sources, float32 accumulation: the read equals `softmax_read` to float32 rounding;
    the sources' cotangent is bf16 (as `softmax_read`'s), equal to one bf16 rounding."""
    inputs = _inputs("static", dtype=jnp.bfloat16)
    out, cotangents = _value_and_cotangents(_fused(block_tokens=8), *inputs)
    expected_out, expected = _value_and_cotangents(softmax_read, *inputs)
    assert out.dtype == jnp.float32 and cotangents[1].dtype == jnp.bfloat16
    np.testing.assert_allclose(out, expected_out, **TOLERANCE)
    np.testing.assert_allclose(cotangents[0], expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cotangents[1].astype(jnp.float32),
                               expected[1].astype(jnp.float32), rtol=1e-2, atol=1e-6)
    np.testing.assert_allclose(cotangents[2], expected[2], **GRADIENT_TOLERANCE)


def test_tile_sizes():
    """A power of two, its padded slab within `SLAB_ELEMENTS`, never more than the tokens need;
    any other tile is refused."""
    for tokens, count, width in ((10, 3, 6), (4096, 17, 256), (1, 1, 1), (300, 9, 4096)):
        tile = default_block_tokens(tokens, count, width)
        assert tile & (tile - 1) == 0 and tile < 2 * tokens
        padded = (1 << (count - 1).bit_length()) * (1 << (width - 1).bit_length())
        assert tile == 1 or tile * padded <= SLAB_ELEMENTS
    with pytest.raises(ValueError, match="block_tokens=3 must be a power of two"):
        pallas_softmax_read(*_inputs("static")[:4], block_tokens=3)


@pytest.mark.slow
def test_model_loss_and_gradients_equal_with_the_pallas_read():
    """Full AttnRes (every read a one-head softmax read with a static pseudo-query), parameters
    off their initialization: loss and every gradient equal under execution.depth_read "pallas"
    and "xla"."""
    tokens = random_tokens((2, 6))
    overrides = dict(residual="attnres", num_layers=1)

    def loss_and_grads(depth_read):
        _, model = tiny_model(execution__depth_read=depth_read, **overrides)
        _perturb_parameters(model)

        def loss(model):
            logits = model(tokens[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None],
                                                 -1))

        value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
        return value, nnx.state(grads, nnx.Param)

    (loss_xla, grads_xla), (loss_pallas, grads_pallas) = map(loss_and_grads, ("xla", "pallas"))
    np.testing.assert_allclose(loss_pallas, loss_xla, **TOLERANCE)
    flat_xla, flat_pallas = jax.tree.leaves(grads_xla), jax.tree.leaves(grads_pallas)
    assert len(flat_xla) == len(flat_pallas)
    for got, want in zip(flat_pallas, flat_xla, strict=True):
        np.testing.assert_allclose(got, want, **GRADIENT_TOLERANCE)


def test_model_uses_the_pallas_read(monkeypatch):
    """The setting reaches every read: with "pallas", `softmax_read` is never traced."""
    import arch.attnres

    def refuse(*args):
        raise AssertionError("softmax_read traced with execution.depth_read='pallas'")

    calls = []
    monkeypatch.setattr(arch.attnres, "softmax_read", refuse)
    monkeypatch.setattr(arch.attnres, "pallas_softmax_read",
                        lambda *args: calls.append("pallas") or softmax_read(*args))
    _, model = tiny_model(residual="attnres", num_layers=1, execution__depth_read="pallas")
    model(random_tokens((1, 4)))
    assert calls and set(calls) == {"pallas"}


def test_unknown_depth_read_is_a_one_line_config_error():
    config = tiny_config(residual="attnres", execution__depth_read="triton")
    with pytest.raises(ConfigError) as error:
        resolve(config, 1)
    assert str(error.value) == "execution.depth_read='triton' is invalid: valid: xla, pallas"
