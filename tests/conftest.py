"""Test set-up, before JAX initializes: 8 simulated CPU devices, f32 matmuls, LLVM's cheapest
code generation and XLA:CPU's elemental emitters in place of its fusion emitters (the suite's time
is mostly compiling small programs; these compile about 3× faster, and results are unchanged)."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One compilation cache per test run, shared by the xdist workers and by the scripts the tests
# start (through the environment: every program, however quickly it compiles, since at this
# optimization level almost none takes JAX's default threshold of a second): tests that build
# the same tiny program compile it once. Removed when the run ends.
_RUN = os.environ.setdefault("BLOCKBENCH_TEST_RUN", os.environ.get("PYTEST_XDIST_TESTRUNUID",
                                                                   str(os.getpid())))
COMPILATION_CACHE = os.path.join(tempfile.gettempdir(), f"blockbench-test-compiles-{_RUN}")
os.environ.update(JAX_COMPILATION_CACHE_DIR=COMPILATION_CACHE,
                  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                  JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _data_dir(tmp_path_factory):
    """Prepare the embedded corpus into a fresh directory: tests never read a user's cache."""
    os.environ["BLOCKBENCH_DATA_DIR"] = str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Unmap the machine code of the module's compiled programs once it is done: JAX's caches
    keep every program loaded, about 3 memory maps each, and one process running the whole
    suite (`pytest -n 0`) crashed in XLA on reaching Linux's limit of 65,530 maps per process
    (vm.max_map_count). A program needed again is read back from the compilation cache."""
    yield
    jax.clear_caches()


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller, after every worker
        shutil.rmtree(COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture
def register_component(monkeypatch):
    """`register_component(registry, name, component, **record)`: `component` registered as
    `name` in the live `arch` registry and, with a record (`config.catalogue.plugin`, the given
    `Component` fields), in the catalogue, both restored when the test ends."""
    from config import catalogue

    def register(registry, name, component, **record):
        monkeypatch.setitem(registry, name, component)
        monkeypatch.setitem(catalogue.records(registry.family), name,
                            catalogue.plugin(registry.family, component.__module__, **record))
        return name

    return register
