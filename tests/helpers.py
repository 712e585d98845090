"""Tiny configs shared by the tests (small enough to compile in seconds on 2 cores)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import ml_collections
from flax import nnx

from arch.model import TransformerLM
from config import resolve
from experiments.common import base_config
from sharding.mesh import make_mesh
from train.step import TrainProgram

# The tests' sweeps run from whatever checkout the suite runs in, a dirty one too: they pass
# --exploratory (tests/test_claims.py tests the refusal without it).
EXPLORATORY = ("--exploratory",)


def one_device_env(*drop: str) -> dict[str, str]:
    """The environment for a script run in a fresh interpreter: conftest's XLA flags without its 8
    simulated devices (one CPU device, the cheap code generation kept), less the `drop` names."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                if not flag.startswith("--xla_force_host_platform_device_count"))
    return env


def override(config: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
    """Set model fields by name, a double underscore for a section: `attnres__block_size=2` is
    `model.attnres.block_size`; a leading `execution__` names the `execution` section instead. A
    name alone picks a component: `residual="hc"` is `model.residual.name="hc"`. `config` is a
    whole config or its `model` section. Returns `config`."""
    for name, value in fields.items():
        *sections, field = name.split("__")
        if sections[:1] == ["execution"]:
            node, sections = config.execution, sections[1:]
        else:
            node = config.model if "model" in config else config
        for section in sections:
            node = node[section]
        if field not in node:
            raise KeyError(f"no config field {name!r}")
        if isinstance(node[field], ml_collections.ConfigDict):
            # a section: a name picks its component (residual="hc"), a dict sets the named fields
            node[field].update(dict(name=value) if isinstance(value, str) else value)
        else:
            node[field] = value
    return config


def tiny_config(**model_overrides) -> ml_collections.ConfigDict:
    config = base_config()
    config.steps = 5
    config.batch_size = 8
    config.seq_len = 16
    config.log_every = 1
    config.eval_every = 1000
    config.eval_batches = 1
    config.checkpoint_every = 1000
    config.sample_tokens = 0
    config.optimizer.warmup_steps = 2
    config.mesh.data = 1
    model = config.model
    model.d_model, model.num_layers = 32, 2
    model.attention.num_heads, model.attention.num_kv_heads = 4, 2
    return override(config, **model_overrides)


def tiny_model(seed: int = 0, devices: int = 1, **model_overrides):
    """(resolved model config, TransformerLM) on the default device."""
    config = tiny_config(**model_overrides)
    config.mesh.data = devices
    config = resolve(config, devices)
    return config.model, TransformerLM(config.model, execution=config.execution,
                                       rngs=nnx.Rngs(seed))



def train_on_mesh(model: dict, devices: int, mesh: tuple[int, int, int], tokens,
                  parameter: tuple[str, ...], steps: int):
    """(initial logits, losses of `steps` train steps on the one batch `tokens`, the sharding
    spec of the stacked block parameter at `parameter`) of the tiny LM with the `model`
    overrides on a data × fsdp × tensor `mesh` of the first `devices` devices."""
    config = tiny_config(**model)
    config.optimizer.update(learning_rate=1e-2, warmup_steps=1)
    config.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    config = resolve(config, devices)
    program = TrainProgram(config, make_mesh(config, jax.devices()[:devices]))
    state = program.init(0)

    def logits(params, tokens):
        return nnx.merge(program.graphdef, params, state["model_state"])(tokens[:, :-1])

    with jax.set_mesh(program.mesh):
        initial = jax.device_get(jax.jit(logits)(state["params"], program.put_batch(tokens)))
    leaf = state["params"]["blocks"]
    for key in parameter:
        leaf = leaf[key]
    losses = []
    for _ in range(steps):
        state, metrics = program.train_step(state, program.put_batch(tokens))
        losses.append(float(metrics["loss"]))
    return initial, losses, tuple(leaf[...].sharding.spec)

def random_tokens(shape, seed: int = 1):
    return jax.random.randint(jax.random.key(seed), shape, 0, 256)


class JittedDecoder:
    """`model.decode` and `init_cache` for `prefill_then_decode`, compiled once per shape."""

    def __init__(self, model):
        self.model = model
        self._decode = nnx.jit(lambda model, tokens, positions, cache:
                               model.decode(tokens, positions, cache))

    def init_cache(self, batch, length):
        return self.model.init_cache(batch, length)

    def decode(self, tokens, positions, cache):
        return self._decode(self.model, tokens, positions, cache)


def prefill_then_decode(model, tokens_BxT, prefill: int, cache_length: int):
    """Logits from a KV-cache run: the first `prefill` tokens at once, then one token at a time.

    Equal to `model(tokens_BxT)` for a causal model; tests compare the two."""
    import jax.numpy as jnp

    batch, length = tokens_BxT.shape
    cache = model.init_cache(batch, cache_length)
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    logits, cache = model.decode(tokens_BxT[:, :prefill], positions[:, :prefill], cache)
    steps = [logits]
    for t in range(prefill, length):
        logits, cache = model.decode(tokens_BxT[:, t:t + 1], positions[:, t:t + 1], cache)
        steps.append(logits)
    return jnp.concatenate(steps, axis=1)


def write_run(config, workdir, step: int) -> None:
    """A run directory as `train.loop.train` leaves it (config.json, a checkpoint at `step`),
    holding the initial state: restoring is what the script tests, not training."""
    from train.checkpoint import Checkpointer
    from train.step import build_program, resolve_for_job

    config = resolve_for_job(config)
    program = build_program(config)
    with Checkpointer(workdir) as checkpointer:
        checkpointer.save(step, program.init(config.seed), {"next_step": step, "seed": 0},
                          force=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")


def tiny_prepared(tmp_path_factory, docs_per_shard: int) -> Path:
    """A tiny prepared dataset: 8 byte-level documents, every 2nd to validation, its plan
    prepare.json beside the shards."""
    from train.data.preparation import prepare

    sources = tmp_path_factory.mktemp("sources")
    for index in range(8):
        (sources / f"doc{index}.txt").write_text(f"document {index} " * 40)
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(str(sources / "*.txt"), "byte", out, docs_per_shard=docs_per_shard,
            validation_every=2, progress=False)
    return out
