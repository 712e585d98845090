"""Attention Residuals (Full and Block): the pure-JAX oracle, uniform start, boundary rules by a
probe, two-phase inference against the naive read, gradients and config errors."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch import reference
from arch.attnres import AttentionResidual, AttnResStream, BlockAttentionResidual
from arch.kernels.block_scan import unit_state
from arch.kernels.depth_read import depth_read, inverse_rms, softmax_read, two_phase_reads
from config import ConfigError, resolve
from sharding.mesh import make_mesh
from tests.helpers import prefill_then_decode, random_tokens, tiny_config, tiny_model
from train.step import TrainProgram


def perturb_parameters(model, scale: float = 0.1, seed: int = 5) -> None:
    """Move every parameter off its initialization (pseudo-queries off zero, static weights off
    one), so that the depth mixing is not uniform."""
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [leaf + scale * jax.random.normal(key, leaf.shape)
             for leaf, key in zip(leaves, keys, strict=True)]
    nnx.update(model, jax.tree.unflatten(tree, moved))


ORACLE_CASES = {  # Block S=1: test_block_of_one_sublayer_is_full_attnres_exactly
    "full": dict(residual="attnres"),
    "block-S2": dict(residual="block_attnres", attnres__block_size=2),
    "block-S3-ragged-input-query-heads": dict(  # blocks of 3 and 1 sublayers
        residual="block_attnres", attnres__block_size=3, attnres__query="input", attnres__heads=4,
        attnres__query_scale=0.5, norm="layernorm"),
    "block-N1-static-window-heads": dict(  # S ≥ n = 4 sublayers: one block
        residual="block_attnres", attnres__block_size=5, attnres__weights="static",
        attnres__window=2, attnres__heads=2),
    "full-sigmoid-window-rawkeys": dict(residual="attnres", attnres__weights="sigmoid",
                                        attnres__window=2, attnres__key_norm=False),
}


@pytest.mark.parametrize("case", ORACLE_CASES.values(), ids=ORACLE_CASES.keys())
@pytest.mark.slow
def test_matches_the_list_of_sources_reference(case):
    cfg, model = tiny_model(**case)
    perturb_parameters(model)
    tokens = random_tokens((2, 8))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    expected = jax.jit(functools.partial(reference.logits, cfg))(params, tokens)
    np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(model, tokens), expected, atol=1e-4,
                               rtol=1e-5)


def test_block_of_one_sublayer_is_full_attnres_exactly():
    _, full = tiny_model(residual="attnres")
    _, block = tiny_model(residual="block_attnres", attnres__block_size=1)
    perturb_parameters(full)
    perturb_parameters(block)
    both = nnx.jit(lambda full, block, tokens: (full(tokens), block(tokens)))
    np.testing.assert_allclose(*both(full, block, random_tokens((2, 8))), rtol=1e-5, atol=1e-5)


def test_zero_pseudo_queries_give_uniform_recorded_weights():
    block_size = 2
    cfg, model = tiny_model(residual="block_attnres", attnres__block_size=block_size)
    _, intermediates = nnx.capture(model, nnx.Intermediate)(random_tokens((2, 8)))
    recorded = nnx.to_pure_dict(intermediates)
    attention = recorded["blocks"]["attention_residual"]["depth_weights"][0]  # layers × slots
    ffn = recorded["blocks"]["ffn_residual"]["depth_weights"][0]
    reads = [row for pair in zip(attention, ffn, strict=True) for row in pair]
    reads.append(recorded["residual_stream"]["depth_weights"][0])  # the final read
    for index, weights in enumerate(reads):
        sources = -(-index // block_size) + 1  # embedding + ⌈l/S⌉ summaries or partial sums
        expected = np.zeros(len(weights))
        expected[:sources] = 1 / sources
        np.testing.assert_allclose(weights, expected, atol=1e-6, err_msg=f"read {index}")


@pytest.mark.parametrize("block_size", [1, 3, 8, 20], ids=["full", "S3", "S-eq-n", "N1"])
def test_boundary_rules_every_output_lands_in_exactly_one_source(block_size):
    """Embedding e₀ and outputs u₁ … u₈ are distinct basis vectors; with the identity norm and
    zero pseudo-queries every read is the plain mean of its sources, so each read's coefficients
    show which outputs it sees and how many sources there are."""
    config = tiny_config(residual="block_attnres", attnres__block_size=block_size, norm="none",
                         num_layers=4)
    config = resolve(config, 1)
    cfg = config.model
    n, d = 8, cfg.d_model
    stream = BlockAttentionResidual.stream(cfg, rngs=nnx.Rngs(0))
    mechanism = BlockAttentionResidual(cfg, rngs=nnx.Rngs(0))
    basis = jnp.eye(d)[:, None, None, :]  # d × B=1 × T=1 × D

    @nnx.jit
    def drive(stream, mechanism):
        """Every read (the last one: the final read) and the source buffer it saw."""
        reads, buffers = [], []
        state = stream.begin(basis[0])
        for index in range(n + 1):
            reads.append((mechanism.read(state) if index < n else stream.end(state))[0, 0])
            buffers.append(state["sources"][0, 0].reshape(-1, d))  # slots × D: coefficients
            if index < n:
                state = mechanism.write(state, basis[index + 1])
        return reads, buffers

    for index, (read, buffer) in enumerate(zip(*drive(stream, mechanism), strict=True)):
        block, position = divmod(index, block_size)
        sources = 1 + block + (position > 0)  # an empty partial sum is not a source
        expected = np.zeros(d)
        expected[:index + 1] = 1 / sources  # e₀ and u₁ … u_l once each; u_{l+1} not yet
        np.testing.assert_allclose(read, expected, atol=1e-6, err_msg=f"read {index}")
        assert np.all((buffer == 0) | (buffer == 1)), "a coefficient other than 0 or 1"
        np.testing.assert_array_equal(buffer[:, :index + 1].sum(0), 1)  # exactly one source each
        assert buffer[:, index + 1:].sum() == 0  # later outputs nowhere yet
        assert buffer[0, 0] == 1 and buffer[0, 1:].sum() == 0  # e₀ alone in slot 0


@pytest.mark.parametrize("key_norm,heads", [(True, 1), (False, 2), (True, 2)])
def test_two_phase_reads_and_their_gradients_equal_the_naive_reads(key_norm, heads):
    block, completed, shape = 4, 3, (2, 5, 16)
    rng = np.random.default_rng(0)
    queries = 2 * rng.standard_normal((block, shape[-1]), np.float32)
    scales = np.arange(1, completed + 3, dtype=np.float32)[:, None]
    sources = rng.standard_normal((*shape[:2], completed + 2, shape[-1]), np.float32) * scales
    outputs = rng.standard_normal((block, *shape), np.float32)
    probe = rng.standard_normal((block, *shape), np.float32)

    def reads(two_phase, queries, sources, outputs):
        partials = jnp.concatenate([jnp.zeros((1, *shape)), jnp.cumsum(outputs, 0)[:-1]])
        inverse = inverse_rms(sources, heads, 1e-6) if key_norm else None
        valid = jnp.arange(completed + 2) < completed  # two padding slots that must stay out
        if two_phase:
            return two_phase_reads(queries, sources, inverse, valid, partials, heads, 1e-6)
        partial_inverse = inverse_rms(partials, heads, 1e-6) if key_norm else None
        naive = []
        for i in range(block):
            available = jnp.concatenate([sources[:, :, :completed], partials[i][:, :, None]], 2)
            available_inverse = None if inverse is None else jnp.concatenate(
                [inverse[:, :, :completed], partial_inverse[i][:, :, None]], 2)
            naive.append(depth_read(queries[i], available, available_inverse,
                                    jnp.arange(completed + 1) < completed + (i > 0), heads)[0])
        return jnp.stack(naive)

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_grads(two_phase, *inputs):
        loss = lambda *x: jnp.sum(probe * reads(two_phase, *x))
        return reads(two_phase, *inputs), jax.grad(loss, (0, 1, 2))(*inputs)

    inputs = queries, sources, outputs
    fast, naive = value_and_grads(True, *inputs), value_and_grads(False, *inputs)
    chex.assert_trees_all_close(fast, naive, atol=5e-5, rtol=1e-4)


def test_a_read_in_an_opened_block_keeps_only_its_inputs_for_the_backward_pass():
    """The merge and the norm after it are recomputed in the backward pass: of the B×T×D
    arrays, the read's VJP keeps only the phase-1 read c and the partial sum p (autodiff kept
    the merged read and three arrays of the norm as well)."""
    config = tiny_config(residual="block_attnres", attnres__block_size=2)
    config = resolve(config, 1)
    graphdef, params = nnx.split(BlockAttentionResidual(config.model, rngs=nnx.Rngs(0)))
    shape = (2, 5, config.model.d_model)
    keys = jax.random.split(jax.random.key(0), 3)
    queries = jax.random.normal(keys[0], (5, shape[-1]))
    lse = jax.random.normal(keys[1], (*shape[:2], 1))
    read, partial = jax.random.normal(keys[2], (2, *shape))

    def merged(read, partial):
        state = unit_state(queries, ((lse, read),), jnp.int32(1), partial, False)
        return nnx.merge(graphdef, params).read(state)

    _, vjp = jax.vjp(merged, read, partial)
    kept = [leaf for leaf in jax.tree.leaves(vjp) if leaf.shape == shape]
    assert len(kept) == 2 and all(any(leaf is x for x in (read, partial)) for leaf in kept)


@pytest.mark.parametrize("query_shape", [(16,), (2, 5, 16)], ids=["static", "input"])
def test_hand_written_read_gradient_equals_autodiff(query_shape):
    rng = np.random.default_rng(1)
    query = rng.standard_normal(query_shape, np.float32)
    sources = rng.standard_normal((2, 5, 4, 16), np.float32)
    inverse = rng.random((2, 5, 4), np.float32) + 0.5
    valid = jnp.arange(4) < 3
    probe = rng.standard_normal((2, 5, 16), np.float32)

    def loss(read):
        return lambda q, v, r: jnp.sum(probe * read(q, v, r))

    fast = loss(lambda q, v, r: softmax_read(q, v, r, valid))
    naive = loss(lambda q, v, r: depth_read(q, v, r[..., None], valid, 1)[0])
    grads = jax.jit(lambda *a: (jax.grad(fast, (0, 1, 2))(*a), jax.grad(naive, (0, 1, 2))(*a)))
    for fast_grad, naive_grad in zip(*grads(query, sources, inverse), strict=True):
        np.testing.assert_allclose(fast_grad, naive_grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size,units_per_block", [(2, 1), (4, 2), (3, None)])
@pytest.mark.slow
def test_two_phase_when_blocks_align_with_layers_and_decoding_equals_the_forward_pass(
        block_size, units_per_block, monkeypatch):
    """Blocks of whole layers (2 sublayers each) run two-phase, one block per scan step, in
    training and decoding; blocks of 3 sublayers (3 and 1 here) keep the naive read."""
    cfg, model = tiny_model(residual="block_attnres", attnres__block_size=block_size)
    assert model.residual_stream.units_per_block(cfg.num_layers) == units_per_block
    perturb_parameters(model)
    scanned = []
    scan_blocks = AttnResStream.scan
    monkeypatch.setattr(AttnResStream, "scan",
                        lambda self, *args: scanned.append(1) or scan_blocks(self, *args))
    tokens = random_tokens((2, 6))
    forward = nnx.jit(lambda m, t: m(t))(model, tokens)
    decoded = nnx.jit(prefill_then_decode, static_argnums=(2, 3))(model, tokens, 5, 6)
    assert len(scanned) == (0 if units_per_block is None else 3)  # traced once per program
    np.testing.assert_allclose(decoded, forward, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(forward, jax.jit(functools.partial(reference.logits, cfg))(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)), tokens), atol=1e-4, rtol=1e-5)


GROUPED_CASES = {  # every one runs one AttnRes block per step of the layer scan
    "S2": dict(attnres__block_size=2),
    "S4-heads-rawkeys-remat": dict(attnres__block_size=4, attnres__heads=2,
                                   attnres__key_norm=False, execution__remat="full"),
    "S4-moe-every-2": dict(attnres__block_size=4, ffn="moe", moe__every=2, moe__experts=4),
    "S2-batchnorm-learned-positions": dict(attnres__block_size=2, norm="batchnorm",
                                           position="learned"),
}


@pytest.mark.parametrize("case", GROUPED_CASES.values(), ids=GROUPED_CASES.keys())
@pytest.mark.slow
def test_block_scan_gradient_equals_autodiff_of_the_naive_reads(case, monkeypatch):
    """The hand-written gradient of the layer scan over AttnRes blocks (`_block_scan`: no
    buffer saved per step, phase 1's sources read from the final buffer) against autodiff of the
    unit-by-unit scan with naive reads: the train step's loss (MoE auxiliary losses included),
    every parameter gradient and the model state it writes (BatchNorm statistics)."""
    config = tiny_config(residual="block_attnres", **case)
    config = resolve(config, 1)
    program = TrainProgram(config, make_mesh(config, jax.devices()[:1]))
    state = program.init(0)
    model = nnx.merge(program.graphdef, state["params"], state["model_state"])
    perturb_parameters(model)
    params = nnx.state(model, nnx.Param)
    tokens = random_tokens((8, 17))

    def loss_and_grads():  # traced anew on each call
        return jax.jit(lambda *args: program._loss_and_grads(*args))(
            params, state["model_state"], tokens)

    grouped = loss_and_grads()
    monkeypatch.setattr(AttnResStream, "units_per_block", lambda self, units: None)
    naive = loss_and_grads()
    chex.assert_trees_all_close(grouped, naive, atol=2e-5, rtol=2e-4)


def test_pseudo_query_gradients_one_source_has_none():
    """The first read has a single source (the embedding), so its softmax is constant and its
    pseudo-query gets no gradient (to rounding: the two-phase read normalizes its
    weights itself); every later pseudo-query learns from step one."""
    _, model = tiny_model(residual="block_attnres", attnres__block_size=2)
    tokens = random_tokens((2, 9))

    def loss(model):
        logits = model(tokens[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))

    grads = nnx.jit(nnx.grad(loss))(model).residual_stream.pseudo_queries[...]
    learned = np.abs(grads[1:]).max(-1)
    assert np.abs(grads[0]).max() < 1e-5 * learned.min(), (grads[0], learned)


@pytest.mark.parametrize("field,value,message", [
    ("attnres__heads", 3, "model.attnres.heads=3 is invalid: must divide model.d_model=32; "
                         "valid: [1, 2, 4, 8, 16, 32]"),
    ("attnres__block_size", 0, "model.attnres.block_size=0 is invalid: must be an integer ≥ 1 "
                              "(sublayers per block)"),
    ("attnres__weights", "relu", "model.attnres.weights='relu' is invalid: valid: softmax, "
                                "sigmoid, static"),
    ("attnres__window", -1, "model.attnres.window=-1 is invalid: must be an integer ≥ 0 "
                           "(0: every source)"),
    ("attnres__query_scale", 0.0, "model.attnres.query_scale=0.0 is invalid: must be positive"),
    ("attnres__query_scale", 0.5, "model.attnres.query_scale=0.5 is invalid: scales the "
                                 "input-dependent query only; set model.attnres.query='input'"),
])
def test_config_errors_name_the_field_and_the_fix(field, value, message):
    config = tiny_config(residual="block_attnres", **{field: value})
    with pytest.raises(ConfigError) as error:
        config = resolve(config, 1)
    assert str(error.value) == message


def test_input_query_needs_scores():
    config = tiny_config(residual="attnres", attnres__query="input", attnres__weights="static")
    with pytest.raises(ConfigError, match="model.attnres.query='input' is invalid: static"):
        config = resolve(config, 1)
    assert AttentionResidual.block_size(config.model) == 1


@pytest.mark.parametrize("residual", ["attnres", "block_attnres"])
def test_query_scale_multiplies_the_input_dependent_term(residual):
    """c·W k̂ with W is W' k̂ with W' = c·W: the scale is the projection's output multiplier, in
    every read including the final one (and the term matters: with c = 1 the output differs)."""
    case = dict(residual=residual, attnres__query="input", attnres__block_size=2)
    _, scaled = tiny_model(**case, attnres__query_scale=0.125)
    _, plain = tiny_model(**case)
    perturb_parameters(scaled, scale=0.5)
    params = nnx.state(scaled, nnx.Param)
    forward = nnx.jit(lambda model, tokens: model(tokens))
    tokens = random_tokens((2, 8))
    nnx.update(plain, params)
    unscaled = forward(plain, tokens)
    nnx.update(plain, jax.tree.map_with_path(
        lambda path, leaf: 0.125 * leaf if "query_projection" in jax.tree_util.keystr(path)
        else leaf, params))
    np.testing.assert_allclose(forward(scaled, tokens), forward(plain, tokens), atol=1e-5)
    assert np.abs(forward(scaled, tokens) - unscaled).max() > 1e-2
