"""Gated Residual (arch/gated_residual.py): its equations, gate ranges, initialization, reduction
to Pre-Norm, composition with the zoo and decoding, the FP8 residual state, and the ablation
switches (channelwise reads/writes apart, no static term or a frozen one, random init, top-k
reads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.gated_residual import (
    GatedResidual,
    GatedResidualStream,
    graded_write_strengths,
    load_branches,
    load_fp8,
    random_write_logits,
    store_fp8,
)
from config import ConfigError, resolve
from sharding.mesh import make_mesh
from tests.helpers import (
    JittedDecoder,
    prefill_then_decode,
    random_tokens,
    tiny_config,
    tiny_model,
)
from train.data import in_memory
from train.step import TrainProgram

N = 4  # branches (the default model.residual.streams)
# The model most tests share (one build).
GATED = dict(residual="gated_residual", gated_residual__mixing=True)


def resolved(**model):
    config = tiny_config(residual="gated_residual", **model)
    config = resolve(config, 1)
    return config.model


def randomize(module: nnx.Module, std: float, seed: int = 0) -> None:
    """Replace every parameter of `module` by N(0, std²) values (non-zero, large on purpose), but
    W_down by N(0, 1/(n·D)) and the gains by 1 + N(0, std²): gate logits ≈ N(0, 17·std²)."""
    rng = np.random.default_rng(seed)
    flat = []
    for path, variable in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        value = std * rng.standard_normal(variable.shape)
        if "gate_down" in path:
            value = value / std * float(np.prod(variable.shape[-3:-1])) ** -0.5
        elif path[-1] == "scale":  # branch gains around 1
            value = 1 + value
        flat.append((path, variable.replace(jnp.asarray(value, jnp.float32))))
    nnx.update(module, nnx.from_flat_state(flat))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def reference(module: GatedResidual, branches, update, eps):
    """Read and write of the module docstring, in float64 numpy."""
    x = np.asarray(branches, np.float64)
    normalized = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps)
    normalized = normalized * np.asarray(module.scale[...])[:, None, None, :]
    read_logits = write_logits = 0.0
    if module.read_gate.bias is not None:  # the static term (absent with static=False)
        read_logits = np.asarray(module.read_gate.bias[...])[:, None, None, :]
        write_logits = np.asarray(module.write_gate.bias[...])[:, None, None, :]
    if module.gate_down is not None:
        summary = np.einsum("nbtd,ndr->btr", normalized, np.asarray(module.gate_down.kernel[...]))
        read_logits = read_logits + np.einsum("btr,rnw->nbtw", summary,
                                              np.asarray(module.read_gate.up.kernel[...]))
        write_logits = write_logits + np.einsum("btr,rnw->nbtw", summary,
                                                np.asarray(module.write_gate.up.kernel[...]))
    gates = sigmoid(read_logits)
    if module.read_top_k:  # keep the k branches of largest (channel-mean) gate per token
        order = np.argsort(-gates.mean(-1), axis=0, kind="stable")
        kept = np.zeros(gates.shape[:-1] + (1,))
        np.put_along_axis(kept, order[:module.read_top_k, ..., None], 1.0, axis=0)
        gates = gates * kept
    h = np.sum(gates * normalized, axis=0)
    mixing = np.eye(x.shape[0])
    if module.mixing is not None:
        mixing = mixing + np.asarray(module.mixing[...])
    written = np.einsum("mk,kbtd->mbtd", mixing, x) + 2 * sigmoid(write_logits) * update
    return h, written


@pytest.mark.parametrize("options", [
    dict(),
    dict(gated_residual__channelwise=False, residual__dynamic=False),
    dict(gated_residual__mixing=True, gated_residual__channelwise=False),
    dict(gated_residual__channelwise_read=False),
    dict(gated_residual__channelwise=False, gated_residual__channelwise_write=True),
    dict(gated_residual__static=False),
    dict(gated_residual__static_frozen=True, gated_residual__init="random"),
    dict(gated_residual__init="random", gated_residual__channelwise_write=False),
    dict(gated_residual__read_top_k=2),
    dict(gated_residual__read_top_k=1, gated_residual__channelwise=False, residual__dynamic=False)])
def test_read_and_write_follow_their_equations(options):
    cfg = resolved(**options)
    module = GatedResidual(cfg, rngs=nnx.Rngs(0))
    randomize(module, 0.5)
    branches = jax.random.normal(jax.random.key(1), (N, 2, 5, cfg.d_model))
    update = jax.random.normal(jax.random.key(2), (2, 5, cfg.d_model))
    state = {"branches": branches}
    expected_h, expected_branches = reference(module, branches, update, cfg.norm.eps)
    np.testing.assert_allclose(module.read(state), expected_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(module.write(state, update)["branches"], expected_branches,
                               rtol=1e-5, atol=1e-5)
    for gate, which in ((module.read_gate, "read"), (module.write_gate, "write")):
        switch = cfg.gated_residual[f"channelwise_{which}"]
        width = cfg.d_model if (cfg.gated_residual.channelwise if switch is None else switch) else 1
        if cfg.gated_residual.static:
            assert gate.bias.shape == (N, width)
        if cfg.residual.dynamic:
            assert gate.up.kernel.shape == (cfg.gated_residual.rank, N, width)
    assert (module.gate_down is None) == (not cfg.residual.dynamic)


def test_initialization_reads_one_nth_of_each_branch_and_writes_graded_strengths():
    cfg = resolved()
    module = GatedResidual(cfg, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(sigmoid(np.asarray(module.read_gate.bias[...])), 1 / N, rtol=1e-6)
    strengths = 2 * sigmoid(np.asarray(module.write_gate.bias[...]))
    np.testing.assert_allclose(strengths[:, 0], [0.25, 0.75, 1.25, 1.75], rtol=1e-6)
    assert graded_write_strengths(N) == [0.25, 0.75, 1.25, 1.75]
    np.testing.assert_array_equal(module.read_gate.up.kernel[...], 0)
    np.testing.assert_array_equal(module.write_gate.up.kernel[...], 0)
    # Equal branches are read as a Pre-Norm read would: RMSNorm(x) with gain 1.
    x = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))
    state = GatedResidualStream(cfg).begin(x)
    rms_normalized = x / jnp.sqrt(jnp.mean(x**2, -1, keepdims=True) + cfg.norm.eps)
    np.testing.assert_allclose(module.read(state), rms_normalized, rtol=1e-5, atol=1e-6)


# Compiled once per model graph (models of one config share it).
forward = nnx.jit(lambda model, tokens: nnx.capture(model, nnx.Intermediate)(tokens))
logits_of = nnx.jit(lambda model, tokens: model(tokens))


def test_read_gates_lie_in_zero_one_and_write_strengths_in_zero_two():
    cfg, model = tiny_model(**GATED)
    for residual in (model.blocks.attention_residual, model.blocks.ffn_residual):
        randomize(residual, 0.5, seed=7)  # logits up to ≈ ±10: σ(10) < 1 in float32
    _, captured = forward(model, random_tokens((2, 16)))
    layers, batch, length, width = cfg.num_layers, 2, 16, cfg.d_model
    for name in ("attention_residual", "ffn_residual"):
        gates = np.asarray(captured["blocks"][name]["read_gates"].get_value()[0])
        strengths = np.asarray(captured["blocks"][name]["write_strengths"].get_value()[0])
        assert gates.shape == strengths.shape == (layers, batch, length, N, width)
        assert gates.min() > 0 and gates.max() < 1
        assert strengths.min() > 0 and strengths.max() < 2
        # The bounds are approached, so tanh, σ-vs-2σ or an unbounded map would have broken them.
        assert gates.min() < 0.01 and gates.max() > 0.99
        assert strengths.min() < 0.02 and strengths.max() > 1.98
        # Not a softmax: the read weights of a channel do not sum to one over the branches.
        assert np.abs(gates.sum(axis=3) - 1).max() > 0.5
        mixing = np.asarray(captured["blocks"][name]["mixing_matrix"].get_value()[0])
        np.testing.assert_allclose(mixing, np.eye(N) + getattr(model.blocks, name).mixing[...])


def copy_shared_parameters(source: nnx.Module, target: nnx.Module) -> None:
    """Give `target` every parameter of `source` with the same path and shape."""
    source_params = dict(nnx.to_flat_state(nnx.state(source, nnx.Param)))
    target_state = nnx.state(target, nnx.Param)
    flat = []
    for path, variable in nnx.to_flat_state(target_state):
        shared = source_params.get(path)
        if shared is not None and shared.shape == variable.shape:
            variable = variable.replace(shared[...])
        flat.append((path, variable))
    nnx.update(target, nnx.from_flat_state(flat))


def test_equal_write_strengths_reduce_to_the_prenorm_model():
    """Strengths s = 1 for every branch: the branches stay copies of the Pre-Norm stream (the
    mixing M = I + Δ starts at Δ = 0), the read (gates 1/n, zero dynamic part) is RMSNorm with
    gain 1, and the end (mean) is the stream, so the logits equal the Pre-Norm model's with the
    same attention/FFN/embedding/head parameters."""
    _, prenorm = tiny_model(seed=1)
    _, gated = tiny_model(seed=2, **GATED)
    copy_shared_parameters(prenorm, gated)
    for residual in (gated.blocks.attention_residual, gated.blocks.ffn_residual):
        residual.write_gate.bias[...] = jnp.zeros_like(residual.write_gate.bias[...])
    tokens = random_tokens((2, 16))
    expected = logits_of(prenorm, tokens)
    np.testing.assert_allclose(forward(gated, tokens)[0], expected, atol=2e-5, rtol=1e-5)
    # The graded initialization differs from Pre-Norm (the branches are not copies).
    assert not np.allclose(forward(tiny_model(seed=2, **GATED)[1], tokens)[0], expected,
                           atol=1e-2)


@pytest.mark.slow
def test_composes_with_mla_moe_interleaving_gatednorm_and_decoding():
    """Decoding with a KV cache, one token at a time (one compiled shape), equals the full
    forward (so the model is causal), with scalar gates on a model that uses MLA, a dropless MoE
    every 2nd block and GatedNorm (the final norm; GR replaces the pre-norms)."""
    _, model = tiny_model(residual="gated_residual", gated_residual__channelwise=False,
                          attention="mla",
                          mla__kv_rank=16, mla__rope_dim=8, ffn="moe", moe__every=2, moe__experts=4,
                          moe__dropless=True, norm="gatednorm")
    randomize(model.blocks.block_0.attention_residual, 0.5, seed=3)
    randomize(model.blocks.block_1.ffn_residual, 0.5, seed=4)
    tokens = random_tokens((2, 16))
    full = logits_of(model, tokens)
    assert np.isfinite(full).all()
    np.testing.assert_allclose(prefill_then_decode(JittedDecoder(model), tokens, 1, 16), full,
                               atol=1e-4, rtol=1e-4)


def test_bfloat16_compute_reads_in_bfloat16_and_keeps_the_state_dtype():
    cfg = resolved(dtype="bfloat16")
    module = GatedResidual(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model), jnp.bfloat16)
    state = GatedResidualStream(cfg).begin(x)
    assert state["branches"].dtype == jnp.float32
    h = module.read(state)
    assert h.dtype == jnp.bfloat16
    written = module.write(state, h)
    assert written["branches"].dtype == jnp.float32
    assert GatedResidualStream(cfg).end(written).dtype == jnp.bfloat16


@pytest.mark.parametrize("field,value,message", [
    ("residual__streams", 1, "model.residual.streams=1 is invalid: gated_residual needs an integer "
                            "n ≥ 2 branches (one branch: use residual='prenorm' with "
                            "norm='gatednorm')"),
    ("gated_residual__state_dtype", "float16",
     "model.gated_residual.state_dtype='float16' is invalid: valid: float32, "
                                  "bfloat16, float8_e4m3fn"),
    ("gated_residual__rank", 0,
     "model.gated_residual.rank=0 is invalid: must be a positive integer (rank of the gate "
                   "predictor)"),
])
def test_invalid_fields_are_one_line_config_errors(field, value, message):
    with pytest.raises(ConfigError) as error:
        resolved(**{field: value})
    assert str(error.value) == message


def test_fp8_storage_round_trip_is_bounded_and_never_overflows():
    magnitudes = jnp.array([1e-4, 1e-2, 1.0, 30.0, 1e4])[:, None]  # rows far beyond 448
    x = magnitudes * jax.random.normal(jax.random.key(0), (5, 64))
    payload, scale = store_fp8(x)
    assert payload.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    np.testing.assert_array_equal(scale, 2.0 ** np.round(np.log2(scale)))  # powers of two
    assert np.all(np.abs(x).max(-1, keepdims=True) / scale <= 448)
    restored = load_fp8(payload, scale)
    # 3 mantissa bits: half an ulp is 2⁻⁴ of |x| (normals), the subnormal step is 2⁻⁹·scale.
    assert np.all(np.abs(restored - x) <= 2.0**-4 * np.abs(x) + 2.0**-10 * scale)
    # Gradients go through the same per-row scaled FP8 storage: tiny ones do not underflow.
    cotangent = 1e-20 * jax.random.normal(jax.random.key(1), x.shape)
    _, pullback = jax.vjp(lambda x: load_fp8(*store_fp8(x)), x)
    (gradient,) = pullback(cotangent)
    assert np.all(np.abs(gradient - cotangent) <= 2.0**-4 * np.abs(cotangent) + 1e-40)
    assert np.count_nonzero(gradient) > 0.95 * gradient.size


def test_fp8_state_takes_half_the_bytes_of_bfloat16():
    x = jax.random.normal(jax.random.key(0), (2, 5, 32))
    fp8 = GatedResidualStream(resolved(gated_residual__state_dtype="float8_e4m3fn")).begin(x)
    bf16 = GatedResidualStream(resolved(gated_residual__state_dtype="bfloat16")).begin(x)
    assert fp8["branches"].dtype == jnp.float8_e4m3fn and fp8["branches"].shape == (N, 2, 5, 32)
    assert fp8["branches"].dtype.itemsize * 2 == bf16["branches"].dtype.itemsize == 2
    state_bytes = {name: sum(leaf.nbytes for leaf in jax.tree.leaves(state))
                   for name, state in (("fp8", fp8), ("bf16", bf16))}
    assert state_bytes["fp8"] / state_bytes["bf16"] == pytest.approx((32 + 4) / (2 * 32))
    np.testing.assert_allclose(load_branches(fp8), jnp.broadcast_to(x, (N, 2, 5, 32)),
                               rtol=2.0**-4)


@pytest.mark.slow
def test_fp8_state_stays_close_to_the_float32_state_in_logits_and_gradients():
    """Accuracy cost of the FP8 state on the tiny model (same parameters; 4 sublayers, each
    re-rounding all branches to 3 mantissa bits): measured ≈ 6% relative RMS error in the logits
    and ≤ 14% relative error per parameter gradient; asserted with some margin. A loss scaled by
    2⁻³⁰ gives gradients scaled by exactly 2⁻³⁰ (no underflow through the FP8 state). The FP8
    model is rematerialized (the custom VJPs and the read-to-write hand-off under checkpoint)."""
    tokens = random_tokens((2, 16))

    @nnx.jit
    def logits_and_gradients(model, loss_scale):
        def loss(model):
            logits = model(tokens)
            return loss_scale * jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
        return nnx.grad(loss, has_aux=True)(model)

    _, model32 = tiny_model(**GATED)
    _, model8 = tiny_model(**GATED, gated_residual__state_dtype="float8_e4m3fn",
                           execution__remat="full")
    gradients32, logits32 = logits_and_gradients(model32, 1.0)
    gradients8, logits8 = logits_and_gradients(model8, 1.0)
    error = jnp.sqrt(jnp.mean((logits8 - logits32) ** 2) / jnp.mean(logits32**2))
    assert 0 < float(error) < 0.1
    flat8 = dict(nnx.to_flat_state(gradients8))
    for path, gradient32 in nnx.to_flat_state(gradients32):
        size = float(jnp.linalg.norm(gradient32[...]))
        if size > 0:  # the zero-initialized up-projections give W_down no gradient at first
            difference = float(jnp.linalg.norm(flat8[path][...] - gradient32[...]))
            assert difference < 0.25 * size, path
    tiny_gradients8, _ = logits_and_gradients(model8, 2.0**-30)
    for small, gradient in zip(jax.tree.leaves(tiny_gradients8), jax.tree.leaves(gradients8),
                               strict=True):
        np.testing.assert_allclose(small * 2.0**30, gradient, rtol=1e-6, atol=0)


# The ablation switches ---------------------------------------------------------------------

def captured_gates(module: GatedResidual, state: dict) -> tuple[np.ndarray, np.ndarray]:
    """(read gates, write strengths) the module records for `state`, B×T×n×W each."""
    (h, context), read = nnx.capture(module.read_with_context, nnx.Intermediate)(state)
    _, written = nnx.capture(module.write, nnx.Intermediate)(state, h, context)
    return (np.asarray(read["read_gates"].get_value()[0]),
            np.asarray(written["write_strengths"].get_value()[0]))


@pytest.mark.parametrize("read,write", [(False, True), (True, False), (False, False)])
def test_scalar_reads_or_writes_are_one_gate_per_branch_and_token(read, write):
    """`gated_residual.channelwise_read` / `_write` apart: a scalar gate (W = 1) per branch and
    token where the switch is off, a gate per channel that does vary over the channels where it
    is on."""
    cfg = resolved(gated_residual__channelwise_read=read, gated_residual__channelwise_write=write)
    module = GatedResidual(cfg, rngs=nnx.Rngs(0))
    randomize(module, 0.5)
    branches = jax.random.normal(jax.random.key(1), (N, 2, 5, cfg.d_model))
    gates, strengths = captured_gates(module, {"branches": branches})
    for values, channelwise in ((gates, read), (strengths, write)):
        assert values.shape == (2, 5, N, cfg.d_model if channelwise else 1)
        assert (np.ptp(values, axis=-1).min() > 0) == channelwise  # varies over channels
        assert np.ptp(values, axis=(0, 1)).min() > 0  # and over the tokens: input-dependent
    assert module.read_gate.bias.shape == (N, cfg.d_model if read else 1)
    assert module.write_gate.bias.shape == (N, cfg.d_model if write else 1)


def test_channelwise_switches_default_to_channelwise():
    """None follows `gated_residual.channelwise`: the same parameters, bit for bit, as setting
    both."""
    for both in (True, False):
        default = nnx.state(GatedResidual(resolved(gated_residual__channelwise=both),
                                          rngs=nnx.Rngs(0)))
        explicit = nnx.state(GatedResidual(resolved(gated_residual__channelwise=not both,
                                                    gated_residual__channelwise_read=both,
                                                    gated_residual__channelwise_write=both),
                                           rngs=nnx.Rngs(0)))
        for a, b in zip(jax.tree.leaves(default), jax.tree.leaves(explicit), strict=True):
            np.testing.assert_array_equal(a, b)


def test_without_the_static_term_the_gates_are_the_dynamic_part_alone():
    """`gated_residual.static=False`: no bias parameters; zero dynamic input (z = 0, here from zero
    branches) gives σ(0) = 1/2 read gates and 2σ(0) = 1 write strengths; the random W_up
    already tells the branches apart at initialization (equal branches, unequal gates)."""
    cfg = resolved(gated_residual__static=False)
    module = GatedResidual(cfg, rngs=nnx.Rngs(0))
    assert module.read_gate.bias is None and module.write_gate.bias is None
    names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(module))}
    assert not any("bias" in name for name in names), names
    assert np.std(module.read_gate.up.kernel[...]) > 0.5 * cfg.gated_residual.rank**-0.5
    zero = {"branches": jnp.zeros((N, 2, 5, cfg.d_model))}
    gates, strengths = captured_gates(module, zero)
    np.testing.assert_array_equal(gates, 0.5)
    np.testing.assert_array_equal(strengths, 1.0)
    x = jax.random.normal(jax.random.key(0), (2, 5, cfg.d_model))
    gates, _ = captured_gates(module, GatedResidualStream(cfg).begin(x))
    assert np.ptp(gates, axis=2).min() > 0  # every token and channel: branches differ
    with pytest.raises(ConfigError) as error:
        resolved(gated_residual__static=False, residual__dynamic=False)
    assert str(error.value) == ("model.gated_residual.static=False is invalid: removing the "
                                "static gate term needs model.residual.dynamic=True (with "
                                "residual.dynamic=False the gates have no other term)")


def trained_parameters(steps: int, **model) -> tuple[dict, dict, list[float]]:
    """A tiny GR model trained `steps` AdamW steps from seed 0 (the default optimizer: biases
    out of weight decay): (initial parameters, final parameters, losses) by path."""
    config = tiny_config(residual="gated_residual", **model)
    config.steps = steps
    config.optimizer.update(learning_rate=1e-2, warmup_steps=1)
    config = resolve(config, 1)
    program = TrainProgram(config, make_mesh(config, jax.devices()[:1]))
    corpus = in_memory.load({"name": "kjv"}, "train")

    def parameters(state):
        return {path: np.array(variable[...]) for path, variable
                in nnx.to_flat_state(state["params"])}

    state, losses = program.init(0), []
    initial = parameters(state)
    for step in range(steps):
        tokens = corpus.batch(step, 8, 16, seed=0)
        state, metrics = program.train_step(state, program.put_batch(tokens))
        losses.append(float(metrics["loss"]))
    return initial, parameters(state), losses


@pytest.mark.slow
def test_frozen_static_logits_never_move_and_the_model_starts_as_gr():
    """`static_frozen=True` (with the study's random init): the same parameters as GR at
    initialization and the same loss at the first step (separate programs: to rounding); after
    3 AdamW steps b_read and b_write equal their initial values bit for bit,
    while every other parameter moved (and GR's own biases moved)."""
    frozen_initial, frozen_final, frozen_losses = trained_parameters(
        3, gated_residual__init="random", gated_residual__static_frozen=True)
    gr_initial, gr_final, gr_losses = trained_parameters(3, gated_residual__init="random")
    assert frozen_initial.keys() == gr_initial.keys()
    for path, value in frozen_initial.items():
        np.testing.assert_allclose(value, gr_initial[path], rtol=1e-6, err_msg=str(path))
    np.testing.assert_allclose(frozen_losses[0], gr_losses[0], rtol=1e-6)
    biases = [path for path in frozen_initial if path[-1] == "bias" and path[-2] in
              ("read_gate", "write_gate")]
    assert len(biases) == 4  # read and write, attention and FFN sublayers (stacked layers)
    for path, value in frozen_final.items():
        if path in biases:
            np.testing.assert_array_equal(value, frozen_initial[path], err_msg=str(path))
            assert not np.array_equal(gr_final[path], gr_initial[path]), path
        else:
            assert not np.array_equal(value, frozen_initial[path]), path


def test_frozen_static_needs_the_static_term():
    with pytest.raises(ConfigError) as error:
        resolved(gated_residual__static_frozen=True, gated_residual__static=False)
    assert str(error.value) == ("model.gated_residual.static_frozen=True is invalid: freezes the "
                                "static gate logits, which model.gated_residual.static=False "
                                "removes")


def test_graded_init_is_exact_and_random_init_is_seeded_and_in_the_graded_range():
    graded = GatedResidual(resolved(), rngs=nnx.Rngs(0))
    expected_logits = np.log([s / (2 - s) for s in graded_write_strengths(N)]).astype(np.float32)
    np.testing.assert_array_equal(graded.write_gate.bias[...][:, 0], expected_logits)
    np.testing.assert_allclose(2 * sigmoid(np.asarray(graded.write_gate.bias[...], np.float64)),
                               np.broadcast_to(np.array(graded_write_strengths(N))[:, None],
                                               graded.write_gate.bias.shape), rtol=1e-6)

    def random_logits(seed):
        return GatedResidual(resolved(gated_residual__init="random"), rngs=nnx.Rngs(seed))

    first, again, other = random_logits(0), random_logits(0), random_logits(1)
    logits = np.asarray(first.write_gate.bias[...])
    np.testing.assert_array_equal(logits, again.write_gate.bias[...])  # reproducible
    assert not np.allclose(logits, other.write_gate.bias[...])  # seeded
    assert not np.allclose(logits, graded.write_gate.bias[...])
    assert len(np.unique(logits)) == logits.size  # i.i.d. per branch and channel
    low, high = expected_logits[0], expected_logits[-1]
    assert low <= logits.min() and logits.max() <= high
    assert logits.min() < low + 0.5 and logits.max() > high - 0.5  # fills the range
    key = jax.random.key(3)
    np.testing.assert_array_equal(random_write_logits(key, (N, 7), jnp.float32, N),
                                  random_write_logits(key, (N, 7), jnp.float32, N))
    # Every other parameter is the graded module's (same seed, same stream of keys).
    flat = dict(nnx.to_flat_state(nnx.state(graded, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(first, nnx.Param)):
        if path != ("write_gate", "bias"):
            np.testing.assert_array_equal(variable[...], flat[path][...])


@pytest.mark.parametrize("field,value,message", [
    ("gated_residual__init", "uniform",
     "model.gated_residual.init='uniform' is invalid: valid: graded, random"),
    ("gated_residual__read_top_k", 5,
     "model.gated_residual.read_top_k=5 is invalid: must be an integer in "
                         "[0, model.residual.streams=4] (0: read all branches)"),
    ("gated_residual__read_top_k", -1,
     "model.gated_residual.read_top_k=-1 is invalid: must be an integer in "
                          "[0, model.residual.streams=4] (0: read all branches)"),
])
def test_invalid_switches_are_one_line_config_errors(field, value, message):
    with pytest.raises(ConfigError) as error:
        resolved(**{field: value})
    assert str(error.value) == message


def test_random_init_without_the_static_term_is_a_one_line_error():
    with pytest.raises(ConfigError) as error:
        resolved(gated_residual__init="random", gated_residual__static=False)
    assert str(error.value) == ("model.gated_residual.init='random' is invalid: initializes the "
                                "static write logits, which model.gated_residual.static=False "
                                "removes")


@pytest.mark.parametrize("channelwise", [True, False])
def test_top_k_reads_keep_k_branches_per_token_and_k_equal_n_is_all(channelwise):
    """k = 2: exactly 2 branches with nonzero read gates per token (the 2 of largest gate), and
    h is the gated sum over those alone; k = n: bit for bit the model that reads all (k = 0)."""
    modules = {k: GatedResidual(resolved(gated_residual__read_top_k=k,
                                         gated_residual__channelwise=channelwise),
                                rngs=nnx.Rngs(0)) for k in (0, 2, N)}
    for module in modules.values():
        randomize(module, 0.5)
    d = modules[0].scale.shape[-1]
    branches = jax.random.normal(jax.random.key(1), (N, 2, 5, d))
    state = {"branches": branches}
    all_gates, _ = captured_gates(modules[0], state)  # B×T×n×W
    gates, _ = captured_gates(modules[2], state)
    nonzero = np.any(gates != 0, axis=-1)  # B×T×n
    np.testing.assert_array_equal(nonzero.sum(-1), 2)
    largest = np.argsort(-all_gates.mean(-1), axis=-1)[..., :2]
    np.testing.assert_array_equal(np.sort(np.nonzero(nonzero)[-1].reshape(2, 5, 2)),
                                  np.sort(largest))
    np.testing.assert_array_equal(gates, np.where(nonzero[..., None], all_gates, 0))
    _, _, normalized, _ = modules[2]._gates_input(state)
    expected = np.sum(np.moveaxis(gates, 2, 0) * np.asarray(normalized), axis=0)
    np.testing.assert_allclose(modules[2].read(state), expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(modules[2].read(state), modules[0].read(state), atol=1e-3)
    np.testing.assert_array_equal(modules[N].read(state), modules[0].read(state))
    np.testing.assert_array_equal(captured_gates(modules[N], state)[0], all_gates)


@pytest.mark.parametrize("switches", [
    dict(gated_residual__read_top_k=2, gated_residual__channelwise_read=False,
         gated_residual__static=False),
    dict(gated_residual__init="random", gated_residual__channelwise_write=False,
         gated_residual__mixing=True)],
    ids=["top2-scalar-reads-no-static", "random-init-scalar-writes-mixing"])
@pytest.mark.slow
def test_ablation_switches_learn_and_a_2x2x2_mesh_changes_nothing(switches):
    """As tests/test_variants.py does for every mechanism: 20 training steps learn, and data ×
    FSDP × tensor = 2×2×2 gives the one-device losses (the top-k ranks branches by a mean over
    the tensor-sharded channels)."""
    from tests.test_variants import train_losses
    model = dict(residual="gated_residual", **switches)
    single = train_losses(1, (1, 1, 1), model)
    sharded = train_losses(8, (2, 2, 2), model)
    assert np.mean(single[-5:]) < np.mean(single[:5]) - 0.5, single
    np.testing.assert_allclose(sharded, single, rtol=2e-4)
