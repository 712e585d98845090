"""Mixed precision, the policy of docs/training.md#mixed-precision: with `model.dtype="bfloat16"`
every matmul of the forward pass takes bfloat16 operands (in the backward pass, all but the two
that the float32 attention-score gradient enters), while parameters, gradients and optimizer
state stay float32, and the softmaxes, norm statistics, rotary angles and the loss run in
float32. Checked on the traced train loss, op class by op class; then 100 bfloat16 steps track
float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from config import resolve
from sharding.mesh import make_mesh
from tests.helpers import tiny_config
from train.data import in_memory
from train.step import TrainProgram, next_token_loss


def program(dtype: str, **overrides) -> TrainProgram:
    config = tiny_config(dtype=dtype, d_model=64, **overrides)
    config.steps = 100
    config.optimizer.update(learning_rate=3e-3, warmup_steps=10)
    config = resolve(config, 1)
    return TrainProgram(config, make_mesh(config, jax.devices()[:1]))


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it (scan, remat, custom VJP...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)


@pytest.mark.parametrize("overrides", [dict(), dict(position="learned", norm="layernorm",
                                                    ffn="mlp", head="untied")],
                         ids=["rope-rmsnorm-swiglu-tied", "learned-layernorm-gelu-untied"])
@pytest.mark.slow
def test_each_op_class_runs_in_its_policy_dtype(overrides):
    train = program("bfloat16", **overrides)
    state = train.init(0)
    model = nnx.merge(train.graphdef, state["params"], state["model_state"])
    tokens = jnp.zeros((2, 17), jnp.int32)

    def loss(model):
        return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])

    def operand_dtypes(function) -> tuple[dict[str, set], list]:
        by_primitive, float32_matmuls = {}, []
        for eqn in equations(jax.make_jaxpr(function)(model).jaxpr):
            dtypes = {str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")}
            by_primitive.setdefault(eqn.primitive.name, set()).update(dtypes)
            if eqn.primitive.name == "dot_general" and "float32" in dtypes:
                float32_matmuls.append(eqn)
        return by_primitive, float32_matmuls

    forward, _ = operand_dtypes(loss)
    assert forward["dot_general"] == {"bfloat16"}  # every matmul of the forward pass
    by_primitive, float32_matmuls = operand_dtypes(jax.grad(loss))
    # Backward: the float32 score gradient enters the two matmuls into dQ and dK (once in the
    # scanned layer body); every other matmul takes bfloat16 operands.
    assert len(float32_matmuls) == 2
    assert all(eqn.params["preferred_element_type"] == jnp.float32 for eqn in float32_matmuls)
    for primitive in ("exp", "log", "rsqrt"):  # softmaxes and the loss; norm statistics
        assert by_primitive.get(primitive, {"float32"}) == {"float32"}, primitive
    for primitive in ("sin", "cos"):  # rotary angles
        assert by_primitive.get(primitive, {"float32"}) == {"float32"}, primitive
    assert "exp" in by_primitive and "rsqrt" in by_primitive  # the check is not vacuous
    assert model(tokens).dtype == jnp.float32  # logits, and so the loss
    # The 100-step test's batch shape (8 × 33): the bfloat16 step below compiles once for both.
    state, metrics = train.train_step(state, train.put_batch(np.zeros((8, 33), np.int32)))
    for leaf in jax.tree.leaves((state["params"], state["opt_state"])):
        assert leaf.dtype in (jnp.float32, jnp.int32), leaf.dtype  # master weights, moments
    assert metrics["loss"].dtype == jnp.float32


@pytest.mark.slow
def test_bfloat16_training_tracks_float32_for_100_steps():
    """Same init, same batches of the embedded corpus: the per-step losses of bfloat16 compute
    stay within 0.01 nats of float32's (measured: ≈ 0.0016 at most, d 64, T 32, B 8), and they
    are not identical (bfloat16 really runs)."""
    corpus = in_memory.load({"name": "kjv"}, "train")
    losses = {}
    for dtype in ("float32", "bfloat16"):
        train = program(dtype)
        state, losses[dtype] = train.init(0), []
        for step in range(100):
            state, metrics = train.train_step(
                state, train.put_batch(corpus.batch(step, 8, 32, seed=0)))
            losses[dtype].append(float(metrics["loss"]))
    gap = np.abs(np.subtract(losses["bfloat16"], losses["float32"]))
    assert gap.max() < 0.01 and gap.max() > 1e-5, gap.max()
    assert np.mean(losses["float32"][-10:]) < losses["float32"][0] - 2.0  # it trained
