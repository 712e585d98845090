"""The config resolved once by one owner (`config.resolve`): frozen with its mesh, taken as is by
everything that builds a program, refused unresolved, and, in a CLI run, every check made
exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from config import ConfigError, is_resolved, resolve
from sharding.environment import device_count_from_environment
from sharding.mesh import make_mesh
from tests.helpers import one_device_env, tiny_config
from train.loop import train
from train.step import TrainProgram, build_program

ROOT = Path(__file__).resolve().parents[1]


def test_resolve_fills_the_derived_fields_and_freezes_with_the_mesh():
    config = tiny_config()
    config.update(dict(batch_size=8, accumulation_steps=2, mesh=dict(data=-1, tensor=2)))
    resolved = resolve(config, 8)
    assert is_resolved(resolved) and not is_resolved(config)
    assert config.model.ffn.d_ff is None  # the input is left as it was
    assert resolved.model.ffn.d_ff == 4 * 32 and resolved.model.attention.head_dim == 8
    assert resolved.model.max_seq_len == config.seq_len
    assert dict(resolved.resolved.mesh) == dict(data=4, fsdp=1, tensor=2, sequence=1, stage=1,
                                                expert=1)
    assert (resolved.resolved.device_count, resolved.resolved.batch_shards,
            resolved.resolved.microbatch_size) == (8, 4, 4)
    with pytest.raises((AttributeError, ValueError, TypeError)):
        resolved.model.d_model = 64
    assert resolve(resolved, 8) == resolved  # resolving again changes nothing


@pytest.mark.parametrize("fields,devices,message", [
    (dict(mesh=dict(data=3)), 8, "mesh=data=3 is invalid: its product 3 ≠ the 8 devices"),
    (dict(mesh=dict(data=-1, fsdp=-1)), 8, "mesh.fsdp=-1 is invalid: only one mesh axis"),
    (dict(batch_size=6, mesh=dict(data=-1)), 4,
     "batch_size=6 is invalid: must be divisible by mesh.data×mesh.fsdp×mesh.expert = 4"),
    (dict(mesh=dict(data=1, tensor=-1)), 8,
     "model.attention.num_heads=4 is invalid: must be divisible by mesh.tensor=8"),
], ids=["product", "two-free-axes", "batch", "heads-over-tensor"])
def test_mesh_arithmetic_is_resolved_without_devices(fields, devices, message):
    config = tiny_config()
    config.update(fields)
    with pytest.raises(ConfigError) as error:
        resolve(config, devices)
    assert str(error.value).startswith(message)


def test_what_builds_a_program_takes_only_a_resolved_config(tmp_path):
    config = tiny_config()
    for taker in (build_program, lambda c: TrainProgram(c, None), make_mesh,
                  lambda c: train(c, tmp_path)):
        with pytest.raises(TypeError, match="takes a resolved config"):
            taker(config)
    assert not (tmp_path / "config.json").exists()
    with pytest.raises(ConfigError, match="resolved for 1 devices, not the 8 here"):
        make_mesh(resolve(config, 1), jax.devices())


@pytest.mark.parametrize("environ,count", [
    ({"JAX_PLATFORMS": "cpu"}, 1),
    ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 8),
    ({"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4",
      "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}, 4),
    ({"JAX_PLATFORMS": "cuda"}, None),
    ({"JAX_PLATFORMS": "cpu", "JAX_COORDINATOR_ADDRESS": "localhost:1234"}, None),
], ids=["cpu", "host-flag", "num-cpu-devices", "accelerator", "several-processes"])
def test_the_device_count_is_read_from_the_environment_when_it_says(environ, count):
    assert device_count_from_environment(environ) == count


# Each check of a CLI run, by its defining module: each must run exactly once.
CHECKS = {
    "config.resolution": ["resolve"],
    "config.validate": ["check_fields", "check_training"],
    "config.catalogue": ["check_names"],
    "config.model_rules": ["resolve_model", "check_execution"],
    "config.mesh_shape": ["mesh_shape", "ici_dcn_shapes"],
    "train.data.tokenizer": ["check_vocab"],
    "train.rundir": ["check_workdir", "check_not_locked", "check_resume"],
}

COUNTING_RUN = """
import json, sys
import train.__main__ as cli, train.loop, train.step, sharding.mesh
checks = json.loads(sys.argv[1])
calls = {}

def counting(name, function):
    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return function(*args, **kwargs)
    return wrapper

originals = {}
for module, names in checks.items():
    for name in names:
        originals[getattr(sys.modules[module], name)] = f"{module}.{name}"
for module in list(sys.modules.values()):  # every binding, `from X import f` included
    if getattr(module, "__name__", "").split(".")[0] in ("config", "sharding", "arch", "train"):
        for attribute, value in list(vars(module).items()):
            if callable(value) and value in originals:
                setattr(module, attribute, counting(originals[value], value))
code = cli.main(["train", *sys.argv[2:]])
print(json.dumps({"code": code, "calls": calls}))
"""


@pytest.mark.slow
def test_a_cli_run_resolves_and_checks_the_config_once(tmp_path):
    overrides = ["--config.steps=2", "--config.batch_size=2", "--config.seq_len=16",
                 "--config.model.d_model=16", "--config.model.num_layers=1",
                 "--config.model.attention.num_heads=2", "--config.model.attention.num_kv_heads=2",
                 "--config.optimizer.warmup_steps=1", "--config.eval_every=100",
                 "--config.eval_batches=1", "--config.sample_tokens=0", "--config.mesh.data=1"]
    done = subprocess.run(
        [sys.executable, "-c", COUNTING_RUN, json.dumps(CHECKS), "--config",
         "experiments/quickstart.py", "--workdir", str(tmp_path / "run"), *overrides],
        cwd=ROOT, env=one_device_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    expected = {f"{module}.{name}": 1 for module, names in CHECKS.items() for name in names}
    assert result["calls"] == expected
