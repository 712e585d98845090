"""The per-op profile of a compiled step (train/instruments/op_profile.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from train.instruments import op_profile


def test_nested_events_count_once_for_the_innermost_op():
    """A loop's event encloses its body's ops: the loop keeps only its own time."""
    events = [(0, 100, "while"), (10, 30, "dot"), (40, 60, "add"), (45, 50, "copy"),
              (120, 130, "dot")]
    assert op_profile.exclusive_times(events) == {"while": 60, "dot": 30, "add": 15, "copy": 5}


def step_of_a_scan():
    def loss(w, x):
        def layer(x, _):
            return jnp.tanh(x @ w), None  # the matmul of this line
        return jax.lax.scan(layer, x, None, length=3)[0].sum()
    return jax.jit(jax.grad(loss)), jnp.full((256, 256), 0.01), jnp.ones((256, 256))


def test_describe_names_each_instructions_primitive_and_source_line():
    grad, w, x = step_of_a_scan()
    ops = op_profile.describe(grad.lower(w, x).compile().as_text())
    line = step_of_a_scan.__code__.co_firstlineno + 3
    dots = [op for op in ops.values() if op[1] == "dot_general"]
    assert dots and all(source == f"test_op_profile.py:{line}" for _, _, source in dots)
    assert {"while", "parameter"} <= {opcode for opcode, _, _ in ops.values()}


def test_the_profile_sees_the_steps_ops_by_their_instruction_names():
    grad, w, x = step_of_a_scan()
    ops = op_profile.describe(grad.lower(w, x).compile().as_text())
    grad(w, x).block_until_ready()
    times = op_profile.profile(lambda: grad(w, x).block_until_ready(), 2)
    assert times and set(times) <= set(ops)
    rows = op_profile.table(times, ops)
    assert [row["seconds"] for row in rows] == sorted(times.values(), reverse=True)
    by_primitive = op_profile.by_primitive(rows)
    assert sum(by_primitive.values()) == pytest.approx(sum(times.values()))
    assert "dot_general" in by_primitive
