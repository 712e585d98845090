"""Test set-up, before JAX initializes: 8 simulated CPU devices, f32 matmuls, and LLVM's cheapest
code generation (the suite's time is mostly compiling small programs; results are unchanged)."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _data_dir(tmp_path_factory):
    """Prepare the embedded corpus into a fresh directory: tests never read a user's cache."""
    os.environ["BLOCKBENCH_DATA_DIR"] = str(tmp_path_factory.mktemp("tfds"))
