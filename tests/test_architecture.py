"""The import graph runs one way: config (leaf) → sharding → arch → train, inside train the run
directory → data → the trainer's core → instruments → interop → studies, inside arch the kernels
(JAX and each other only) → the mechanisms → the model assembly, and no library package imports
experiments/ or scripts/ (the import-linter contracts in pyproject.toml). A back-edge breaks the
contract it crosses; every module of train is in a layer; no function-local import hides one;
the config leaf loads without JAX; no two modules share a name."""

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("config", "sharding", "arch", "train", "experiments", "scripts")
LIBRARY = ("config", "sharding", "arch", "train")  # the packages the contracts order
TOML = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
CONTRACTS = {contract["id"]: contract["name"] for contract in TOML}


def lint_imports(root: Path) -> tuple[int, str]:
    """(exit status, output with whitespace collapsed) of lint-imports run on the tree at `root`
    (its packages, not those of this checkout: the tree is first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as lint; "
         "lint()", "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def test_the_repository_keeps_every_contract():
    assert set(CONTRACTS) == {"layers", "train", "experiments", "kernels", "assembly", "scripts"}
    status, output = lint_imports(ROOT)
    assert status == 0, output
    for name in CONTRACTS.values():
        assert f"{name} KEPT" in output, output


# (file, line appended to it, the contract it breaks)
BACK_EDGES = [
    ("sharding/rules.py", "import train.loop", "layers"),
    ("arch/model.py", "import train.step", "layers"),
    ("config/derived.py", "import arch.model", "layers"),
    ("train/loop.py", "from train.instruments import probes", "train"),
    ("train/step.py", "from train.studies import stats", "train"),
    ("train/data/in_memory.py", "import train.loop", "train"),
    ("train/instruments/probes.py", "import train.interop.hf", "train"),
    ("train/interop/hf.py", "import train.studies.sweep", "train"),
    ("arch/norms.py", "import experiments.common", "experiments"),
    ("arch/kernels/block_scan.py", "from arch.residual import constrain_state", "kernels"),
    ("arch/kernels/sinkhorn.py", "from config import check", "kernels"),
    ("arch/deltanet.py", "from arch.model import TransformerLM", "assembly"),
    ("train/studies/study.py", "from scripts import study_report", "scripts"),
]


@pytest.mark.parametrize("path, line, broken", BACK_EDGES,
                         ids=[f"{path}:{line}" for path, line, _ in BACK_EDGES])
def test_a_back_edge_breaks_its_contract(tmp_path, path, line, broken):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / path, "a") as file:
        file.write(f"\n{line}  # a back-edge\n")
    status, output = lint_imports(tmp_path)
    assert status != 0, output
    assert f"{CONTRACTS[broken]} BROKEN" in output, output
    for kept in set(CONTRACTS) - {broken}:
        assert f"{CONTRACTS[kept]} KEPT" in output, output


def test_every_module_of_train_is_in_a_layer():
    """A module the train contract does not name would be free of it."""
    layers = next(contract for contract in TOML if contract["id"] == "train")["layers"]
    named = {name.strip() for layer in layers for name in layer.replace(":", "|").split("|")}
    present = {path.stem if path.suffix == ".py" else path.name
               for path in (ROOT / "train").iterdir()
               if (path.suffix == ".py" and path.stem != "__init__")
               or (path / "__init__.py").exists()}
    assert present == named


def test_no_two_modules_share_a_name():
    names = {}
    for package in LIBRARY:
        for path in (ROOT / package).rglob("*.py"):
            if path.stem not in ("__init__", "__main__"):
                names.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}


def _imports_in_functions(tree: ast.Module):
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, ast.Import):
                    yield node, [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    yield node, [node.module]


def test_no_function_local_import_of_a_project_package():
    """A function-local import of the project's own packages is how a cycle hides from the import
    graph; the library has none. Entry points (`__main__.py`, `train/generate.py` and
    `train/seeds.py`, run with `python -m`) may defer heavy imports until their arguments are
    checked. Third-party imports
    (matplotlib, loaded on the first plot) may be local."""
    found = []
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name == "__main__.py" or path in (ROOT / "train" / "generate.py",
                                                       ROOT / "train" / "seeds.py"):
                continue
            for node, modules in _imports_in_functions(ast.parse(path.read_text())):
                if any(module.split(".")[0] in PACKAGES for module in modules):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {', '.join(modules)}")
    assert not found, "function-local imports of project packages:\n" + "\n".join(found)


def test_arch_imports_exactly_the_catalogues_modules_by_name():
    """`arch/__init__.py` imports the zoo's modules statically (tools and `git bisect` see them),
    and they are the modules the catalogue's records name."""
    from config.catalogue import modules

    tree = ast.parse((ROOT / "arch/__init__.py").read_text())
    imported = [alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "arch" for alias in node.names]
    assert "importlib" not in (ROOT / "arch/__init__.py").read_text()
    assert sorted(imported) == sorted(modules())
    assert len(tree.body) == 2  # the docstring and the import


def test_the_config_leaf_imports_no_jax():
    probe = ("import sys, config, config.cli, config.defaults, config.derived; "
             "print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
