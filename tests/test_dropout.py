"""Dropout (arch/dropout.py): off is exactly today's model, the mask's keep fraction and scale,
keys from (seed, step), evaluation and generation deterministic, reversible gradients equal
autodiff with the same masks, and a preempted dropout run resumes bit-identically. (Sharded
equals one device: tests/test_variants.py, one entry with dropout on.)"""

import json
import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch.dropout import SITES, Dropout, dropout, train_key
from arch.reversible import branches, couple
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
from train.loop import train
from train.step import TrainProgram, next_token_loss, resolve_for_job

RATES = {site: 0.1 for site in SITES}


def program(devices: int = 1, **model) -> TrainProgram:
    config = tiny_config(**model)
    config = resolve(config, devices)
    return TrainProgram(config, make_mesh(config, jax.devices()[:devices]))


def test_mask_keeps_one_minus_p_and_scales_by_its_inverse():
    ones = jnp.ones((1000, 1000), jnp.float32)
    for rate in (0.1, 0.5):
        dropped = np.asarray(dropout(ones, rate, jax.random.key(0)))
        kept = dropped != 0
        n = dropped.size
        # Binomial(n, 1 − p): 5 standard deviations √(n p (1 − p)) of the kept count.
        assert abs(kept.sum() - (1 - rate) * n) < 5 * np.sqrt(n * rate * (1 - rate)), kept.mean()
        np.testing.assert_allclose(dropped[kept], 1 / (1 - rate), rtol=1e-6)  # inverted scale
        assert abs(dropped.mean() - 1) < 5 * np.sqrt(rate / ((1 - rate) * n))  # E[y] = x
    np.testing.assert_array_equal(dropout(ones, 0.5, jax.random.key(0)),
                                  dropout(ones, 0.5, jax.random.key(0)))
    assert not np.array_equal(dropout(ones, 0.5, jax.random.key(0)),
                              dropout(ones, 0.5, jax.random.key(1)))
    assert dropout(ones, 0.0, jax.random.key(0)) is ones


@pytest.mark.slow
def test_rates_zero_is_todays_model_with_no_random_ops():
    """All rates 0 (the default): a key changes nothing, not even the jaxpr, and the train step
    traces no random bits; any positive rate does."""
    _, model = tiny_model()
    tokens = random_tokens((2, 16))
    graphdef, state = nnx.split(model)

    def jaxpr(key):
        return str(jax.make_jaxpr(
            lambda s, t: nnx.merge(graphdef, s)(t, dropout_key=key))(state, tokens))

    assert jaxpr(jax.random.key(0)) == jaxpr(None)
    np.testing.assert_array_equal(model(tokens, dropout_key=jax.random.key(0)), model(tokens))
    batch = random_tokens((8, 17))
    for rates, random in (({}, False), (dict(residual=0.1), True)):
        prog = program(dropout=rates)
        state = jax.eval_shape(prog._init_state, jnp.int32(0))
        with jax.set_mesh(prog.mesh):
            step_jaxpr = str(jax.make_jaxpr(prog._step)(state, batch))
        assert ("random_bits" in step_jaxpr) == random


@pytest.mark.parametrize("site", SITES)
def test_each_site_drops_only_in_training(site):
    """Every site is wired: with only its rate on, a key changes the logits; without one
    (evaluation, generation) the model is the no-dropout model exactly, also through the KV
    cache."""
    _, plain = tiny_model()
    _, model = tiny_model(dropout={site: 0.5})
    tokens = random_tokens((2, 16))
    np.testing.assert_array_equal(model(tokens), plain(tokens))
    assert not np.allclose(model(tokens, dropout_key=train_key(0, 0)), plain(tokens), atol=1e-3)
    if site == "residual":
        np.testing.assert_allclose(prefill_then_decode(JittedDecoder(model), tokens, 5, 16),
                                   plain(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_train_step_masks_depend_on_seed_and_step_only():
    """The same (seed, step) gives the same loss and gradients, another step or seed other
    masks; evaluation ignores dropout (the no-dropout model's loss)."""
    batch = random_tokens((8, 17))
    prog = program(dropout=RATES)
    state = prog.init(0)
    params, model_state = state["params"], state["model_state"]

    step_loss = jax.jit(lambda p, s, b, key: prog._loss_and_grads(p, s, b, dropout_key=key)[0])

    def loss(step, seed=0):
        return float(step_loss(params, model_state, batch, train_key(seed, step)))

    with jax.set_mesh(prog.mesh):
        np.testing.assert_array_equal(jax.random.key_data(prog.dropout_key(3)),
                                      jax.random.key_data(train_key(prog.config.seed, 3)))

    assert loss(3) == loss(3)
    assert len({loss(3), loss(4), loss(3, seed=1)}) == 3
    plain = program()
    np.testing.assert_array_equal(prog.eval_loss(state, batch), plain.eval_loss(state, batch))
    assert abs(loss(3) - float(plain.eval_loss(state, batch))) > 1e-4


@pytest.mark.slow
def test_remat_replays_the_masks():
    """`execution.remat="full"` recomputes each block in the backward pass with its scanned
    key: the gradients equal those without remat."""
    batch = random_tokens((8, 17))
    grads = []
    for remat in ("none", "full"):
        prog = program(dropout=RATES, execution__remat=remat)
        state = prog.init(0)
        grads.append(jax.jit(lambda p, s, b, prog=prog: prog._loss_and_grads(
            p, s, b, dropout_key=prog.dropout_key(2))[1])(state["params"], state["model_state"],
                                                          batch))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), *grads)


@pytest.mark.slow
def test_reversible_gradients_with_dropout_equal_autodiff():
    """The custom backward pass replays each layer's masks: its gradients equal jax.grad of an
    ordinary Python loop of the same masked coupling (same keys), and differ from the
    gradients without dropout."""
    _, model = tiny_model(reversible=True, dropout=RATES)
    tokens = random_tokens((4, 17))
    key = train_key(0, 7)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def explicit(model, tokens_BxT):
        drop = Dropout.for_model(model.cfg, key)
        positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
        x = drop.embedding(model.position.embed(model.embed(tokens_BxT), positions))
        block_graph, block_params, block_states = nnx.split(model.blocks, nnx.Param, ...)
        attention_branch, ffn_branch = branches(block_graph, model.position.rotate, drop)
        layer_keys = drop.layer_keys(model.cfg.num_layers)
        y1 = y2 = x
        for layer in range(model.cfg.num_layers):
            p, s = jax.tree.map(lambda a, i=layer: a[i], (block_params, block_states))
            y1, y2 = couple(attention_branch, ffn_branch, p, s, y1, y2, positions,
                            layer_keys[layer])
        return model.logits_of_hidden((y1 + y2) / 2)

    def gradient(forward):
        def loss(params):
            logits = forward(nnx.merge(graphdef, params, rest), tokens[:, :-1])
            return next_token_loss(logits, tokens[:, 1:])
        return nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))

    custom = gradient(lambda m, t: m(t, dropout_key=key))
    ordinary = gradient(explicit)
    undropped = gradient(lambda m, t: m(t))
    for (path, a), b, c in zip(jax.tree_util.tree_leaves_with_path(custom),
                               jax.tree.leaves(ordinary), jax.tree.leaves(undropped), strict=True):
        scale = float(jnp.abs(b).max())
        assert scale > 0, path
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale, err_msg=str(path))
        assert not np.allclose(a, c, rtol=1e-3, atol=1e-3 * scale), path


@pytest.mark.slow
def test_attnres_block_scan_replays_the_masks(monkeypatch):
    """Block AttnRes scans a block of units with a hand-written gradient that recomputes each
    unit: with dropout, its loss and gradients equal autodiff of the unit-by-unit scan."""
    from arch.attnres import AttnResStream

    prog = program(residual="block_attnres", attnres__block_size=2, dropout=RATES)
    state = prog.init(0)
    batch = random_tokens((8, 17))

    def loss_and_grads():  # traced anew on each call
        return jax.jit(lambda *args: prog._loss_and_grads(
            *args, dropout_key=prog.dropout_key(1)))(
            state["params"], state["model_state"], batch)

    grouped = loss_and_grads()
    monkeypatch.setattr(AttnResStream, "units_per_block", lambda self, units: None)
    naive = loss_and_grads()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5),
                 grouped, naive)


@pytest.mark.parametrize("fields, message", [
    (dict(model__dropout__residual=1.0),
     "model.dropout.residual=1.0 is invalid: must be a rate in [0, 1)"),
    (dict(model__dropout__embedding=-0.1),
     "model.dropout.embedding=-0.1 is invalid: must be a rate in [0, 1)"),
    (dict(model__dropout__residual=0.1, mesh__stage=2),
     "mesh.stage=2 is invalid: model.dropout draws masks in the unsplit array order, not the "
     "pipeline's microbatches; set mesh.stage=1 or every model.dropout rate to 0"),
    (dict(model__dropout__residual=0.1, mesh__sequence=2),
     "mesh.sequence=2 is invalid: model.dropout draws masks in the unsplit array order, not "
     "sequence parallelism's striped token order; set mesh.sequence=1 or every model.dropout "
     "rate to 0"),
    (dict(model__dropout__attention_probs=0.1, execution__attention_implementation="blocked"),
     "execution.attention_implementation='blocked' is invalid: model.dropout.attention_probs > 0 "
     "needs the explicit probabilities: use 'xla' or 'auto' (which then runs xla)"),
])
def test_invalid_configs(fields, message):
    config = tiny_config()
    config.mesh.data = -1
    for name, value in fields.items():
        *sections, field = name.split("__")
        node = config
        for section in sections:
            node = node[section]
        node[field] = value
    with pytest.raises(ConfigError) as error:
        config = resolve(config, 2)
    assert str(error.value) == message


def train_losses(workdir) -> list[float]:
    records = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").open()]
    return [r["train_loss"] for r in records]


def dropout_config():
    config = tiny_config(dropout=RATES)
    config.mesh.data = -1
    return config


@pytest.mark.slow
def test_preempted_dropout_run_resumes_bit_identically(tmp_path, monkeypatch):
    """As tests/test_train.py's resume test, with every dropout site on: stopped by SIGTERM
    during step 3 and resumed, the run's losses are exactly the uninterrupted run's."""
    uninterrupted = train(resolve_for_job(dropout_config()), tmp_path / "a")
    original_batch = in_memory.Dataset.batch

    def batch_then_sigterm(self, step, *args, **kwargs):
        if self.split == "train" and step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original_batch(self, step, *args, **kwargs)

    monkeypatch.setattr(in_memory.Dataset, "batch", batch_then_sigterm)
    assert train(resolve_for_job(dropout_config()), tmp_path / "b")["preempted"]
    monkeypatch.setattr(in_memory.Dataset, "batch", original_batch)
    resumed = train(resolve_for_job(dropout_config()), tmp_path / "b")
    assert resumed["step"] == uninterrupted["step"] == 5
    np.testing.assert_array_equal(train_losses(tmp_path / "b"), train_losses(tmp_path / "a"))
    assert resumed["eval_loss"] == uninterrupted["eval_loss"]
